"""Where a layer group's key list and writes live: the planner's full slots, translated once
into the group's SWA space for an SWA group (DESIGN invariant 1), or kept full for a full group
(and by the fault switches that reproduce engines that skipped it)."""
from __future__ import annotations

import torch

from swafactory.errors import SpaceError
from swafactory.kvcache.locs import Locs

__all__ = ["group_space"]


def group_space(key: str, sub_pool: str, source, skip_translation: bool, full_id: str,
                slots: torch.Tensor, writes: torch.Tensor | None,
                memo: dict[int, Locs] | None = None,
                computed: dict[int, torch.Tensor] | None = None,
                reads_full: bool = False) -> tuple[Locs, Locs | None]:
    """Full slots → the group's index space: translated once, here, for an SWA group.

    slots: [n] int64 full slots; writes: [total_q] int64 or None. ``memo`` (id of a full-slot
    tensor → its translation) lets groups that share a key list share its translation;
    ``computed`` (id of a full-slot tensor → SWA slots) holds what the fused kernel already
    gathered, which `translate` checks and wraps instead of gathering again. ``reads_full``:
    the fault switch of sglang #27737, the key list stays full, the writes are translated."""
    # the planner's own int64 slots: no __post_init__ call (`Locs._made` checks them inline)
    full_kv = Locs._made("full", full_id, slots)
    full_w = Locs._made("full", full_id, writes) if writes is not None else None
    if sub_pool != "swa" or skip_translation:
        return full_kv, full_w
    if source is None:
        raise SpaceError(f"layer group {key!r} reads an SWA sub-pool, but the resolver found "
                         "no KV source to translate full slots against")
    memo = {} if memo is None else memo

    def tr(locs: Locs) -> Locs:
        if id(locs.tensor) not in memo:
            memo[id(locs.tensor)] = source.translate(
                locs, values=(computed or {}).get(id(locs.tensor)))
        return memo[id(locs.tensor)]
    return (full_kv if reads_full else tr(full_kv)), (tr(full_w) if full_w is not None else None)
