"""Move K/V between full slots of one pool, in every layer: the accepted tree path into place.

Both slot lists are full-space; the SWA sub-pool's rows are found by translating them through
the pool's own registered mapping (DESIGN invariant 1: translate before indexing).
"""
from __future__ import annotations

import torch

from swafactory.errors import SpaceError
from swafactory.kvcache.locs import Locs, translate
from swafactory.kvcache.pool import HybridSWAPool
from swafactory.kvcache.quant import is_fp8

__all__ = ["move_kv"]


def move_kv(pool: HybridSWAPool, src: Locs, dst: Locs) -> None:
    """Copy K/V of ``src`` slots to ``dst`` slots (both ``[n]`` full-space) in every layer.

    Gathers before scattering, so overlapping lists (a path moved toward the prefix) are safe.
    """
    if pool.read_only:
        raise SpaceError(f"pool {pool.name!r} is a read-only view; its KV cannot be moved")
    if len(src) != len(dst):
        raise ValueError(f"move_kv needs as many sources as destinations, got {len(src)} → "
                         f"{len(dst)}")
    for sub in pool.sub_pools:
        if sub.space == "swa":
            if pool.mapping is None:
                raise SpaceError(f"pool {pool.name!r} has an SWA sub-pool but no mapping")
            s, d = translate(src, pool.mapping, sub), translate(dst, pool.mapping, sub)
        else:
            s, d = src, dst
        if not (sub.accepts(s) and sub.accepts(d)):
            raise SpaceError(f"move_kv: {s.space}-space slots of {s.pool_id!r} cannot index "
                             f"{sub.pool_id!r}")
        si, di = s.tensor.long(), d.tensor.long()
        for i in sub.held:  # a layer built without rows has nothing to move
            # the stored bytes move as they are (an fp8 row keeps its scale)
            for buf in (sub.k_bufs[i], sub.v_bufs[i]):
                raw = buf.view(torch.uint8) if is_fp8(buf.dtype) else buf
                raw.index_copy_(0, di, raw.index_select(0, si))
