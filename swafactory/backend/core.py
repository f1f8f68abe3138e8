"""`AttentionBackend`: planning once per forward (the resolver, the planner, the kernels' own
planning) and the guards' checks of it; `build_backend`, which validates and composes one. The
graph contract and the per-layer path are the two bases (`graph_contract`, `layer_path`)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch

from swafactory.backend.graph_contract import GraphContract
from swafactory.backend.layer_path import LayerPath
from swafactory.config.schema import SwaFactoryConfig
from swafactory.errors import ConfigError, Reason
from swafactory.fault_counts import FAULT_COUNTS
from swafactory.graph_state import GraphState
from swafactory.guards import CallOrderError, PendingChecks, SlotCheck, batch_error
from swafactory.kernels.cuda.prepare import start_adapters
from swafactory.kvcache.quant import query_dtype
from swafactory.metadata.batch import ForwardBatch
from swafactory.metadata.plan import ForwardPlan, lists_past_window, plan
from swafactory.registry.capabilities import Capabilities
from swafactory.registry.device import detect_device
from swafactory.registry.select import validate
from swafactory.registry.table import backend_module
from swafactory.resolve import RunnerView, TargetView, resolve_kv_source
from swafactory.runner_windows import check_own_pool, runner_windows

__all__ = ["AttentionBackend", "build_backend"]


class AttentionBackend(GraphContract, LayerPath):
    """One runner's attention: plans once per forward, runs a kernel once per layer."""

    def __init__(self, cfg: SwaFactoryConfig, adapter, view: RunnerView,
                 windows: Mapping[int, int | None], guards: bool = True,
                 adapters: Mapping[str, object] | None = None) -> None:
        """adapter: the kernel of `backend.name`; adapters: registry key → adapter of every
        kernel a layer group uses (`backend.groups`), ``adapter`` included or not."""
        self.cfg, self.adapter, self.view = cfg, adapter, view
        self.adapters = {cfg.backend.name: adapter, **(adapters or {})}
        self.windows = dict(windows)
        self.guards = guards
        self.softcap = cfg.model.logit_softcap
        self.cascade = cfg.backend.tree_mask == "cascade"
        self.faults = cfg.faults
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
        self._layers: tuple | None = None  # (pool, layer groups, {layer: LayerEntry}, scales)
        self._writes: dict[str, torch.Tensor | None] = {}
        self._decode: set[str] = set()
        self._checked: set[tuple[str, str]] = set()
        self._frozen = None
        # guards: each forward's deferred slot check (CUDA), raised at the engine's sync point
        self._pending = PendingChecks()
        if self.faults.pool_cached_at_init:  # FAULT: what the view says at construction
            self._frozen = (view.active_pool, resolve_kv_source(view, cfg.backend.resolver))

    @property
    def capabilities(self) -> Capabilities:
        """The declared capabilities of `backend.name`'s adapter."""
        return self.adapter.capabilities

    def kernel_of(self, window: int | None) -> str:
        """Registry key of the kernel that serves a group with ``window`` (None: full)."""
        return self.cfg.backend.kernel_for(window is not None)

    def _plan_kernels(self, fplan: ForwardPlan, pool, graph: tuple[int, int] | None) -> None:
        """Each kernel library's host planning (FlashInfer's), over the groups it serves."""
        sigs = None
        for name, ad in self.adapters.items():
            if not hasattr(ad, "plan"):
                continue
            mine = fplan if len(self.adapters) == 1 else _only(
                fplan, {k for k, g in fplan.groups.items() if self.kernel_of(g.window) == name})
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
        f = self.faults
        if self.guards:  # the batch's own mistakes, in its terms, before the planner meets them
            err = batch_error(batch, self.view.active_pool.sub_pools[0].k_bufs[0].device)
            if err is not None:
                raise err
        if self._frozen is not None:
            pool, source = self._frozen  # FAULT pool_cached_at_init (sglang #26957)
            if pool is not self.view.active_pool:
                FAULT_COUNTS.acted("pool_cached_at_init")  # the view moved on since then
        else:
            pool = self.view.active_pool
            source = resolve_kv_source(self.view, self.cfg.backend.resolver,
                                       fault_allocator_for_own_draft=f.allocator_pool_for_own_pool_draft)
        lmap = pool.layers_mapping
        if f.allocator_pool_for_own_pool_draft and source is not None and source.pool is not pool:
            lmap = {j: source.pool.layers_mapping[j] for j in lmap}  # FAULT: reads keyed on it
        fplan = plan(batch, lmap, self.windows, source, cascade=self.cascade,
                     writes=not pool.read_only, page_size=pool.sub_pools[0].page_size,
                     skip_spec_translation=f.skip_spec_translation,
                     plan_without_window=f.plan_without_window,
                     tree_mask_not_rebased=f.tree_mask_not_rebased)
        if f.window_off_by_one and lists_past_window(fplan.groups, narrower=1):
            FAULT_COUNTS.acted("window_off_by_one")  # a list holds the key W positions back
        if graph is not None:  # before the adapters refill buffers the batch would overflow
            self._graph.check_keys(fplan, *graph)
        if self.guards:
            self._check_slots(batch, fplan)
        self._pool = pool
        self._plan_kernels(fplan, pool, graph)  # kernels with host-side planning: here, once
        return fplan

    # --- guards: positions without a slot, checked on the device (swafactory.guards) ------------

    def _check_slots(self, batch: ForwardBatch, fplan: ForwardPlan) -> None:
        """Reduce the plan's full-space tables to an error word on the device. On CPU raise
        now (reading is free); on CUDA keep it for `raise_pending` (no sync here)."""
        reads = writes = None
        for g in fplan.groups.values():
            t = g.tables
            if t.kv_indices.space == "full" and (reads is None or g.window is None):
                reads = t  # an unwindowed full list covers every request's whole read range
            if writes is None and g.write_locs is not None and g.write_locs.space == "full":
                writes = g.write_locs.tensor
        self._defer(SlotCheck(batch, None if reads is None else reads.kv_indices.tensor,
                              None if reads is None else reads.kv_host, writes,
                              next(iter(fplan.groups.values())).tables.qo_host))

    def _defer(self, check) -> None:
        """A device check: read now where that is free (CPU), else kept for `raise_pending`."""
        self._pending.defer(check)

    def raise_pending(self) -> None:
        """Raise the first error the guards' device checks found since the last call: a
        position read or written that has no slot (`guards.MissingSlotError`), a graph bucket's
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


def build_backend(cfg: SwaFactoryConfig, pools=None, view: RunnerView | None = None, *,
                  windows: Mapping[int, int | None] | None = None,
                  guards: bool = True) -> AttentionBackend:
    """Validate ``cfg`` for the pools' device and compose the backend.

    pools: a target `HybridSWAPool` (wrapped in a `TargetView`), or give ``view`` (drafts,
    host engines). windows: ``layer -> W or None`` of the runner's layers; the default,
    `runner_windows(cfg, view)`, follows what each layer reads (a draft's layer j is not the
    target's layer j). Pass it only to override. guards: False skips the typed-space checks of
    reads and writes and the geometry check, as an engine that embedded only the kernels would
    run (the generator's ``run.guards=false``: faults must then show end to end).
    """
    if view is None:
        if pools is None:
            raise ValueError("build_backend needs pools= (a target pool) or view= (any runner)")
        view = TargetView(pools, spec_algorithm=cfg.spec.algorithm)
    pool = view.active_pool
    device = detect_device("cuda" if pool.sub_pools[0].device.type == "cuda" else "cpu")
    cfg = validate(cfg, device)
    b = cfg.backend
    names = dict.fromkeys((b.name, *(n for n in (b.groups.swa, b.groups.full) if n)))
    modules = {n: backend_module(n) for n in names}
    for n, module in modules.items():
        if not hasattr(module, "Adapter"):  # check() refused it already; a direct caller may not
            raise ConfigError([Reason("backend", "backend.name", f"{n}'s capabilities are "
                                      "declared but its adapter is not built yet",
                                      "backend=torch", rule="adapter")])
    if windows is None:
        windows = runner_windows(cfg, view)
        if view.role != "draft_reads_target":  # a FROZEN_KV view's pool is a dummy until swapped
            check_own_pool(view, windows)
    adapters = {n: m.Adapter() for n, m in modules.items()}
    # our CUDA kernels are built here (or fall back, warned), never in a forward
    kernels = start_adapters(cfg, adapters, pool.sub_pools[0].device, device)
    backend = AttentionBackend(cfg, adapters[b.name], view, windows, guards, adapters=adapters)
    backend.kernels = kernels  # what serves each pass × group (KernelPolicy; .lines())
    return backend


def _only(fplan: ForwardPlan, keys: set[str]) -> ForwardPlan:
    """``fplan`` restricted to the groups ``keys`` (what one kernel of several plans)."""
    return replace(fplan, groups={k: g for k, g in fplan.groups.items() if k in keys},
                   layer_groups={l: k for l, k in fplan.layer_groups.items() if k in keys})
