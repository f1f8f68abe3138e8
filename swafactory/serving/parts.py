"""The serving core both drivers share: pools, slot books, the draft's pool and view, the
backends, and the FROZEN_KV swap.

The conformance harness (`swafactory.harness.setup`) and the generator (`swafactory.models.build`)
each serve a target and, with speculative decoding, a draft, through one scheduler
(`swafactory.serving.scheduler`). What they serve is the same, so it is built here, once:

* the target's pool and allocator (pages shuffled), its `RequestSlots` over a `ReqToToken`;
* the draft's pool by its family: ``config`` (`kvcache.draft.build_draft_pool`: the spec's
  ``draft_num_layers``, DFlash's split option, a FROZEN_KV draft's frozen view) or ``copy`` (an
  own pool holding every target layer with the target's windows and geometry: a
  self-speculating copy), its `DraftView`;
* a FROZEN_KV draft's dummy pool and `FrozenSwap`, which puts the target's frozen view in for
  each draft forward and the dummy back after (sglang's runner does the same);
* one backend per runner (`build_backend`);
* `Parts`: all of that with the runners a payload wraps around the backends, which the
  scheduler drives. One class for both payloads: the harness's runners are
  `harness.workers.Worker`s (seeded Q/K/V, the oracle), the engine's `engine.runner.Runner`s
  (HF models); both are `ServedRunner`s.

Graph capture and replay go through one pair of functions both drivers call
(`swafactory.graphs.replay.capture_step`, `refill`), over one list of buckets
(`swafactory.graphs.sizing.BUCKETS`). What stays each driver's own: the harness's oracle, layer
specs and pool pressure; the engine's HF models and greedy sampling.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch

from swafactory.backend import build_backend, model_windows
from swafactory.backend.faulty import draft_swa_rows
from swafactory.config.schema import ModelSpec, SwaFactoryConfig
from swafactory.kvcache.draft import (build_draft_pool, frozen_draft_view, own_draft_pool,
                                      split_draft_pool)
from swafactory.kvcache.factory import build_pools
from swafactory.kvcache.pool import ReqToToken
from swafactory.kvcache.requests import RequestSlots
from swafactory.kvcache.shares import PoolSizes
from swafactory.resolve.layout import frozen_draft_binding
from swafactory.resolve.source import DraftView
from swafactory.window import narrowed

__all__ = ["FrozenSwap", "Serving", "build_serving", "ServedRunner", "Parts"]


@dataclass
class FrozenSwap:
    """A FROZEN_KV draft's view swap: ``view.active_pool`` is ``dummy`` between forwards and
    ``frozen`` (the target's frozen view) during each draft forward or capture."""

    view: DraftView
    frozen: object
    dummy: object

    @contextmanager
    def active(self) -> Iterator[None]:
        """The frozen view in for the block's forwards, the dummy back after (even on error)."""
        self.view.active_pool = self.frozen
        try:
            yield
        finally:
            self.view.active_pool = self.dummy


@dataclass
class Serving:
    """What a driver serves with (`build_serving`)."""

    pool: object
    """The target's `HybridSWAPool`."""
    alloc: object
    """The shared allocator (target and own draft pools)."""
    slots: RequestSlots
    target: object
    """The target's `AttentionBackend`."""
    draft: object | None = None
    """The draft's `AttentionBackend` (None: no draft)."""
    draft_pool: object | None = None
    """An own draft pool (None for FROZEN_KV, which writes none)."""
    draft_view: DraftView | None = None
    swap: FrozenSwap | None = None
    """A FROZEN_KV draft's swap (None otherwise)."""


def build_serving(cfg: SwaFactoryConfig, sizes: PoolSizes, device: str, *, check_mode: bool,
                  guards: bool = True, draft_layout: str = "config",
                  gen: torch.Generator | None = None,
                  headroom: float = 1.0, unsafe_undersized: bool = False,
                  on_pool: Callable[[object], None] | None = None,
                  draft_model: ModelSpec | None = None,
                  layers: Collection[int] | None = None) -> Serving:
    """Pools, slot books and backends for a validated ``cfg`` (a tensor-parallel rank's: the
    pools hold its heads).

    sizes: `kvcache.size_pools`' answer: the slots of each space, and the `ReqToToken` rows
    (``max_requests``) and columns (``full_per_request``). check_mode: pools poison unwritten
    and freed rows (NaN). guards: the backends' (`build_backend`). draft_layout: ``config`` or
    ``copy`` (see the module doc). gen: shuffles the allocator's pages (None: in order).
    headroom, unsafe_undersized: a draft pool built short (fault injection). on_pool: called
    with each pool built (the harness's fp8 scales).
    draft_model: the attention an own-pool draft's layers do when it is not the target's (an
    EAGLE-3 head is a Llama layer: its own scale, no sinks); None: the target's.
    layers: the target layers whose K/V get rows (`kvcache.build_pools`); None: every layer.
    """
    s, m = cfg.spec, cfg.model
    P = cfg.backend.page_size
    pool, alloc = build_pools(cfg, sizes.full, sizes.swa, device, check_mode=check_mode,
                              layers=layers)
    if on_pool is not None:
        on_pool(pool)
    if gen is not None and cfg.workload.page_order == "shuffled":
        alloc.shuffle(gen)  # pages in random order
    slots = RequestSlots(alloc, ReqToToken(sizes.max_requests, sizes.full_per_request, device))
    out = Serving(pool, alloc, slots, build_backend(cfg, pools=pool, guards=guards))
    if s.draft_kv == "none":
        return out
    dtype = pool.sub_pools[0].dtype
    if s.draft_kv == "target_pool":  # FROZEN_KV: reads the target's frozen view, writes none
        binding = frozen_draft_binding(cfg)
        geo = m.full or m.swa
        dummy = own_draft_pool(alloc.full_size, P, len(binding), geo.num_kv_heads, geo.head_dim,
                               dtype, device, check_mode=check_mode)
        view = DraftView(dummy, pool, "draft_reads_target", s.algorithm)
        out.swap = FrozenSwap(view, frozen_draft_view(pool, binding), dummy)
        out.draft_view, out.draft = view, build_backend(cfg, view=view, guards=guards)
        return out
    windows = None
    if draft_layout == "copy":  # every target layer, its window and geometry
        types = list(m.layer_types)
        if pool.is_split:
            dpool = split_draft_pool(pool, types, dtype, device, check_mode=check_mode)
        else:
            geo = m.full or m.swa
            dpool = own_draft_pool(alloc.full_size, P, len(types), geo.num_kv_heads,
                                   geo.head_dim, dtype, device, full_id=alloc.full_id,
                                   check_mode=check_mode)
        for sub in dpool.sub_pools:
            alloc.attach(sub)
        # stated: an own pool is full attention by default, which a copy of a sliding model is not
        windows = {i: narrowed(w, s.draft_window) for i, w in model_windows(cfg).items()}
    elif draft_layout == "config":
        dpool = build_draft_pool(cfg, pool, alloc, device=device, check_mode=check_mode,
                                 headroom=headroom, unsafe_undersized=unsafe_undersized,
                                 binding=frozen_draft_binding(cfg),
                                 swa_rows=draft_swa_rows(cfg, alloc.full_size))
    else:
        raise ValueError(f"draft_layout must be 'config' or 'copy', got {draft_layout!r}")
    if on_pool is not None:
        on_pool(dpool)
    view = DraftView(dpool, pool, "draft_own_pool", s.algorithm)
    out.draft_pool, out.draft_view = dpool, view
    dcfg = cfg if draft_model is None else cfg.model_copy(update={"model": draft_model})
    out.draft = build_backend(dcfg, view=view, windows=windows, guards=guards)
    return out


class ServedRunner(Protocol):
    """What the serving core reads of a runner (the target or a draft); the rest is the
    payload's."""

    name: str
    writes: bool
    """It writes its own K/V (False: a FROZEN_KV draft reading the target's)."""
    backend: object
    """Its `AttentionBackend`."""


R = TypeVar("R", bound=ServedRunner)


@dataclass
class Parts(Generic[R]):
    """What the serving core drives: the pools, slot books and draft view (`Serving`), the
    sizes they were built for, and the payload's runners (``R``: the harness's `Worker` or the
    engine's `Runner`)."""

    cfg: SwaFactoryConfig
    """The validated config the parts serve (the engine's: the model spec its HF model has)."""
    sizes: PoolSizes
    pool: object
    alloc: object
    slots: RequestSlots
    target: R
    draft: R | None = None
    draft_pool: object | None = None
    draft_view: DraftView | None = None
    swap: FrozenSwap | None = None
    """A FROZEN_KV draft's view swap, None otherwise."""
    draft_desc: str = "-"
    """What the draft is, in words (the engine's report)."""
    draft_training: object | None = None
    """A distilled draft's training record (`drafts.train.Trained`; None: no training)."""

    @property
    def split(self) -> bool:
        """The target's pool has an SWA sub-pool (window eviction applies)."""
        m = self.cfg.model
        return bool(m.swa_layers) and m.hybrid_pool

    @classmethod
    def of(cls, cfg: SwaFactoryConfig, sizes: PoolSizes, sv: Serving, target: R) -> Parts[R]:
        """The parts of ``sv`` (`build_serving` at ``sizes``) with ``target`` (wrapping
        ``sv.target``); the draft, wrapping ``sv.draft``, is set after."""
        return cls(cfg, sizes, sv.pool, sv.alloc, sv.slots, target, None, sv.draft_pool,
                   sv.draft_view, sv.swap)

