"""The FlashInfer the adapter starts with: a version outside the pin is refused with the reason
and the pin; the packed-mask layout self-check passes on 0.6.18's semantics and catches a
FlashInfer that reads the mask elsewhere (CPU, through `flashinfer_fake`); on the GPU it runs
against the installed FlashInfer."""
from __future__ import annotations

import sys

import pytest
import torch
from flashinfer_fake import module as fake_flashinfer

from swafactory.errors import ConfigError
from swafactory.kernels import flashinfer_check as fc


@pytest.fixture
def fake(monkeypatch):
    mod = fake_flashinfer()
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    return mod


@pytest.mark.parametrize("version", ["0.7.0", "0.6.17", "1.0.0", "nightly"])
def test_an_untested_flashinfer_is_refused_with_the_reason_and_the_pin(fake, version):
    from swafactory.kernels.flashinfer import Adapter

    fake.__version__ = version
    with pytest.raises(ConfigError) as err:
        Adapter()
    r, = err.value.reasons
    assert f"flashinfer {version} is installed" in r.message and fc.PIN in r.message
    assert "_cached_module.plan" in r.message and "bit offsets" in r.message  # the reason
    assert fc.PIN in r.fix


@pytest.mark.parametrize("version", ["0.6.18", "0.6.18.post1", "0.6.19", "0.6.25+cu130"])
def test_the_tested_versions_start(fake, version):
    from swafactory.kernels.flashinfer import Adapter

    fake.__version__ = version
    Adapter()
    assert fc.check_version() == version


def test_without_flashinfer_there_is_nothing_to_check(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    assert fc.installed_version() is None and fc.check_version() is None


def test_the_pin_in_pyproject_is_the_one_checked():
    import tomllib
    from pathlib import Path

    meta = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    extra = meta["project"]["optional-dependencies"]["flashinfer"]
    assert fc.PIN in extra


def test_the_layout_check_passes_on_the_tested_layout(fake):
    err = fc.check_mask_layout(torch.device("cpu"))
    assert err <= 3e-2


def test_the_layout_check_catches_a_flashinfer_that_reads_byte_offsets(fake):
    base = fake.BatchPrefillWithPagedKVCacheWrapper

    class ByteOffsets(base):  # a FlashInfer whose plan hands the kernel byte offsets
        def plan(self, *args, **kwargs):
            super().plan(*args, **kwargs)
            if self.packed is not None:
                sizes = self.mask_indptr[1:] - self.mask_indptr[:-1]
                off = torch.zeros_like(self.mask_indptr)
                off[1:] = torch.cumsum((sizes + 7) // 8, 0)
                self.mask_indptr = off

    fake.BatchPrefillWithPagedKVCacheWrapper = ByteOffsets
    with pytest.raises(fc.FlashInferLayoutError, match="reads the adapter's packed custom mask "
                                                       "differently.*bit offsets"):
        fc.check_mask_layout(torch.device("cpu"))


@pytest.mark.gpu
def test_the_installed_flashinfer_reads_the_adapters_mask_layout():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("flashinfer")
    assert fc.check_version() is not None
    err = fc.check_mask_layout(torch.device("cuda"))
    assert err <= 3e-2
    fc.check_at_start(torch.device("cuda"))  # once per process: the second call is free
    assert torch.cuda.current_device() in fc._done


@pytest.mark.parametrize("choice,full_on_flashinfer", [("library", True), ("auto", False)])
def test_the_verify_choice_decides_who_serves_gemma4s_wide_verify(fake, choice,
                                                                  full_on_flashinfer):
    """`backend.kernels.full.verify=library` keeps the full layers' wide verify on FlashInfer's
    prefill; `auto` hands it to our tiles. Outputs equal the oracle either way."""
    import swafactory
    from test_backends_vs_oracle import assert_close, run_mode
    from test_flashinfer_host import adapter_world

    from swafactory.registry.device import H200
    from swafactory.registry.kernel_choice import KernelPolicy, resolve_passes

    world, _ = adapter_world("gemma4", 1, ["model.sliding_window=8", "model.num_layers=6"])
    cfg = swafactory.compose(["model=gemma4", "backend=flashinfer", "spec=eagle3",
                              f"backend.kernels.full.verify={choice}"])
    ad = world.backend.adapter
    ad.kernels = KernelPolicy(resolve_passes(cfg, H200, nvcc=True))
    planned = []
    real = ad._plan_wrapper

    def spy(p, sig, device):
        planned.append((p.group, p.decode, int((p.qo_host[1:] - p.qo_host[:-1]).max())))
        return real(p, sig, device)

    ad._plan_wrapper = spy
    assert_close(run_mode(world, "verify_chain", [0, 5], 8))
    step = {g for g, dec, n in planned if not dec and n <= 8}  # the step, not the prefill
    assert ("full" in step) == full_on_flashinfer, planned
