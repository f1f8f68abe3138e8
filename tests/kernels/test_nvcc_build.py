"""nvcc's build off a GPU, with a fake compiler found through CUDA_HOME: a timeout kills the
whole process group (not just the driver) and removes the partial cubin, and a build that timed
out or that nvcc refused is reported once and never started again in the process."""
from __future__ import annotations

import logging
import os
import signal
import time

import pytest

from swafactory.kernels.cuda import launch

# the driver starts a "ptxas" that keeps rewriting the output, records its pid, then hangs
HANGS = """\
for a; do [ "$prev" = -o ] && out=$a; prev=$a; done
( while :; do printf . >> "$out"; sleep 0.05; done ) &
echo $! > "{dir}/child.pid"
exec sleep 600
"""
# refuses BN=32 with an error on stderr, builds anything else
REFUSES_BN32 = """\
for a; do [ "$prev" = -o ] && out=$a; prev=$a; done
case " $* " in *" -DBN=32 "*)
    echo "ptxas info: compiling" >&2
    echo "fake.cu(3): error: BN=32 does not fit" >&2
    exit 2;;
esac
printf cubin > "$out"
"""


@pytest.fixture
def fake_nvcc(tmp_path, monkeypatch):
    """Writes ``$CUDA_HOME/bin/nvcc`` from a shell body (each start appends to calls.txt), with a
    fresh cache and nothing remembered as failed; yields (write, source, cache dir)."""
    monkeypatch.setattr(launch, "_failed", {})
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("SWAFACTORY_CACHE", str(tmp_path / "cache"))
    (tmp_path / "bin").mkdir()
    source = tmp_path / "fake.cu"
    source.write_text('extern "C" __global__ void fake() {}\n')

    def write(body: str) -> None:
        nvcc = tmp_path / "bin" / "nvcc"
        nvcc.write_text(f'#!/bin/sh\necho start >> "{tmp_path}/calls.txt"\n'
                        + body.format(dir=tmp_path))
        nvcc.chmod(0o755)

    launch.nvcc_path.cache_clear()  # found through CUDA_HOME, as on a CUDA machine
    yield write, source, tmp_path / "cache" / "cuda"
    launch.nvcc_path.cache_clear()
    launch.set_build_timeout(launch.DEFAULT_BUILD_TIMEOUT_S)


def _starts(tmp_path) -> int:
    calls = tmp_path / "calls.txt"
    return len(calls.read_text().splitlines()) if calls.exists() else 0


def _reports(caplog, needle: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == launch.__name__ and needle in r.getMessage()]


def _alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie waiting for init to reap it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # no /proc: a pid that answers is alive
        return True


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_timeout_kills_the_whole_group_and_is_not_waited_out_twice(fake_nvcc, tmp_path,
                                                                     caplog):
    write, source, cache = fake_nvcc
    write(HANGS)
    launch.set_build_timeout(1.0)
    caplog.set_level(logging.WARNING, logger=launch.__name__)
    child = None
    try:
        with pytest.raises(launch.KernelBuildError, match="nvcc timed out after 1 s on fake.cu"):
            launch.build_cubin(source, "90a", {"BN": 32})
        child = int((tmp_path / "child.pid").read_text())
        assert _gone_within(child, 10), f"the compiler's child {child} outlived the timeout"
        time.sleep(0.2)  # a survivor rewrites the output every 50 ms
        assert not list(cache.glob("*.tmp")), "the partial cubin was left in the cache"
        reported = _reports(caplog, "fake.cu")
        assert len(reported) == 1 and "timed out after 1 s" in reported[0], reported
        key = reported[0].split("flags key ")[1].split(":")[0]
        assert key and "not built again" in reported[0]

        t0 = time.monotonic()
        with pytest.raises(launch.KernelBuildError, match="nvcc timed out after 1 s on fake.cu"):
            launch.build_cubin(source, "90a", {"BN": 32})
        assert time.monotonic() - t0 < 0.5, "the second request waited for a build"
        assert _starts(tmp_path) == 1, "the compiler was started again"
        assert len(_reports(caplog, key)) == 1, "the failure was reported twice"
    finally:  # whatever failed above, leave nothing running
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)


def test_a_refused_build_is_reported_once_with_its_tail_and_other_flags_still_build(
        fake_nvcc, tmp_path, caplog):
    write, source, cache = fake_nvcc
    write(REFUSES_BN32)
    caplog.set_level(logging.WARNING, logger=launch.__name__)
    for _ in range(2):
        with pytest.raises(launch.KernelBuildError, match="nvcc failed on fake.cu.*-DBN=32"):
            launch.build_cubin(source, "90a", {"BN": 32})
    assert _starts(tmp_path) == 1
    reported, = _reports(caplog, "fake.cu")
    assert "-DBN=32" in reported and "exited with 2" in reported
    assert "error: BN=32 does not fit" in reported  # the tail of nvcc's stderr

    assert launch.build_cubin(source, "90a", {"BN": 64}) == b"cubin"  # another flags key
    assert _starts(tmp_path) == 2
    assert launch.build_cubin(source, "90a", {"BN": 64}) == b"cubin"  # now from the cache
    assert _starts(tmp_path) == 2
    assert not list(cache.glob("*.tmp")) and len(_reports(caplog, "fake.cu")) == 1


def test_a_compiler_that_cannot_start_is_tried_again(fake_nvcc, tmp_path):
    write, source, _ = fake_nvcc
    write("")
    (tmp_path / "bin" / "nvcc").chmod(0o644)  # not executable: an OSError, which costs no wait
    for _ in range(2):
        with pytest.raises(launch.KernelBuildError, match="nvcc could not run.*Permission"):
            launch.build_cubin(source, "90a", {"BN": 32})
    assert launch._failed == {}
