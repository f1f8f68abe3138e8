"""The host side that both cluster decode kernels (``decode_d64.cu``, ``decode_fp8.cu``) share:
how many splits a (request, KV head) takes, and a pass's shapes, outputs and launch inputs."""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from swafactory.kernels.cuda.launch import sm_count

__all__ = ["cluster_splits", "ClusterPass", "cluster_pass"]


def cluster_splits(programs: int, keys_per_request: float, sms: int,
                   hint: int | None = None, per_sm: int = 4, bn: int = 64) -> int:
    """Splits per (request, KV head), a power of two ≤ 8 (a portable cluster), from static sizes:
    the most that keep ``programs`` × splits CTAs in one wave on ``sms`` multiprocessors holding
    ``per_sm`` CTAs each, and no more splits than ``bn``-key tiles. ``hint`` (a caller's split
    count, e.g. planned from a window) caps it. GPT-OSS on the H200 (132 SMs, 8 KV heads, 8192
    keys): 4 splits at bs 8 with 4 CTAs a multiprocessor (8 with 6), 1 at bs 64."""
    slots = per_sm * sms
    tiles = max(1, -(-int(keys_per_request) // bn))
    cap = min(8, tiles, hint or 8)
    s = 1
    # a cluster's CTAs must share a GPC: leave a tenth of the slots to that granularity (8 × 8
    # CTAs at 4 a multiprocessor, 97% of the H200's slots, ran as two waves)
    while s * 2 <= cap and programs * s * 2 * 10 <= slots * 9:
        s *= 2
    return s


class ClusterPass(NamedTuple):
    """A decode pass as a cluster kernel launches it: grid (splits, hkv, nb) of ``bn``-key tiles
    in ``stages`` shared-memory stages. With no request only the shapes and outputs are set."""
    nb: int
    hq: int
    hkv: int
    o: torch.Tensor  # like q [B, Hq, D]
    lse: torch.Tensor  # [B, Hq] fp32
    kv_indices: torch.Tensor  # int32
    sinks: torch.Tensor | None  # fp32, contiguous
    bn: int = 0
    stages: int = 0
    splits: int = 0

    @property
    def group(self) -> int:
        return self.hq // self.hkv


def cluster_pass(q: torch.Tensor, k_buf: torch.Tensor, kv_indices: torch.Tensor,
                 sinks: torch.Tensor | None, num_splits: int | None,
                 tile: Callable[[int, int], tuple[int, int, int]],
                 per_sm: Callable[[int, int], int]) -> ClusterPass:
    """The pass over q [B, Hq, D] and a pool [rows, Hkv, D]: ``tile(programs, sms)`` gives (keys
    per tile, stages, forced splits or 0) and ``per_sm(bn, stages)`` the CTAs a multiprocessor
    holds; ``num_splits`` caps the splits. Nothing is planned for an empty batch (no device
    query, no tile knob read)."""
    nb, hq, _ = q.shape
    hkv = k_buf.shape[1]
    o = torch.empty_like(q)
    lse = torch.empty(nb, hq, dtype=torch.float32, device=q.device)
    if nb == 0:
        return ClusterPass(nb, hq, hkv, o, lse, kv_indices, sinks)
    if kv_indices.dtype != torch.int32:  # pool rows fit int32; the kernels read int32
        kv_indices = kv_indices.to(torch.int32)
    sms = sm_count(q.device.index)
    bn, stages, splits = tile(nb * hkv, sms)
    splits = splits or cluster_splits(nb * hkv, kv_indices.numel() / nb, sms, num_splits,
                                      per_sm(bn, stages), bn)
    sk = sinks.float().contiguous() if sinks is not None else None
    return ClusterPass(nb, hq, hkv, o, lse, kv_indices, sk, bn, stages, splits)
