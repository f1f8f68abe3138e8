"""`AttentionBackend`: planning once per forward (the resolver, the planner, the kernels' own
planning) and the guards' checks of it. The graph contract and the per-layer path are its two
bases (`graphs.contract`, `layer_path`); `build.build_backend` validates and composes one. No
fault code: `faulty.FaultyBackend` overrides the steps a fault changes."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch

from swafactory.graphs.contract import GraphContract
from swafactory.backend.layer_contract import full_id_error, sinks_expected
from swafactory.backend.layer_path import LayerPath
from swafactory.config.schema import SwaFactoryConfig
from swafactory.graphs.state import GraphState
from swafactory.backend.slot_guard import SlotGuards
from swafactory.guards import CallOrderError, PendingChecks, batch_error
from swafactory.kvcache.quant import query_dtype
from swafactory.metadata.batch import ForwardBatch
from swafactory.metadata.plan import ForwardPlan, plan
from swafactory.registry.capabilities import Capabilities
from swafactory.registry.kernel_choice import MODE_PASS
from swafactory.resolve.source import RunnerView, resolve_kv_source

__all__ = ["AttentionBackend"]


class AttentionBackend(GraphContract, SlotGuards, LayerPath):
    """One runner's attention: plans once per forward, runs a kernel once per layer."""

    def __init__(self, cfg: SwaFactoryConfig, adapter, view: RunnerView,
                 windows: Mapping[int, int | None], guards: bool = True,
                 adapters: Mapping[str, object] | None = None) -> None:
        """adapter: the kernel of `backend.name`; adapters: registry key → adapter of every
        kernel a layer group uses (`backend.groups`), ``adapter`` included or not."""
        self.cfg, self.adapter, self.view = cfg, adapter, view
        self.adapters = {cfg.backend.name: adapter, **(adapters or {})}
        self.windows = dict(windows)
        self.sink = cfg.spec.draft_sink if view.role != "target" else 0
        """A draft window's sink (``spec.draft_sink``): its windowed groups also read the keys
        at positions below it (the planner lists them, the kernel masks by them)."""
        self.guards = guards
        self.softcap = cfg.model.logit_softcap
        self.takes_sinks = sinks_expected(cfg.model, view.role)
        """Whether each layer's `forward` must take ``sinks=`` ([Hq] fp32): True, False, or None
        (either: an own-pool draft of a model with sinks). Checked with guards on."""
        self._sinks_rule = self.takes_sinks  # what `forward` checks (a fault may drop them past it)
        self.cascade = cfg.backend.tree_mask == "cascade"
        self._plan: ForwardPlan | None = None
        self._pool = None
        self.q_heads = cfg.model.num_attention_heads // cfg.parallel.tp
        """Query heads of this runner's layers on this rank: kernel libraries plan with it in
        `init_forward_metadata` (set it when the engine's model differs from the config)."""
        self._sig_cache: tuple | None = None
        self._graph: GraphState | None = None
        self._graphed = False  # the current plan is a graph bucket's (writes unchecked inside)
        # the per-layer hot path (`forward`): what never changes while the pool and the layer
        # groups stay (buffers, scale, kernel kwargs), and per forward each group's write rows and
        # which (group, sub-pool) pairs were checked; a check runs once per pair, not per layer
        self._layers: tuple | None = None  # (pool, groups, {pass: {layer: LayerEntry}}, scales)
        self._entries: dict | None = None  # the current plan's pass's {layer: LayerEntry}
        self._writes: dict[str, tuple[torch.Tensor | None, int]] = {}  # (rows, n) per group
        self._decode: set[str] = set()
        self._checked: set[tuple[str, str]] = set()
        # guards: each forward's deferred slot check (CUDA), raised at the engine's sync point
        self._pending = PendingChecks()

    @property
    def capabilities(self) -> Capabilities:
        """The declared capabilities of `backend.name`'s adapter."""
        return self.adapter.capabilities

    def kernel_of(self, window: int | None, mode: str | None = None) -> str:
        """Registry key of the adapter that runs a group with ``window`` (None: full) in a
        forward of ``mode`` (None: the group's family; `BackendSpec.family_for`)."""
        b = self.cfg.backend
        if mode is None:
            return b.kernel_for(window is not None)
        return b.family_for(window is not None, MODE_PASS.get(mode, "extend"))

    def _plan_kernels(self, fplan: ForwardPlan, pool, graph: tuple[int, int] | None) -> None:
        """Each kernel library's host planning (FlashInfer's), over the groups it runs in this
        forward's pass."""
        sigs = None
        for name, ad in self.adapters.items():
            if not hasattr(ad, "plan"):
                continue
            mine = fplan if len(self.adapters) == 1 else _only(
                fplan, {k for k, g in fplan.groups.items()
                        if self.kernel_of(g.window, fplan.mode) == name})
            if mine.groups:
                sigs = sigs or self._sigs(pool, fplan)
                ad.plan(mine, pool, sigs=sigs, graph=graph)

    @property
    def planned_pool(self):
        """The pool the current plan reads and writes: the view's active pool when it was
        planned (None before the first plan)."""
        return self._pool

    @property
    def plan(self) -> ForwardPlan:
        """The current forward's plan."""
        if self._plan is None:
            raise CallOrderError("no forward is planned: call init_forward_metadata(batch) (or "
                                 "a graph's capture/replay planning) before forward()")
        return self._plan

    def init_forward_metadata(self, batch: ForwardBatch) -> ForwardPlan:
        """Resolve the KV source from the view *now* and plan the forward (host work, once:
        the planner's tables and the kernel library's own planning)."""
        self._set_plan(self._plan_forward(batch, None), graphed=False)
        return self._plan

    def _plan_forward(self, batch: ForwardBatch, graph: tuple[int, int] | None) -> ForwardPlan:
        if self.guards:  # the batch's own mistakes, in its terms, before the planner meets them
            active = self.view.active_pool
            err = (batch_error(batch, active.sub_pools[0].k_bufs[0].device)
                   or full_id_error(batch, active))
            if err is not None:
                raise err
        pool, source, lmap = self._source()
        fplan = self._tables(batch, pool, source, lmap)
        if graph is not None:  # before the adapters refill buffers the batch would overflow
            self._graph.check_keys(fplan, *graph)
        if self.guards:
            self._check_slots(batch, fplan, pool)  # holes in every space (`SlotGuards`)
        self._pool = pool
        self._plan_kernels(fplan, pool, graph)  # kernels with host-side planning: here, once
        return fplan

    def _source(self):
        """(the pool this forward reads and writes, the resolver's `KVSource`, that pool's
        ``layer -> (sub_pool, local_id)``), read from the view now (`swafactory.resolve.source`)."""
        pool = self.view.active_pool
        return pool, resolve_kv_source(self.view, self.cfg.backend.resolver), pool.layers_mapping

    def _tables(self, batch: ForwardBatch, pool, source, lmap) -> ForwardPlan:
        """The planner's tables of ``batch`` (`swafactory.metadata.plan`)."""
        return plan(batch, lmap, self.windows, source, cascade=self.cascade,
                    writes=not pool.read_only, page_size=pool.sub_pools[0].page_size,
                    sink=self.sink)

    def _capture_pool(self):
        """The pool a graph bucket is captured against: the view's active pool."""
        return self.view.active_pool

    # --- guards: slots checked on the device (swafactory.guards, backend.slot_guard) ----------

    def _defer(self, check) -> None:
        """A device check: read now where that is free (CPU), else kept for `raise_pending`."""
        self._pending.defer(check)

    def raise_pending(self) -> None:
        """Raise the first error the guards' device checks found since the last call: a
        position read or written that has no live slot, in any space, or a ``save_kv=False``
        forward's own rows unwritten in check mode (`guards.MissingSlotError`), a graph bucket's
        padding row writing a live slot (SpaceError), a write slot out of bounds in check mode
        (CapacityError). Call it where the engine reads the device back anyway: it waits on the
        newest check's event (queued before that forward's kernels, not after them), once. A
        no-op with guards off and on CPU (raised when planned or written)."""
        self._pending.raise_pending()

    def _sigs(self, pool, fplan: ForwardPlan) -> dict[str, tuple]:
        """Group key → (q heads, KV heads, head_dim, q dtype, KV dtype, scale, soft-cap), what a
        kernel library's host plan needs besides the tables (kept while the pool, the groups and
        ``q_heads`` stay the same)."""
        key = (tuple(fplan.groups), self.q_heads)
        cached = self._sig_cache
        if cached is not None and cached[0] is pool and cached[1] == key:
            return cached[2]
        sigs = {}
        for layer, g in fplan.layer_groups.items():
            if g not in sigs:
                sub = pool.sub_pool(layer)
                sigs[g] = (self.q_heads, sub.num_kv_heads, sub.head_dim, query_dtype(sub.dtype),
                           sub.dtype, self._scale(sub), self.softcap)
        self._sig_cache = (pool, key, sigs)  # the pool held, so its identity cannot be reused
        return sigs


def _only(fplan: ForwardPlan, keys: set[str]) -> ForwardPlan:
    """``fplan`` restricted to the groups ``keys`` (what one kernel of several plans)."""
    return replace(fplan, groups={k: g for k, g in fplan.groups.items() if k in keys},
                   layer_groups={l: k for l, k in fplan.layer_groups.items() if k in keys})
