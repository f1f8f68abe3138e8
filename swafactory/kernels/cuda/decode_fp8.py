"""Split-KV decode over an fp8 e4m3 pool at head_dim 256 and 512 (``decode_fp8.cu``): Gemma 4's
SWA and full layers, the e4m3 bytes converted in the MMA's registers, the splits merged in a
thread-block cluster.

It serves the triton backend's decode passes with ``backend.kv_dtype=fp8_e4m3`` on Hopper, where
neither FlashInfer (no head_dim-512 fp8 kernel on SM90; 1.23× its bf16 at 256) nor our Triton
tile (conversion-bound) reads fp8 K/V much faster than bf16.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from swafactory.kernels.cuda import kernel_env, parse_tile_knob
from swafactory.kernels.cuda.cluster import cluster_pass
from swafactory.kernels.cuda.launch import CudaKernel, aligned16, is_hopper, loads_or_warns

__all__ = ["decode_fp8", "decode_fp8_serves", "decode_fp8_kernel", "fp8_tile"]

_SRC = Path(__file__).with_name("decode_fp8.cu")
_ARGS = ("ptr",) * 10 + ("i64",) * 8 + ("i32",) * 2 + ("f32",) * 2
# (keys per tile, shared-memory stages) per head_dim
_SHIPPED = {256: (64, 3), 512: (32, 3)}


def fp8_tile(d: int) -> tuple[int, int, int]:
    """(keys per tile, stages, forced splits or 0) at head_dim ``d``: ``SWAFACTORY_FP8_TILE``
    (benchmarks: ``BNxSTAGES[xSPLITS]``, BN 32 or 64; the running adapter's snapshot,
    `kernel_env`) or the shipped tile."""
    return _tile(d, kernel_env().fp8_tile)


@functools.cache  # per head_dim and knob value: a layer's call parses nothing
def _tile(d: int, knob: str | None) -> tuple[int, int, int]:
    return parse_tile_knob("SWAFACTORY_FP8_TILE", knob, (32, 64), 6) or (*_SHIPPED[d], 0)


def _smem(d: int, bn: int, stages: int) -> int:
    return stages * 2 * bn * d + stages * bn * 4 + 2 * stages * 2 * bn * 4 + 4 * (bn // 16) * 512


def ctas_per_sm(d: int, bn: int, stages: int) -> int:
    """CTAs of this tile a Hopper multiprocessor holds (228 KB of shared memory, 1 KB reserved
    a CTA; 128 threads of at most 128 registers allow four)."""
    return max(1, min(4, 228 * 1024 // (_smem(d, bn, stages) + 1024)))


@functools.cache
def decode_fp8_kernel(d: int, group: int, cluster: int, bn: int, stages: int) -> CudaKernel:
    """The kernel for head_dim ``d`` (256, 512), a GQA group (≤ 8), ``cluster`` splits per
    (request, KV head) (1, 2, 4, 8), ``bn`` keys per tile and ``stages`` shared-memory stages."""
    return CudaKernel(_SRC, "decode_fp8", _ARGS,
                      {"D": d, "GROUP": group, "CLUSTER": cluster, "BN": bn, "NS": stages},
                      _smem(d, bn, stages))


def decode_fp8_serves(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, group: int,
                      softcap: float | None) -> bool:
    """Whether this kernel serves the decode pass: bf16 q over e4m3 pools, head_dim 256 or
    512, GQA group ≤ 8, no softcap, rows 16-byte aligned, on a Hopper GPU where it builds, and
    ``SWAFACTORY_CUDA_DECODE`` not set to 0 (the switches and the tile from `kernel_env`: an
    adapter's call reads no environment)."""
    d = q.shape[-1]
    env = kernel_env()
    return (env.cuda_decode
            and q.dtype == torch.bfloat16 and k_buf.dtype == torch.float8_e4m3fn
            and v_buf.dtype == torch.float8_e4m3fn and d in (256, 512) and 1 <= group <= 8
            and softcap is None and q.is_cuda
            and all(aligned16(t) for t in (q, k_buf, v_buf))
            and env.cuda_on(q.device) and is_hopper(q.device.index)
            and _builds(q.device.index, d, group, env.fp8_tile))


@functools.cache
def _builds(index: int | None, d: int, group: int, knob: str | None) -> bool:
    """Builds and loads every cluster size once per device, head_dim and group; where nvcc or
    the driver refuses, the Triton decode serves instead, with one warning. ``knob``
    (``SWAFACTORY_FP8_TILE``) is part of the cache key: a benchmark's tile is built too."""
    bn, stages, _ = _tile(d, knob)
    return loads_or_warns([decode_fp8_kernel(d, group, c, bn, stages) for c in (1, 2, 4, 8)],
                          index, "the CUDA fp8 decode kernel did not build, so the Triton "
                          "decode serves fp8 decode at head_dim 256/512 instead")


def decode_fp8(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
               kv_indptr: torch.Tensor, kv_indices: torch.Tensor, q_pos: torch.Tensor,
               kv_pos: torch.Tensor, *, window: int | None, scale: float, k_scale: float,
               v_scale: float, sinks: torch.Tensor | None,
               num_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention over an fp8 pool → (o [B, Hq, D] bf16, lse [B, Hq] fp32).

    q: [B, Hq, D] bf16 (one query per request), last dim contiguous, D 256 or 512; k_buf,
    v_buf: [rows, Hkv, D] float8_e4m3fn holding K / k_scale and V / v_scale; kv_indptr: [B+1]
    int32; kv_indices: [total_kv] int32/int64 pool rows; q_pos: [B] int32; kv_pos: [total_kv]
    int32; sinks: [Hq] fp32 or None. The step's K/V is in the pool already (stored, quantized,
    before the call). ``num_splits`` caps the split count (planned from static sizes
    otherwise). No host sync; capturable.
    """
    d = q.shape[2]
    p = cluster_pass(q, k_buf, kv_indices, sinks, num_splits, lambda programs, sms: fp8_tile(d),
                     functools.partial(ctas_per_sm, d))
    if p.nb == 0:
        return p.o, p.lse
    kern = decode_fp8_kernel(d, p.group, p.splits, p.bn, p.stages)
    kern((p.splits, p.hkv, p.nb), 128, q, k_buf, v_buf, kv_indptr, p.kv_indices, q_pos, kv_pos,
         p.sinks, p.o, p.lse, q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1),
         v_buf.stride(0), v_buf.stride(1), p.o.stride(0), p.o.stride(1), p.hq, int(window or 0),
         float(scale) * float(k_scale) * 1.4426950408889634, float(v_scale))
    return p.o, p.lse
