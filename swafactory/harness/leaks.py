"""Leak accounting at the end of a run: every pool back to its capacity, every row released.

The books live in the shared parts (`RequestSlots.leaks`, the allocators, `ReqToToken`); this
module names them per pool for the report. A draft pool has no allocator of its own: it is
addressed by the target's slots (DESIGN invariant 6), so its count is the one of the space it is
indexed by, and a leak there shows under both names.
"""
from __future__ import annotations

from swafactory.harness.setup import Parts

__all__ = ["leaked", "leak_message"]

_UNITS = {"req_to_token": "rows", "free_and_mapped": "slots (free, yet linked by the full→SWA mapping)"}


def leaked(parts: Parts) -> dict[str, int]:
    """Slots (rows for ``req_to_token``) that no open request accounts for, per pool or table.

    Keys: the allocator's spaces (``target.full``, and ``target.swa`` on a split pool), each draft
    sub-pool (``draft.full``, ``draft.swa``), ``req_to_token`` and ``free_and_mapped`` (slots both
    free and linked by the full→SWA mapping); every key is present, zeros included. Once every
    request has finished, anything non-zero is a leak.
    """
    books = parts.slots.leaks()
    out = {k: v for k, v in books.items() if k not in ("req_to_token", "free_and_mapped")}
    if parts.draft_pool is not None:
        for sub in parts.draft_pool.sub_pools:
            out[sub.pool_id] = books[sub.indexed_by]
    out["req_to_token"] = books["req_to_token"]
    out["free_and_mapped"] = books["free_and_mapped"]
    return out


def leak_message(leaked: dict[str, int]) -> str:
    """One line naming the pools that leaked and how much (``no leaks`` when all are zero)."""
    bad = [f"{k} {v} {_UNITS.get(k, 'slots')}" for k, v in leaked.items() if v]
    if not bad:
        return "no leaks"
    shared = any(k.startswith("draft.") and v for k, v in leaked.items())
    return ("leaked at the end of the run: " + ", ".join(bad)
            + (" (a draft pool is addressed by the target's slots: its count is the target "
               "space's, not more)" if shared else ""))
