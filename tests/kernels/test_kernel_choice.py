"""`backend.kernels`: which kernel serves each pass × group, refused where it cannot run, built
when the backend is built (never in a forward), and a build that fails falls back to the Triton
kernel with one warning naming the cause."""
from __future__ import annotations

import io
import subprocess
import warnings

import pytest
import torch

from swafactory import compose
from swafactory.errors import ConfigError
from swafactory.kernels.cuda import launch, verify
from swafactory.kernels.cuda.prepare import prepare_kernels
from swafactory.registry.device import CPU, H200
from swafactory.registry.kernel_choice import resolve_passes
from swafactory.registry.select import validate

GEMMA_VERIFY = ["backend=triton", "model=gemma4", "spec=eagle3"]  # verify/full: verify_d512


@pytest.fixture
def builds(monkeypatch, tmp_path):
    """A GPU-less stand-in for the build: nvcc 'present', an H200's arch, a fresh cache, and no
    cause warned about yet; the test patches what fails."""
    monkeypatch.setattr(launch, "_warned", set())
    monkeypatch.setattr(launch, "_failed", {})
    monkeypatch.setattr(launch, "nvcc_path", lambda: "/opt/cuda/bin/nvcc")
    monkeypatch.setattr(launch, "_arch", lambda device: "90a")
    monkeypatch.setattr(verify, "tile_config", lambda device: (32, 2, 0, 0, 0, 0, 1))
    monkeypatch.setenv("SWAFACTORY_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SWAFACTORY_CUDA_KERNELS", raising=False)
    verify.verify_d512_kernel.cache_clear()  # no kernel object loaded by an earlier test
    yield monkeypatch
    verify.verify_d512_kernel.cache_clear()
    verify._builds.cache_clear()
    launch.set_build_timeout(launch.DEFAULT_BUILD_TIMEOUT_S)


def _raise(exc):
    def run(*args, **kwargs):
        raise exc
    return run


def _prepare(*overrides: str):
    cfg = compose([*GEMMA_VERIFY, *overrides])
    return prepare_kernels(cfg, torch.device("cuda", 0), H200)


def _verify_full(policy) -> str:
    return next(line for line in policy.lines() if line.startswith("verify/full"))


CAUSES = {
    "no nvcc": (lambda mp, tmp: mp.setattr(launch, "nvcc_path", lambda: None),
                "no nvcc on PATH or CUDA_HOME"),
    "unwritable cache": (lambda mp, tmp: (tmp.joinpath("file").write_text("x"),
                                          mp.setenv("SWAFACTORY_CACHE", str(tmp / "file"))),
                         "is not writable"),
    "OSError": (lambda mp, tmp: mp.setattr(launch, "_run_nvcc",
                                           _raise(OSError(8, "Exec format error"))),
                "nvcc could not run.*Exec format error"),
    "timeout": (lambda mp, tmp: mp.setattr(launch, "_run_nvcc",
                                           _raise(subprocess.TimeoutExpired("nvcc", 300))),
                "nvcc timed out after 300 s"),
}


@pytest.mark.parametrize("cause", sorted(CAUSES))
def test_a_failed_build_falls_back_with_one_warning_naming_the_cause(builds, tmp_path, cause):
    make, pattern = CAUSES[cause]
    make(builds, tmp_path)
    with pytest.warns(RuntimeWarning, match=f"Triton kernels serve verify/full.*{pattern}"):
        policy = _prepare()
    assert policy.cuda("target_verify", sliding=False) is False  # the forward keeps CUDA out
    assert "triton extend tile (fallback: " in _verify_full(policy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same cause again: no second warning
        again = _prepare()
    assert again.lines() == policy.lines()


def test_a_build_that_fails_in_a_forward_warns_and_never_raises(builds, tmp_path):
    # a kernel not built by prepare (another group size, say) is built on first use: every
    # failure is caught there too, and the pass falls back
    builds.setattr(launch, "_run_nvcc", _raise(OSError(2, "No such file or directory")))
    verify._builds.cache_clear()
    with pytest.warns(RuntimeWarning, match="Triton tile serves.*nvcc could not run"):
        assert verify._builds(0, (32, 2, 0, 0, 0, 0, 1)) is False


def test_a_build_that_succeeds_serves_the_pass_with_cuda(builds, tmp_path):
    loaded = []
    builds.setattr(launch.CudaKernel, "load", lambda self, device: loaded.append(self.name))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        policy = _prepare()
    assert loaded == ["verify_d512"]  # exactly the kernels this config's passes use
    assert _verify_full(policy) == ("verify/full: cuda verify_d512 + triton extend tile "
                                    "(auto: nvcc present)")
    assert policy.cuda("target_verify", sliding=False) is None
    assert "decode/full: triton decode (auto: no CUDA kernel for this pass)" in policy.lines()


def test_the_policy_keeps_our_tiles_out_where_the_config_says_library(builds, tmp_path):
    builds.setattr(launch.CudaKernel, "load", lambda self, device: None)
    fi = ["backend=flashinfer", "model=gemma4", "spec=eagle3"]
    auto = prepare_kernels(compose(fi), torch.device("cuda", 0), H200)
    assert auto.ours("target_verify", sliding=False) and auto.ours("target_verify", True)
    lib = prepare_kernels(compose([*fi, "backend.kernels.full.verify=library"]),
                          torch.device("cuda", 0), H200)
    assert "verify/full: flashinfer BatchPrefill (config)" in lib.lines()
    assert not lib.ours("target_verify", sliding=False)
    assert lib.cuda("target_verify", sliding=False) is False


def test_the_timeout_reaches_nvcc(builds, tmp_path):
    seen = {}

    def run(cmd, **kwargs):
        seen.update(kwargs)
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"])

    builds.setattr(launch, "_run_nvcc", run)
    with pytest.warns(RuntimeWarning, match="timed out after 12 s"):
        _prepare("backend.kernels.build_timeout_s=12")
    assert seen["timeout"] == 12


def test_cuda_asked_for_and_not_built_is_refused_before_any_forward(builds, tmp_path):
    builds.setattr(launch, "_run_nvcc", _raise(subprocess.TimeoutExpired("nvcc", 300)))
    with pytest.raises(ConfigError) as err:
        _prepare("backend.kernels.full.verify=cuda")
    r, = err.value.reasons
    assert r.field == "backend.kernels.full.verify" and "timed out" in r.message
    assert r.fix == "backend.kernels.full.verify=auto"


def test_triton_asked_for_builds_nothing(builds, tmp_path):
    builds.setattr(launch, "_run_nvcc", _raise(AssertionError("nvcc must not run")))
    policy = _prepare("backend.kernels.full.verify=triton", "backend.kernels.full.extend=triton")
    assert _verify_full(policy) == "verify/full: triton extend tile (config)"
    assert policy.cuda("target_verify", sliding=False) is False
    assert policy.cuda("extend", sliding=False) is False


def test_a_bad_value_names_the_field():
    with pytest.raises(ConfigError, match=r"backend\.kernels\.full\.verify.*'auto', 'cuda', "
                                          r"'triton' or 'library', got 'fast'"):
        compose(["backend.kernels.full.verify=fast"])


def test_a_choice_the_backend_or_geometry_cannot_run_is_refused_with_every_reason():
    cfg = compose(["backend=flashinfer", "model=gemma4", "spec=eagle3",
                   "backend.kernels.swa.verify=cuda", "backend.kernels.full.decode=cuda",
                   "backend.kernels.full.extend=triton", "backend.kernels.swa.decode=library"])
    with pytest.raises(ConfigError) as err:
        validate(cfg, H200)
    by = {r.field: r for r in err.value.reasons}
    # library under flashinfer is fine, and so is its extend handed to our Triton kernel
    assert set(by) == {"backend.kernels.swa.verify", "backend.kernels.full.decode"}
    assert "head_dim 256" in by["backend.kernels.swa.verify"].message
    assert "the CUDA decode serves head_dim 64 over bfloat16" in \
        by["backend.kernels.full.decode"].message
    assert by["backend.kernels.full.decode"].fix == "backend.kernels.full.decode=auto"
    with pytest.raises(ConfigError, match="backend.kernels.full.decode.*library"):
        validate(compose([*GEMMA_VERIFY, "backend.kernels.full.decode=library"]), H200)
    with pytest.raises(ConfigError, match="need a CUDA device"):
        validate(compose(["backend=torch", "model=gemma4", "spec=eagle3",
                          "backend.kernels.full.verify=cuda"]), CPU)
    validate(compose([*GEMMA_VERIFY, "backend.kernels.full.verify=cuda"]), H200)  # it can


def test_the_plan_says_which_kernel_serves_each_pass(monkeypatch):
    from rich.console import Console

    from swafactory.cli.jobs import render_plan
    from swafactory.resolve.layout import describe

    monkeypatch.delenv("SWAFACTORY_CUDA_KERNELS", raising=False)
    monkeypatch.setattr(launch, "nvcc_path", lambda: "/opt/cuda/bin/nvcc")
    cfg = compose(["backend=flashinfer", "model=gemma4", "spec=eagle3"])
    out = io.StringIO()
    render_plan(describe(cfg, H200), Console(file=out, width=200))
    text = out.getvalue()
    # Gemma 4's eager verify of its full layers runs our tiles, not FlashInfer's prefill
    assert "verify/full: cuda verify_d512 + triton extend tile (auto: nvcc present)" in text
    assert "decode/full: flashinfer BatchDecode (library)" in text
    monkeypatch.setattr(launch, "nvcc_path", lambda: None)
    assert "verify/full: triton extend tile (fallback: no nvcc on PATH or CUDA_HOME)" in \
        describe(cfg, H200).passes
    monkeypatch.setenv("SWAFACTORY_CUDA_KERNELS", "0")
    assert "verify/full: triton extend tile (override: SWAFACTORY_CUDA_KERNELS=0)" in \
        describe(cfg, H200).passes


def test_run_plan_prints_the_passes(cli, tmp_path):
    import json

    out = cli("backend=torch", "model=gemma4", "spec=eagle3", "run=plan")
    assert out.returncode == 0, out.stderr
    assert "passes:" in out.stdout and "verify/full: torch fp32 gather+softmax (library)" in \
        out.stdout
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())["plan"]
    assert "extend/swa: torch fp32 gather+softmax (library)" in plan["passes"]


def test_every_pass_and_group_is_resolved():
    cfg = compose(["backend=triton", "model=gpt_oss_20b", "spec=none"])  # no verify pass
    got = [(r.pass_, r.group) for r in resolve_passes(cfg, H200, nvcc=True)]
    assert got == [("decode", "swa"), ("extend", "swa"), ("decode", "full"), ("extend", "full")]
    decode = resolve_passes(cfg, H200, nvcc=True)[0]
    assert str(decode) == "decode/swa: cuda decode_d64 (auto: nvcc present)"


@pytest.mark.gpu
def test_the_gpu_builds_what_the_config_picks_and_falls_back_on_a_timeout(tmp_path, monkeypatch):
    if not torch.cuda.is_available() or launch.nvcc_path() is None:
        pytest.skip("needs a CUDA GPU and nvcc")
    if torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("the verify tile needs SM >= 80")
    monkeypatch.setattr(launch, "_warned", set())
    monkeypatch.delenv("SWAFACTORY_CUDA_KERNELS", raising=False)
    policy = prepare_kernels(compose(GEMMA_VERIFY), torch.device("cuda"))
    assert _verify_full(policy) == ("verify/full: cuda verify_d512 + triton extend tile "
                                    "(auto: nvcc present)")
    kern = verify.verify_d512_kernel(*verify.tile_config(torch.device("cuda")))
    assert kern._fn, "built and loaded when the backend was built"
    monkeypatch.setenv("SWAFACTORY_CACHE", str(tmp_path))  # nothing cached: nvcc must run
    verify.verify_d512_kernel.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="timed out after 0.05 s"):
            policy = prepare_kernels(compose([*GEMMA_VERIFY,
                                              "backend.kernels.build_timeout_s=0.05"]),
                                     torch.device("cuda"))
        assert "triton extend tile (fallback: nvcc timed out" in _verify_full(policy)
        assert policy.cuda("target_verify", sliding=False) is False
    finally:
        verify.verify_d512_kernel.cache_clear()
        launch.set_build_timeout(launch.DEFAULT_BUILD_TIMEOUT_S)


def test_a_library_pass_handed_to_our_kernels_resolves_as_ours_beside_the_library():
    """GPT-OSS on flashinfer, its decode on our kernels (what `backend=auto` measures): the
    resolution names the kernel and the family it runs beside; verify stays FlashInfer's adapter
    (which runs our tiles itself), extend FlashInfer's prefill."""
    cfg = validate(compose(["backend=flashinfer", "model=gpt_oss_20b", "spec=eagle3",
                            "backend.kernels.swa.decode=triton",
                            "backend.kernels.full.decode=cuda"]), H200)
    lines = [str(r) for r in resolve_passes(cfg, H200, nvcc=True)]
    assert "decode/swa: triton decode (config, beside flashinfer)" in lines
    assert "decode/full: cuda decode_d64 (config, beside flashinfer)" in lines
    assert "extend/full: flashinfer BatchPrefill (library)" in lines
    b = cfg.backend
    assert [b.family_for(s, p) for s in (True, False) for p in ("decode", "verify", "extend")] \
        == ["triton", "flashinfer", "flashinfer"] * 2
    # a verify wider than our tile stays refused under flashinfer (no adapter of ours takes it)
    wide = compose(["backend=flashinfer", "model=gpt_oss_20b", "spec=eagle3",
                    "spec.topk=1", "spec.num_steps=15", "spec.num_draft_tokens=16",
                    "backend.kernels.full.verify=triton"])
    with pytest.raises(ConfigError, match="backend.kernels.full.verify.*its own kernel"):
        validate(wide, H200)
