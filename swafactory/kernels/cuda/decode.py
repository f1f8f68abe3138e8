"""Split-KV decode at head_dim 64, its splits merged inside a thread-block cluster
(``decode_d64.cu``): one launch a layer where the Triton decode needs a second for the merge.

It serves the triton backend's bf16 decode passes at head_dim 64 (GPT-OSS) on Hopper. Measured on
the H200 (GPT-OSS-20b, ctx 8192, the step's K/V written by the kernel, captured in a graph;
bench/results/README.md): a full layer at bs 64 in 265 µs = 96% of copy
bandwidth (the Triton decode: 277 µs, 92%); at bs 8 52 µs against 52 for Triton's kernel + merge.
The whole GPT-OSS step replays in 0.568 ms (1.48× the floor) at bs 8 and 3.19 ms (1.04×) at bs 64
(`49b0cc2`, bench/results/README.md), against 0.626 and 3.41 through the Triton
decode (`e864ce2`).
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from swafactory.kernels.cuda import kernel_env, parse_tile_knob
from swafactory.kernels.cuda.cluster import cluster_pass, cluster_splits
from swafactory.kernels.cuda.launch import CudaKernel, aligned16, is_hopper, loads_or_warns

__all__ = ["decode_d64", "decode_d64_serves", "decode_d64_kernel", "cluster_splits"]

_SRC = Path(__file__).with_name("decode_d64.cu")
_ARGS = ("ptr",) * 13 + ("i64",) * 10 + ("i32",) * 3 + ("f32",)
# (keys per tile, shared-memory stages) for every batch. Deeper rings for small batches (4, 5, 6
# or 8 stages, 128-key tiles) were slower at GPT-OSS bs 8 (bench/results/probe-decode-cuda-*.json)
_SHIPPED = (64, 3)


def tile(programs: int, sms: int) -> tuple[int, int, int]:
    """(keys per tile, stages, forced splits or 0) for ``programs`` (request, KV head) pairs on
    ``sms`` multiprocessors: ``SWAFACTORY_DECODE_TILE`` (benchmarks: ``BNxSTAGES[xSPLITS]``,
    BN 64 or 128; the running adapter's snapshot, `kernel_env`) or the shipped tile for the
    batch's size."""
    del programs, sms  # one tile serves every batch so far (see _SHIPPED)
    return _tile(kernel_env().decode_tile)


@functools.cache  # per knob value: a layer's call parses nothing
def _tile(knob: str | None) -> tuple[int, int, int]:
    return parse_tile_knob("SWAFACTORY_DECODE_TILE", knob, (64, 128), 8) or (*_SHIPPED, 0)


def _smem(bn: int, stages: int) -> int:
    return stages * 2 * bn * 128 + stages * bn * 4 + 2 * stages * 2 * bn * 4 + 2048


def ctas_per_sm(bn: int, stages: int) -> int:
    """CTAs of this tile a Hopper multiprocessor holds (228 KB of shared memory, 1 KB reserved
    a CTA; registers allow more)."""
    return max(1, min(8, 228 * 1024 // (_smem(bn, stages) + 1024)))


@functools.cache
def decode_d64_kernel(group: int, cluster: int, bn: int = 64, stages: int = 3) -> CudaKernel:
    """The kernel for a GQA group (≤ 8), ``cluster`` splits per (request, KV head) (1, 2, 4, 8),
    ``bn`` keys per tile and ``stages`` shared-memory stages."""
    return CudaKernel(_SRC, "decode_d64", _ARGS,
                      {"GROUP": group, "CLUSTER": cluster, "BN": bn, "NS": stages},
                      _smem(bn, stages))


def decode_d64_serves(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, group: int,
                      softcap: float | None, fp8_scaled: bool) -> bool:
    """Whether the cluster kernel serves this decode pass: bf16 q and pool, head_dim 64, GQA
    group ≤ 8, no softcap, no fp8, rows 16-byte aligned, on a Hopper (compute capability 9.x:
    clusters) GPU where the kernel builds, and ``SWAFACTORY_CUDA_DECODE`` not set to 0 (the
    switches and the tile from `kernel_env`: an adapter's call reads no environment)."""
    env = kernel_env()
    return (env.cuda_decode
            and q.dtype == torch.bfloat16 and k_buf.dtype == torch.bfloat16
            and v_buf.dtype == torch.bfloat16 and q.shape[-1] == 64 and 1 <= group <= 8
            and softcap is None and not fp8_scaled and q.is_cuda
            and all(aligned16(t) for t in (q, k_buf, v_buf))
            and env.cuda_on(q.device) and is_hopper(q.device.index)
            and _builds(q.device.index, group, env.decode_tile))


@functools.cache
def _builds(index: int | None, group: int, knob: str | None) -> bool:
    """Builds and loads every cluster size once per device and group; where nvcc or the driver
    refuses, the Triton decode serves instead, with one warning carrying the message. ``knob``
    (``SWAFACTORY_DECODE_TILE``) is part of the cache key: a benchmark's tile is built too."""
    bn, stages, _ = _tile(knob)
    return loads_or_warns([decode_d64_kernel(group, c, bn, stages) for c in (1, 2, 4, 8)], index,
                          "the CUDA decode kernel did not build, so the Triton decode serves "
                          "head_dim-64 decode instead")


def decode_d64(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
               kv_indptr: torch.Tensor, kv_indices: torch.Tensor, q_pos: torch.Tensor,
               kv_pos: torch.Tensor, *, window: int | None, scale: float,
               sinks: torch.Tensor | None, new_kv: tuple | None, dummy_rows: int,
               num_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention → (o [B, Hq, 64] bf16, lse [B, Hq] fp32).

    q: [B, Hq, 64] bf16 (one query per request), last dim contiguous; k_buf, v_buf: [rows, Hkv,
    64] bf16; kv_indptr: [B+1] int32; kv_indices: [total_kv] int32/int64 pool rows; q_pos: [B]
    int32; kv_pos: [total_kv] int32; sinks: [Hq] fp32 or None. new_kv: (k, v [B, Hkv, 64] bf16,
    slots [B] int64) written by the kernel (rows below ``dummy_rows`` are not written) and
    attended from the inputs, or None (the list's key at q's position is read from the pool).
    ``num_splits`` caps the split count (planned from static sizes otherwise). No host sync;
    capturable.
    """
    p = cluster_pass(q, k_buf, kv_indices, sinks, num_splits, tile, ctas_per_sm)
    if p.nb == 0:
        return p.o, p.lse
    kn = vn = wloc = None
    if new_kv is not None:
        kn, vn, wloc = new_kv
        kn, vn, wloc = kn.contiguous(), vn.contiguous(), wloc.contiguous()
    kern = decode_d64_kernel(p.group, p.splits, p.bn, p.stages)
    kern((p.splits, p.hkv, p.nb), 128, q, k_buf, v_buf, kv_indptr, p.kv_indices, q_pos, kv_pos,
         p.sinks, kn, vn, wloc, p.o, p.lse, q.stride(0), q.stride(1), k_buf.stride(0),
         k_buf.stride(1), v_buf.stride(0), v_buf.stride(1), kn.stride(0) if kn is not None else 0,
         kn.stride(1) if kn is not None else 0, p.o.stride(0), p.o.stride(1), p.hq,
         int(window or 0), int(dummy_rows), float(scale) * 1.4426950408889634)
    return p.o, p.lse
