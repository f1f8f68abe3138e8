"""The extend tile's shape and KV split count, chosen from static sizes (no device read), so a
shape's choice is stable under CUDA-graph capture. Measured choices; the kernel is `extend`."""
from __future__ import annotations

import torch

from swafactory.kernels.triton.merge import interpreting, plan_splits, sm_count

__all__ = ["extend_config", "extend_splits"]

INTERPRETED_BLOCK_N = 128
"""Keys per tile where Triton's interpreter runs the kernel (the CPU machine) at head_dim 256 and
512: the interpreter pays per tile and per op, not per key (a Gemma 4 verify over 1,100 keys:
2.5 s at 32 keys a tile, 1.8 s at 128), while 32 is a GPU register and shared-memory budget.
Smaller head dims keep the GPU's tiles, so the kernel tests still cross many tiles."""


def extend_config(head_dim: int, group: int, rows: int | None = None) -> tuple[int, ...]:
    """(BLOCK_M rows = queries × group heads, BLOCK_N keys, num_warps, num_stages, IDX_AHEAD).

    ``rows``: the longest request's queries × group. Up to 64 rows (a verify step, a short draft
    extend) the tile holds every row, so K/V is read once per KV head; 64 rows make one Hopper
    wgmma tile. Longer extends (prefill) take 32/64-row query tiles. IDX_AHEAD loads the next
    tile's pool rows by hand, one tile ahead (the gather's address chain is then off the
    critical path). Measured on an H200 at bs 64, ctx 8192, 8 tokens (bench/results/
    bench_triton_vs_flashinfer.md): D 512 × 64 rows: (64, 32, 8, 2, ahead) 2.01 ms against 2.25
    without the hand prefetch, 2.64 with one stage, 3.09 as two 32-row tiles, 4.11 as four
    16-row tiles (each re-reads K/V), 3.94 with 16 warps, 2.76 with 64-key tiles; a D-split
    (2 or 4 programs per tile, each owning D/2 or D/4 columns of V and o and recomputing the
    scores, ids adjacent so K comes from L2; tried at 73db9e7, reverted) 2.35–4.4 ms with 2 and
    3.7–4.8 with 4, although it removed the spills; D 256 × 16
    rows: (16, 32, 4, 3, ahead) 0.310 ms, 0.332 without the prefetch, 0.333 with 2 stages,
    0.352 with 64 keys and 8 warps, 0.50 with 32 keys and 8 warps.
    """
    cfg = _gpu_config(head_dim, group, rows)
    if head_dim >= 256 and interpreting():
        return (cfg[0], INTERPRETED_BLOCK_N, *cfg[2:])
    return cfg


def _gpu_config(head_dim: int, group: int, rows: int | None) -> tuple[int, ...]:
    gp = 1 << (group - 1).bit_length()
    if rows is not None and rows <= 64:
        block_m = max(16, gp, 1 << (rows - 1).bit_length())
        if head_dim >= 512:  # 64×512 fp32 accumulator: 8 warps; 2 stages of K/V fit shared memory
            return block_m, 32, 8, 2 if block_m >= 64 else 3, 1
        if head_dim >= 256:
            return block_m, 32, 4 if block_m <= 16 else 8, 3, 1
        return block_m, 64, 4, 3, 1
    block_m = max(16, gp, 32 if head_dim >= 512 else 64)
    if head_dim >= 256:
        return block_m, 32, 8, 3, 0
    return block_m, 64, 4, 3, 0


def extend_splits(programs: int, total_kv: int, batch: int, block_m: int, block_n: int,
                  head_dim: int, device: torch.device) -> int:
    """KV splits per program from static sizes. A 64×512 tile fills a multiprocessor alone (one
    program each), so splits only round the waves there; smaller tiles use ``plan_splits``."""
    if block_m >= 64 and head_dim >= 512:
        sms = sm_count(device)
        if programs >= sms:
            return 1
        avg = total_kv // max(batch, 1)
        return int(max(1, min(-(-sms // max(programs, 1)), -(-avg // (4 * block_n)), 64)))
    return plan_splits(programs, total_kv, batch, block_n, device)
