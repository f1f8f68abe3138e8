"""The dense run of a verify step at head_dim 512, 64 rows per KV head (``verify_d512.cu``)."""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from swafactory.kernels.cuda import kernel_env
from swafactory.kernels.cuda.launch import CudaKernel, aligned16, loads_or_warns

__all__ = ["dense_verify_d512", "verify_d512_serves", "verify_d512_kernel"]

_SRC = Path(__file__).with_name("verify_d512.cu")
_ARGS = ("ptr",) * 9 + ("i64",) * 6 + ("i32",) * 4 + ("f32",)


def tile_config(device: torch.device) -> tuple[int, ...]:
    """``SWAFACTORY_VERIFY_TILE`` (benchmarks: ``BNxSTAGES[xSPLITKVxLAZYxPAIRBARxFULLSxWGMMA]``,
    e.g. 32x2x0x0x0x0x1; the running adapter's snapshot, `kernel_env`) or the shipped tile:
    32-key tiles, 2 stages, wgmma on Hopper (compute capability 9.x), mma.sync elsewhere."""
    knob = kernel_env().verify_tile
    return _shipped(device.index) if not knob else _parsed(knob)


@functools.cache  # per knob value: a layer's call parses nothing
def _parsed(knob: str) -> tuple[int, ...]:
    try:
        cfg = tuple(int(x) for x in knob.lower().split("x"))
    except ValueError:
        cfg = ()
    if not 2 <= len(cfg) <= 7:
        raise ValueError(f"SWAFACTORY_VERIFY_TILE={knob!r}: expected BNxSTAGES[xSPLITKVxLAZYx"
                         "PAIRBARxFULLSxWGMMA] integers, e.g. 32x2 or 32x2x1x1x0x0x1")
    return cfg


@functools.cache
def _shipped(index: int | None) -> tuple[int, ...]:
    """The shipped tile for a device (its compute capability is read once)."""
    return (32, 2, 0, 0, 0, 0, int(torch.cuda.get_device_capability(index)[0] == 9))


@functools.cache
def verify_d512_kernel(bn: int = 32, stages: int = 2, split_kv: int = 0, lazy: int = 0,
                       pair_bar: int = 0, full_scores: int = 0, wgmma: int = 0) -> CudaKernel:
    """The kernel built with BN keys per tile, ``stages`` shared-memory stages and the .cu
    file's switches (SPLITKV, LAZY, PAIRBAR, FULLS, WGMMA; wgmma needs compute capability
    9.x). Measured on the H200 (bs 64, ctx 8192, 8 tokens; bench/results/
    probe-verify-cuda-d79e545.md): the dense run 1.197 ms with wgmma (85% of copy bandwidth),
    1.41-1.45 with mma.sync whatever the switches, 1.79 with FULLS or 16-key tiles."""
    smem = 64 * 1024 + 2 * stages * bn * 1024 + 8 * (bn // 8) * 32 * 16 + 1024
    return CudaKernel(_SRC, "verify_d512", _ARGS, {"BN": bn, "NS": stages, "SPLITKV": split_kv,
                                                  "LAZY": lazy, "PAIRBAR": pair_bar,
                                                  "FULLS": full_scores, "WGMMA": wgmma}, smem)


def verify_d512_serves(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, group: int,
                       rows: int) -> bool:
    """Whether the CUDA tile serves this pass: bf16 q and pool, head_dim 512, group 8, at most
    64 rows (queries × group) per request and KV head, rows 16-byte aligned (the tile copies
    16 bytes at a time), on a GPU where the kernel builds (the switch and the tile from
    `kernel_env`: an adapter's call reads no environment)."""
    return (q.dtype == torch.bfloat16 and k_buf.dtype == torch.bfloat16
            and v_buf.dtype == torch.bfloat16 and q.shape[-1] == 512 and group == 8
            and rows <= 64 and all(aligned16(t) for t in (q, k_buf, v_buf))
            and kernel_env().cuda_on(q.device)
            and _builds(q.device.index, tile_config(q.device)))


@functools.cache
def _builds(index: int | None, config: tuple[int, ...]) -> bool:
    """Builds and loads the tile once per device and config. Where nvcc or the driver refuses it
    (an nvcc too old for the GPU, say), the Triton tile serves instead, with one warning that
    carries nvcc's message."""
    return loads_or_warns([verify_d512_kernel(*config)], index,
                          "the CUDA verify tile did not build, so the Triton tile serves "
                          "head_dim-512 verify instead")


def dense_verify_d512(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                      qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                      kv_indices: torch.Tensor, rng: torch.Tensor, po: torch.Tensor,
                      plse: torch.Tensor, *, part_base: int, splits: int, scale: float,
                      config: tuple[int, ...] | None = None) -> None:
    """Writes the partial states of every request's dense run into ``po``/``plse``.

    q: [total_q, Hq, 512] bf16, last dim contiguous; k_buf, v_buf: [rows, Hkv, 512] bf16, last
    dim contiguous; qo_indptr, kv_indptr: [B+1] int32; kv_indices: [total_kv] int32 pool rows;
    rng: [B, 2] int32 dense runs (``extend.dense_runs``); po: [total_q, Hq, P, 512] fp32 and
    plse: [total_q, Hq, P] fp32, contiguous: partials ``part_base .. part_base + splits - 1``
    are written (an empty run writes o = 0, lse = -inf). ``scale``: the softmax scale (k_scale
    folded in by the caller). ``config``: ``verify_d512_kernel``'s arguments (None:
    ``tile_config(device)``). No host sync; capturable.
    """
    nb = qo_indptr.numel() - 1
    hq, hkv = q.shape[1], k_buf.shape[1]
    if kv_indices.dtype != torch.int32:
        raise ValueError(f"kv_indices must be int32 for the CUDA verify tile, got {kv_indices.dtype}")
    kern = verify_d512_kernel(*(config or tile_config(q.device)))
    kern((nb, hkv, splits), 256, q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, rng, po,
         plse, q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0),
         v_buf.stride(1), hq, splits, po.shape[2], part_base, float(scale) * 1.4426950408889634)
