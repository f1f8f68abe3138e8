"""bench/gpu.sh, the GPU host's one entry, takes OUT and named suites: `--help` prints its header
(every suite listed) and makes nothing (an empty `--help` folder once appeared in a checkout's
root), any other option or an unknown suite exits 2, and sourced it only sets the environment.
Every bench and probe answers ``--help`` on a machine without a GPU and makes nothing."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU_SH = ROOT / "bench" / "gpu.sh"
PY = sorted((ROOT / "bench").glob("*.py")) + sorted((ROOT / "bench" / "probes").glob("*.py"))


def _sh(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(GPU_SH), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=30)


def test_bench_holds_the_benches_and_one_gpu_script() -> None:
    top = sorted(p.name for p in (ROOT / "bench").iterdir()
                 if p.name not in ("README.md", "results", "probes", "__pycache__"))
    assert len(top) <= 15, top
    assert [p.name for p in (ROOT / "bench").glob("*.sh")] == ["gpu.sh"]


def _fault_lanes() -> dict[str, list[str]]:
    """gpu.sh's fault lists, as bash expands them: {name: [fault:spec[:model[:overrides]]]}."""
    text = GPU_SH.read_text()
    block = text[text.index("\nSHRINK="):text.index("\nfault_lane()")]
    out = {}
    for name in ("FAULTS_GUARDED", "FAULTS_UNGUARDED"):
        r = subprocess.run(["bash", "-c", block + f'\nprintf "%s\\n" "${{{name}[@]}}"'],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        out[name] = r.stdout.split()
    return out


def test_the_fault_suite_runs_every_shipped_fault() -> None:
    """The GPU half of the fault matrix (`faults`, and the evidence's `faults` part) launches
    each fault in conf/faults with its clean twin: a new fault that is not listed there never
    runs on a GPU."""
    lanes = _fault_lanes()
    listed = {e.split(":")[0] for e in lanes["FAULTS_GUARDED"]}
    shipped = {p.stem for p in (ROOT / "conf" / "faults").glob("*.yaml")}
    assert shipped == listed, (sorted(shipped - listed), sorted(listed - shipped))
    assert {e.split(":")[0] for e in lanes["FAULTS_UNGUARDED"]} <= shipped
    assert any(e.startswith("none:") for e in lanes["FAULTS_UNGUARDED"])


@pytest.mark.parametrize("backend", ["flashinfer", "triton"])
def test_every_fault_run_of_the_gpu_lanes_composes_and_fits_a_hopper_card(backend: str) -> None:
    """What a GPU call would find only after minutes: each run of both lanes (guards on, and
    off through run=generate) is a valid configuration that the backend serves on an H100/H200
    (a lane once passed `run.guards` to conformance runs, which have no such field, and sent
    FlashInfer a model of head_dim 16: every run was refused)."""
    import swafactory
    from swafactory.registry.device import H200

    for lane, fixed in (("FAULTS_GUARDED", []), ("FAULTS_UNGUARDED",
                                                 ["run=generate", "run.guards=false"])):
        for entry in _fault_lanes()[lane]:
            fault, spec, model, extra = (entry.split(":", 3) + ["", ""])[:4]
            cfg = swafactory.compose([f"backend={backend}", f"model={model or 'gemma4'}",
                                      "workload=smoke", f"faults={fault}", f"spec={spec}",
                                      *[x for x in extra.split(",") if x], *fixed])
            reasons = swafactory.check(cfg, H200)
            assert not reasons, (lane, entry, [str(r) for r in reasons])


@pytest.mark.parametrize("arg, rc", [("--help", 0), ("-h", 0), ("--deadline=5", 2)])
def test_an_option_is_not_an_out_folder(arg: str, rc: int, tmp_path: Path) -> None:
    r = _sh(arg, cwd=tmp_path)
    assert r.returncode == rc, r.stderr
    head = GPU_SH.read_text().splitlines()[1].lstrip("# ")
    assert r.stdout.startswith(head), r.stdout[:300]
    assert list(tmp_path.iterdir()) == []
    assert (rc == 0) is ("unknown option" not in r.stderr)


def test_help_lists_every_suite(tmp_path: Path) -> None:
    text = GPU_SH.read_text()
    suites = set(re.findall(r"^suite_(\w+)\(\)", text, re.M))
    assert {"tests", "matrix", "faults", "generate", "factory", "prefill", "fp8", "pages", "tp",
            "soak", "runahead", "graphs", "repro", "guards"} <= suites
    listed = set(re.findall(r"^ {2}(\w+) ", _sh("--help", cwd=tmp_path).stdout, re.M))
    listed |= set(re.findall(r"^ {2}\w+ .*? {2,}(\w+) {2,}", _sh("--help", cwd=tmp_path).stdout,
                             re.M))
    assert suites <= listed, sorted(suites - listed)


def test_it_runs_as_documented_without_bash(tmp_path: Path) -> None:
    """The docs call ``bench/gpu.sh OUT SUITE`` directly: the file is executable (its git mode
    once was 644, and a GPU host answered ``Permission denied``)."""
    r = subprocess.run([str(GPU_SH), "--help"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "Suites" in r.stdout, r.stderr


def test_an_unknown_suite_runs_nothing(tmp_path: Path) -> None:
    r = _sh(str(tmp_path / "out"), "tests", "nosuch", cwd=tmp_path)
    assert r.returncode == 2 and "unknown suite nosuch" in r.stderr
    assert not (tmp_path / "out" / "tests.txt").exists()


def test_sourced_it_sets_the_environment_only(tmp_path: Path) -> None:
    r = subprocess.run(["bash", "-c", f"WHEELS= FA4= . {GPU_SH} && echo $SWAFACTORY_GPU_ENV "
                        "$PYTORCH_CUDA_ALLOC_CONF && [[ $- != *u* ]] && echo still-here"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", "expandable_segments:True", "still-here"]
    assert list(tmp_path.iterdir()) == []


# every script's `--help` in one process (runpy, as `python SCRIPT --help` runs it): one torch
# import for all of them instead of one each
HELP_ALL = """
import contextlib, io, json, os, runpy, sys
out = {}
for path in sys.argv[1:]:
    sys.argv, so, se, rc = [path, "--help"], io.StringIO(), io.StringIO(), 0
    saved = list(sys.path)
    sys.path.insert(0, os.path.dirname(path))
    try:
        with contextlib.redirect_stdout(so), contextlib.redirect_stderr(se):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:  # noqa: BLE001 - reported per script
        rc, se = 1, io.StringIO(se.getvalue() + repr(e))
    sys.path[:] = saved
    out[path] = {"rc": rc, "stdout": so.getvalue(), "stderr": se.getvalue()[-2000:],
                 "made": sorted(os.listdir("."))}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def helps(tmp_path_factory) -> dict:
    cwd = tmp_path_factory.mktemp("help")
    r = subprocess.run([sys.executable, "-c", HELP_ALL, *map(str, PY)], cwd=cwd,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.splitlines()[-1])


@pytest.mark.xdist_group("bench_help")
@pytest.mark.parametrize("script", PY, ids=lambda p: p.relative_to(ROOT / "bench").as_posix())
def test_every_bench_and_probe_answers_help(script: Path, helps: dict) -> None:
    r = helps[str(script)]
    assert r["rc"] == 0, r["stderr"]
    assert r["stdout"].strip()
    assert r["made"] == [], r["made"]  # nothing made in the working folder


def test_bench_guards_help_makes_nothing_and_out_is_required(tmp_path: Path) -> None:
    """bench/bench_guards.py (a GPU bench) answers ``--help`` on any machine and makes nothing;
    a call without ``--out`` exits 2 naming it."""
    script = ROOT / "bench" / "bench_guards.py"
    r = subprocess.run([sys.executable, str(script), "--help"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: bench_guards.py") and "--out" in r.stdout
    assert "--cases" in r.stdout and "--ctx" in r.stdout
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "--out" in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_the_records_stay_small() -> None:
    """bench/results holds the current record per bench and card (git history keeps the old ones,
    a bench's output folder its raw rows and dumps): under 1 MB."""
    size = sum(p.stat().st_size for p in (ROOT / "bench" / "results").rglob("*") if p.is_file())
    assert size < 1_000_000, f"bench/results is {size:,} bytes; move superseded records out"


def test_every_probe_has_its_purpose_in_the_bench_readme() -> None:
    """bench/probes keeps only the probes gpu.sh runs or the docs cite, each listed with a one-line
    purpose in bench/README.md."""
    text = (ROOT / "bench" / "README.md").read_text()
    unlisted = [p.name for p in (ROOT / "bench" / "probes").glob("*.py")
                if f"[{p.name}](probes/{p.name})" not in text]
    assert not unlisted, unlisted
