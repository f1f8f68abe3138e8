"""The CUDA kernels off a GPU: they compile for Hopper without spills (where nvcc is present,
as on CI), and every route to them refuses clearly where they cannot run."""
from __future__ import annotations

import re
import subprocess

import pytest
import torch

from swafactory.kernels.cuda import launch
from swafactory.kernels.cuda.verify import _SRC, verify_d512_kernel


def _ptxas(kern: launch.CudaKernel, tmp_path) -> tuple[int, tuple[str, ...], str]:
    """Compiles ``kern``'s source with its defines for sm_90a: (registers a thread, (stack frame,
    spill stores, spill loads) bytes, ptxas's log); the compile must succeed."""
    flags = [f"-D{k}={v}" for k, v in kern.defines.items()]
    res = subprocess.run([launch.nvcc_path(), "-cubin", "-O3", "-std=c++17",
                          "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v", *flags,
                          "-o", str(tmp_path / "k.cubin"), str(kern.source)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    regs = int(re.search(r"Used (\d+) registers", res.stderr).group(1))
    spills = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill "
                       r"loads", res.stderr).groups()
    return regs, spills, res.stderr


@pytest.mark.skipif(launch.nvcc_path() is None, reason="nvcc is not installed")
@pytest.mark.parametrize("wgmma", [1, 0])  # Hopper's shipped tile, and the mma.sync one
def test_the_shipped_verify_tile_compiles_for_sm90a_without_spills(tmp_path, wgmma):
    kern = verify_d512_kernel(wgmma=wgmma)
    regs, spills, log = _ptxas(kern, tmp_path)
    assert regs <= 255 and spills == ("0", "0", "0"), log
    assert kern.smem_bytes <= 227 * 1024  # one block per multiprocessor on Hopper


def test_build_cubin_names_the_missing_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("SWAFACTORY_CACHE", str(tmp_path))
    monkeypatch.setattr(launch, "nvcc_path", lambda: None)
    with pytest.raises(launch.KernelBuildError, match="nvcc was not found"):
        launch.build_cubin(_SRC, "90a", {"BN": 32})


def test_the_tile_is_unavailable_off_a_gpu_and_when_switched_off(monkeypatch):
    assert not launch.cuda_kernels_available(torch.device("cpu"))
    monkeypatch.setenv("SWAFACTORY_CUDA_KERNELS", "0")
    assert not launch.cuda_kernels_available(torch.device("cuda", 0))


def test_requiring_the_tile_where_it_cannot_serve_says_what_it_needs():
    from kernel_batches import Req, make_batch
    from swafactory.kernels.triton.extend import extend_attention

    batch = make_batch([Req(list(range(40)), list(range(32, 40)))], hq=8, hkv=1, d=16)
    with pytest.raises(ValueError, match="head_dim 512"):
        extend_attention(*batch.args(), scale=0.25, max_q_len=8, cuda=True)


def test_a_tile_that_does_not_build_falls_back_with_one_warning(monkeypatch):
    from swafactory.kernels.cuda import verify

    def refuse(self, device):
        raise launch.KernelBuildError("nvcc failed on verify_d512.cu: unsupported gpu architecture")

    verify._builds.cache_clear()
    monkeypatch.setattr(launch, "_warned", set())  # one warning per cause and process
    monkeypatch.setattr(launch.CudaKernel, "_function", refuse)
    try:
        with pytest.warns(RuntimeWarning, match="Triton tile serves.*unsupported gpu"):
            assert verify._builds(0, (32, 2)) is False
        assert verify._builds(0, (32, 2)) is False  # cached: no second warning, no second build
    finally:
        verify._builds.cache_clear()


def test_the_kernels_refuse_rows_they_cannot_copy_16_bytes_at_a_time():
    from swafactory.kernels.cuda.launch import aligned16

    pool = torch.zeros(10, 4, 512, dtype=torch.bfloat16)
    assert aligned16(pool)
    assert not aligned16(pool.view(-1)[4:4 + 9 * 4 * 512].view(9, 4, 512))  # 8-byte base
    assert not aligned16(torch.zeros(10, 4, 516, dtype=torch.bfloat16)[..., :512])  # odd stride
    fp8 = torch.zeros(10, 4, 264, dtype=torch.float8_e4m3fn)
    assert aligned16(fp8[..., :256]) is False  # a 264-byte row stride: 8 bytes off by row 1
    assert aligned16(torch.zeros(10, 4, 256, dtype=torch.float8_e4m3fn))


@pytest.mark.skipif(launch.nvcc_path() is None, reason="nvcc is not installed")
@pytest.mark.parametrize("cluster", [1, 2, 4, 8])
def test_the_cluster_decode_kernel_compiles_for_sm90a_without_spills(tmp_path, cluster):
    from swafactory.kernels.cuda.decode import decode_d64_kernel

    kern = decode_d64_kernel(8, cluster)
    regs, spills, log = _ptxas(kern, tmp_path)
    # four CTAs of 128 threads a multiprocessor: ≤ 128 registers and ≤ 56 KB of shared memory
    assert regs <= 128 and spills == ("0", "0", "0"), log
    assert 4 * (kern.smem_bytes + 1024) <= 228 * 1024


@pytest.mark.skipif(launch.nvcc_path() is None, reason="nvcc is not installed")
@pytest.mark.parametrize("d,group", [(256, 2), (512, 8)])
@pytest.mark.parametrize("cluster", [1, 2, 4, 8])
def test_the_fp8_decode_kernel_compiles_for_sm90a_without_spills(tmp_path, d, group, cluster):
    from swafactory.kernels.cuda.decode_fp8 import ctas_per_sm, decode_fp8_kernel, fp8_tile

    bn, stages, _ = fp8_tile(d)
    kern = decode_fp8_kernel(d, group, cluster, bn, stages)
    regs, spills, log = _ptxas(kern, tmp_path)
    # two CTAs of 128 threads a multiprocessor, each with NS - 1 tiles of K/V in flight
    assert regs <= 128 and spills == ("0", "0", "0"), log
    assert ctas_per_sm(d, bn, stages) == 2 and 2 * (kern.smem_bytes + 1024) <= 228 * 1024


def test_the_fp8_tile_knob_is_checked(monkeypatch):
    from swafactory.kernels.cuda.decode_fp8 import fp8_tile

    assert fp8_tile(512) == (32, 3, 0) and fp8_tile(256) == (64, 3, 0)
    monkeypatch.setenv("SWAFACTORY_FP8_TILE", "64x2x2")
    assert fp8_tile(512) == (64, 2, 2)
    for bad in ("16x3", "32x9", "32x3x3", "32"):
        monkeypatch.setenv("SWAFACTORY_FP8_TILE", bad)
        with pytest.raises(ValueError, match="SWAFACTORY_FP8_TILE=.*BNxSTAGES"):
            fp8_tile(512)


def test_an_fp8_decode_kernel_that_does_not_build_falls_back_with_one_warning(monkeypatch):
    from swafactory.kernels.cuda import decode_fp8

    def refuse(self, device):
        raise launch.KernelBuildError("nvcc failed on decode_fp8.cu: unsupported gpu architecture")

    decode_fp8._builds.cache_clear()
    monkeypatch.setattr(launch.CudaKernel, "_function", refuse)
    try:
        with pytest.warns(RuntimeWarning, match="Triton decode serves fp8.*unsupported gpu"):
            assert decode_fp8._builds(0, 512, 8, None) is False
        assert decode_fp8._builds(0, 512, 8, None) is False  # cached: no second warning
    finally:
        decode_fp8._builds.cache_clear()


def test_cluster_splits_fill_one_wave_and_never_split_past_the_tiles():
    from swafactory.kernels.cuda.decode import cluster_splits

    # GPT-OSS bs 8: 8 splits would fill 97% of 528 slots, more than whole GPCs hold
    assert cluster_splits(8 * 8, 8192, 132) == 4
    assert cluster_splits(8 * 8, 8192, 132, per_sm=6) == 8
    assert cluster_splits(64 * 8, 8192, 132) == 1   # bs 64: 512 CTAs unsplit
    assert cluster_splits(16 * 8, 8192, 132) == 2
    assert cluster_splits(8 * 8, 129, 132) == 2     # a W = 128 list: three tiles
    assert cluster_splits(8 * 8, 129, 132, hint=1) == 1
    assert cluster_splits(8 * 8, 129, 132, bn=128) == 2
    assert cluster_splits(1, 100000, 132) == 8      # a portable cluster holds 8 CTAs
    assert cluster_splits(1000, 8192, 132) == 1


def test_requiring_the_cluster_decode_where_it_cannot_serve_says_what_it_needs():
    from kernel_batches import Req, make_batch
    from swafactory.kernels.triton.decode import decode_attention

    batch = make_batch([Req(list(range(40)), [39])], hq=8, hkv=1, d=64)
    with pytest.raises(ValueError, match="head_dim 64 or an fp8_e4m3 pool at head_dim 256/512"):
        decode_attention(*batch.args(), scale=0.25, cuda=True)


def test_a_decode_kernel_that_does_not_build_falls_back_with_one_warning(monkeypatch):
    from swafactory.kernels.cuda import decode

    def refuse(self, device):
        raise launch.KernelBuildError("nvcc failed on decode_d64.cu: unsupported gpu architecture")

    decode._builds.cache_clear()
    monkeypatch.setattr(launch.CudaKernel, "_function", refuse)
    try:
        with pytest.warns(RuntimeWarning, match="Triton decode serves.*unsupported gpu"):
            assert decode._builds(0, 8, None) is False
        assert decode._builds(0, 8, None) is False  # cached: no second warning
    finally:
        decode._builds.cache_clear()


def test_the_decode_tile_knob_is_checked(monkeypatch):
    from swafactory.kernels.cuda.decode import tile

    assert tile(64, 132) == (64, 3, 0)
    monkeypatch.setenv("SWAFACTORY_DECODE_TILE", "128x2x4")
    assert tile(64, 132) == (128, 2, 4)
    for bad in ("96x3", "64x9", "64x3x3", "64"):
        monkeypatch.setenv("SWAFACTORY_DECODE_TILE", bad)
        with pytest.raises(ValueError, match="SWAFACTORY_DECODE_TILE=.*BNxSTAGES"):
            tile(64, 132)
