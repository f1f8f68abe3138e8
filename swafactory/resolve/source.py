"""Which pool a runner translates full slots against: one pure function (DESIGN invariant 2).

`resolve_kv_source` is called by the planner once per forward, from the runner's *current* state,
and its answer is never cached at construction: a FROZEN_KV draft's active pool is swapped per
call, and a cached answer is how sglang #26957 crashed (trtllm_mha past ~85% pool use).

Truth table of policy ``auto`` (sglang-swa-facts §B.2, tested row by row in §F):

=====================================  =========================================================
runner                                 KV source
=====================================  =========================================================
active pool split                      the active pool
draft that owns its pool               None (its pool is full-indexed: no translation)
draft that reads the target (FROZEN)   the target's pool, through the allocator
anything else                          the allocator's pool if split, else None
=====================================  =========================================================

Pinned policies answer one rule each: ``active_pool`` (the active pool if split) and
``allocator`` (the allocator's pool if split). ``allocator`` is wrong for a draft that owns its
pool (sglang #25103, #27737); the registry refuses that pairing, this function just answers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from swafactory.errors import SpaceError
from swafactory.fault_counts import FAULT_COUNTS
from swafactory.kvcache.locs import Locs, SlotMapping, translate

__all__ = ["Role", "Policy", "POLICIES", "KVPoolLike", "RunnerView", "TargetView", "DraftView",
           "KVSource", "resolve_kv_source"]

Role = Literal["target", "draft_own_pool", "draft_reads_target"]
Policy = Literal["auto", "active_pool", "allocator"]
POLICIES: tuple[Policy, ...] = ("auto", "active_pool", "allocator")
_ROLES = ("target", "draft_own_pool", "draft_reads_target")


class KVPoolLike(Protocol):
    """What the resolver needs of a pool (a `HybridSWAPool`)."""

    @property
    def pool_id(self) -> str: ...

    @property
    def is_split(self) -> bool: ...

    @property
    def mapping(self) -> SlotMapping | None: ...


class RunnerView(Protocol):
    """The four facts the answer depends on, read fresh on every call."""

    @property
    def active_pool(self) -> KVPoolLike | None:
        """The pool this runner's attention reads and writes right now (may be swapped per call)."""

    @property
    def allocator_pool(self) -> KVPoolLike | None:
        """The pool of the shared allocator (sglang ``allocator.get_kvcache()``): the target's."""

    @property
    def role(self) -> Role:
        """``target``, ``draft_own_pool`` (EAGLE, DFlash, …) or ``draft_reads_target``
        (FROZEN_KV)."""

    @property
    def spec_algorithm(self) -> str:
        """Spec algorithm key (``none``, ``eagle``, ``frozen_kv_mtp``, …)."""


@dataclass
class TargetView:
    """The simplest view: a target runner whose active pool is the allocator's."""

    active_pool: object
    allocator_pool: object | None = None
    role: str = "target"
    spec_algorithm: str = "none"

    def __post_init__(self) -> None:
        if self.allocator_pool is None:
            self.allocator_pool = self.active_pool


class DraftView:
    """A concrete `RunnerView` for a draft runner: the driver (the harness, the generator, an
    engine) swaps ``active_pool`` around each forward of a FROZEN_KV draft; the other facts are
    fixed."""

    def __init__(self, active_pool, allocator_pool, role: Role, spec_algorithm: str) -> None:
        self.active_pool, self.allocator_pool = active_pool, allocator_pool
        self.role, self.spec_algorithm = role, spec_algorithm


@dataclass(frozen=True, eq=False)
class KVSource:
    """The split pool to translate against, its full→SWA mapping, and the rule that chose it."""

    pool: KVPoolLike
    mapping: SlotMapping
    rule: str

    def translate(self, locs: Locs, values=None) -> Locs:
        """Full-space ``locs`` → SWA-space slots of this source's pool (``values``: the same
        gather already done by a fused kernel, checked and wrapped; see `translate`)."""
        return translate(locs, self.mapping, self.pool, values=values)


def _split(pool: KVPoolLike | None) -> bool:
    return pool is not None and pool.is_split


def _source(pool: KVPoolLike, rule: str) -> KVSource:
    if pool.mapping is None:
        raise SpaceError(f"pool {pool.pool_id!r} is split but has no registered full→SWA mapping "
                         "(register the allocator's mapping when building it)")
    return KVSource(pool, pool.mapping, rule)


def resolve_kv_source(view: RunnerView, policy: Policy = "auto", *,
                      fault_allocator_for_own_draft: bool = False) -> KVSource | None:
    """The KV source of ``view`` under ``policy``, or None when this runner needs no translation.

    Pure: reads ``view`` and nothing else, caches nothing. Call it in every forward's planning.
    ``fault_allocator_for_own_draft`` is the fault-injection switch that reproduces sglang #27737
    (an own-pool draft answered with the allocator's SWA pool); only the harness sets it.
    """
    role, algo = view.role, view.spec_algorithm
    if role not in _ROLES:
        raise ValueError(f"role must be one of {', '.join(_ROLES)}, got {role!r}")
    if (role == "draft_reads_target") != (algo == "frozen_kv_mtp") and role != "target":
        raise ValueError(f"a {role} runner cannot run spec algorithm {algo!r}: only "
                         "frozen_kv_mtp drafts read the target's pool")
    active, alloc = view.active_pool, view.allocator_pool
    if policy == "active_pool":
        return _source(active, "policy active_pool: active pool is split") if _split(active) \
            else None
    if policy == "allocator":
        return _source(alloc, "policy allocator: allocator's pool is split") if _split(alloc) \
            else None
    if policy != "auto":
        raise ValueError(f"unknown resolver policy {policy!r}; known: {', '.join(POLICIES)}")
    if _split(active):
        return _source(active, "active pool is split")
    if role == "draft_own_pool":
        if fault_allocator_for_own_draft and _split(alloc):
            FAULT_COUNTS.acted("allocator_pool_for_own_pool_draft")
            return _source(alloc, "FAULT: own-pool draft resolved to the allocator's pool")
        return None  # its own pool is full-indexed; the target's mapping must not touch it
    if role == "draft_reads_target":
        if not _split(alloc):
            return None  # the target itself is unsplit: its full slots index every layer
        return _source(alloc, "FROZEN_KV draft reads the target's pool via the allocator")
    return _source(alloc, "allocator's pool is split") if _split(alloc) else None
