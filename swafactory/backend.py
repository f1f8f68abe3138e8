"""`build_backend(cfg, pools=…, view=…) -> AttentionBackend`: resolver + planner + kernel adapter.

The embedding contract. A host engine gives swafactory a *view*: four facts read fresh on every
forward (`swafactory.resolve.RunnerView`):

* ``active_pool``: the `HybridSWAPool` this runner's attention reads and writes now (a FROZEN_KV
  draft may swap it between forwards);
* ``allocator_pool``: the pool of the shared allocator (the target's);
* ``role``: ``target``, ``draft_own_pool`` or ``draft_reads_target``;
* ``spec_algorithm``: the spec key (``none``, ``eagle3``, ``frozen_kv_mtp``, …).

Per forward the engine calls `init_forward_metadata(batch)` once (the only place the resolver
runs and the only host work), then `forward(q, k, v, layer_id)` once per layer. Adapters wire the
plan's tables to a kernel and hold no pool logic. CUDA graphs: `init_cuda_graph_state`,
`init_forward_metadata_capture` and `init_forward_metadata_replay` (`swafactory.graph_state`).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from swafactory.config.schema import SwaFactoryConfig
from swafactory.errors import ConfigError, Reason, SpaceError
from swafactory.fault_counts import FAULT_COUNTS
from swafactory.guards import (Q_DTYPES, CallOrderError, PendingChecks, SlotCheck, batch_error,
                               forward_error)
from swafactory.graph_state import (GraphState, StaleGraphError, bucket_writes, capture_plan,
                                   check_graphable, check_padding)
from swafactory.kernels.cuda.prepare import start_adapters
from swafactory.kvcache.quant import is_fp8, query_dtype, store_rows
from swafactory.kvcache.sizing import step_nodes
from swafactory.metadata.batch import ForwardBatch, ForwardMode
from swafactory.metadata.plan import ForwardPlan, lists_past_window, plan
from swafactory.registry.capabilities import Capabilities
from swafactory.registry.device import detect_device
from swafactory.registry.select import validate
from swafactory.registry.table import backend_module
from swafactory.resolve import RunnerView, TargetView, resolve_kv_source
from swafactory.runner_windows import check_own_pool, model_windows, runner_windows

__all__ = ["AttentionBackend", "LayerEntry", "build_backend", "TargetView", "model_windows",
           "runner_windows"]



@dataclass(frozen=True, slots=True)
class LayerEntry:
    """What a layer's `forward` needs of the current plan and pool, gathered once per plan (and
    again only when the pool, the layer groups or the fp8 scales change), so the per-layer path
    reads attributes instead of looking anything up."""

    key: str
    """The layer's group key in the plan."""
    k_buf: torch.Tensor
    """[rows, Hkv, D] the layer's K buffer (pool dtype)."""
    v_buf: torch.Tensor
    """[rows, Hkv, D] the layer's V buffer."""
    sub: object
    """The sub-pool holding the layer (`kvcache.pool.SubPool`)."""
    kw: dict
    """The adapter's per-layer keywords: window, scale, softcap, fp8 k_scale/v_scale."""
    pair: tuple
    """(group key, sub-pool id): the unit of the read checks, once per forward."""
    adapter: object
    """The kernel adapter serving the layer's group."""
    scales: tuple
    """(k_scale, v_scale) the store quantizes with (1.0, 1.0 unless fp8)."""
    wpair: tuple
    """(group key, sub-pool id, "w"): the unit of the write checks."""
    hkv: int
    """KV heads of the layer."""
    d: int
    """head_dim of the layer."""
    fp8: bool
    """The pool stores fp8."""
    fuse: bool
    """The decode kernel may write the step's K/V itself."""
    device: torch.device
    """The pool's device."""

class AttentionBackend:
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
        self._layers: tuple | None = None
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

    # --- the CUDA-graph contract (swafactory.graph_state says how an engine uses it) -----------

    @property
    def cuda_graph_state(self) -> GraphState | None:
        """The graphs' static state (None before `init_cuda_graph_state`)."""
        return self._graph

    def init_cuda_graph_state(self, max_bs: int, max_tokens: int,
                              max_context: int | None = None) -> None:
        """Ready graphs of up to ``max_bs`` requests × ``max_tokens`` query rows each, each
        request reading at most ``max_context`` keys (its context, this forward's tokens
        included; sglang's argument). A bucket's buffers hold ``bs · max_context`` keys per full
        group and ``bs · (W + tokens + page)`` per SWA group (tokens: at least the spec's step
        nodes, `graph_sizing.bucket_keys`), never the pool's rows. Default:
        ``workload.context_len``, capped by the largest sub-pool's rows. Calling it again with
        other limits keeps the buckets already captured (max_context is fixed once one is)."""
        pool = self.view.active_pool
        dev = pool.sub_pools[0].device
        check_graphable([ad.capabilities for ad in self.adapters.values()], dev.type,
                        self.cascade, max_bs, max_tokens)
        rows = max(sp.rows - sp.page_size for sp in pool.sub_pools)  # past the dummy page
        ctx = min(self.cfg.workload.context_len, rows) if max_context is None else max_context
        if ctx < 1:
            raise ValueError(f"init_cuda_graph_state needs max_context >= 1, got {max_context}")
        st = self._graph
        if st is not None:
            if max_context is not None and ctx != st.max_context and st.captured:
                raise ValueError(f"init_cuda_graph_state(max_context={ctx}): buckets "
                                 f"{sorted(st.captured)} were captured with max_context="
                                 f"{st.max_context}, their buffers sized by it; build a new "
                                 "backend for another max_context")
            st.max_bs, st.max_tokens = max_bs, max_tokens
            st.max_context = ctx if max_context is not None else st.max_context
        else:
            st = self._graph = GraphState(max_bs, max_tokens, torch.device(dev), ctx,
                                          pool.sub_pools[0].page_size, step_nodes(self.cfg.spec))
        for ad in self.adapters.values():  # the adapters size their graph buffers by it
            if hasattr(ad, "graph_keys"):
                ad.graph_keys = st.keys

    def graph_state_bytes(self) -> int:
        """Bytes of every static buffer held for graphs: the write slots here and each
        adapter's (FlashInfer's graph wrappers and their int workspaces, Triton's static
        tables); 0 before `init_cuda_graph_state`. Shared eager workspaces are not counted."""
        if self._graph is None:
            return 0
        return self._graph.bytes + sum(ad.graph_bytes() for ad in self.adapters.values()
                                       if hasattr(ad, "graph_bytes"))

    def graph_stale(self, bs: int, tokens: int) -> str | None:
        """Why captured bucket (bs, tokens) may not replay now (a layer's fp8 scales changed
        since its capture: `set_kv_scales`), or None. An engine re-captures it on a reason."""
        st = self._graph
        pool = st.captured.get((bs, tokens)) if st is not None else None
        return None if pool is None else st.stale(bs, tokens, pool)

    def _graph_state(self) -> GraphState:
        if self._graph is None:
            raise CallOrderError("call init_cuda_graph_state(max_bs, max_tokens) first")
        return self._graph

    def init_forward_metadata_capture(self, bs: int, tokens: int,
                                      mode: ForwardMode) -> ForwardPlan:
        """Plan the shapes of bucket (``bs`` requests × ``tokens`` queries) for a capture: every
        request reads and writes the dummy row. The engine then warms up and captures its step,
        calling `forward` per layer inside."""
        st = self._graph_state()
        st.check(bs, tokens)
        if mode == "decode" and tokens != 1:
            raise ValueError(f"a decode bucket has 1 token per request, got tokens={tokens}")
        pool = self.view.active_pool if self._frozen is None else self._frozen[0]
        fplan = capture_plan(st, pool, pool.layers_mapping, self.windows, bs=bs, tokens=tokens,
                             mode=mode, writes=not pool.read_only)
        self._plan_kernels(fplan, pool, (bs, tokens))
        st.captured[(bs, tokens)] = pool
        st.record_scales(bs, tokens, pool, [l for l in pool.layers_mapping
                                            if is_fp8(pool.sub_pool(l).dtype)])
        self._pool = pool
        self._set_plan(fplan, graphed=True)
        return fplan

    def init_forward_metadata_replay(self, batch: ForwardBatch, bs: int,
                                     tokens: int) -> ForwardPlan:
        """Plan ``batch`` for the captured bucket (``bs``, ``tokens``) and refill the buffers its
        graph reads, in place; the engine then copies its inputs and replays. The batch has at
        most ``bs`` requests of at most ``tokens`` queries each."""
        st = self._graph_state()
        captured = st.captured.get((bs, tokens))
        if captured is None:
            raise ValueError(f"no graph was captured for {bs} requests × {tokens} tokens; "
                             f"captured: {sorted(st.captured)}")
        if batch.batch_size > bs:
            raise ValueError(f"{batch.batch_size} requests do not fit the graph bucket of {bs}")
        stale = st.stale(bs, tokens, captured)
        if stale is not None:  # the graph's kernels hold the captured scales as constants
            raise StaleGraphError(stale)
        fplan = self._plan_forward(batch, (bs, tokens))
        if self._pool is not captured:  # the graph holds the captured pool's buffer addresses
            raise ValueError("the runner's active pool is not the one this graph was captured "
                             "against; capture per pool (a FROZEN_KV draft's frozen view)")
        padded = bucket_writes(st, fplan, bs, tokens,
                               stale_swa=self.faults.graph_pad_stale_swa_loc)
        if self.guards:  # the captured writes are unchecked: check what they will write, here
            # (typed space now; bounds and padding on the device: raised at once on CPU, at
            # raise_pending on CUDA, so a replay reads nothing back)
            seen: set[str] = set()
            for layer, key in fplan.layer_groups.items():
                g = fplan.groups[key]
                if g.write_locs is not None and key not in seen:
                    seen.add(key)
                    self._defer(self._pool.check(layer, g.write_locs))
            self._defer(check_padding(padded, batch.total_q))
        self._set_plan(padded, graphed=True)
        return self._plan

    # --- the per-layer hot path -----------------------------------------------------------------

    def _set_plan(self, fplan: ForwardPlan, graphed: bool) -> None:
        """Make ``fplan`` the current forward's: each group's write rows as the int64 index the
        store takes (once per group, not per layer), and the per-layer entries rebuilt only when
        the pool or the layer groups changed."""
        self._plan, self._graphed = fplan, graphed
        self._checked = set()
        self._writes = {key: (None if g.write_locs is None else _rows(g.write_locs.tensor))
                        for key, g in fplan.groups.items()}
        # groups whose pass is decode (host facts): a kernel may write their K/V itself
        self._decode = {key for key, g in fplan.groups.items() if g.cascade is None
                        and g.tables.mask is None and g.tables.max_q_len == 1}
        pool = self._pool
        cached = self._layers
        version = pool.scales_version
        if (cached is None or cached[0] is not pool or cached[1] != fplan.layer_groups
                or cached[3] != version):
            entries = {}
            for layer, key in fplan.layer_groups.items():
                k_buf, v_buf, sub = pool.get_kv(layer)
                kw = dict(window=fplan.groups[key].window, scale=self._scale(sub),
                          softcap=self.softcap)
                scales = pool.kv_scales(layer) if is_fp8(sub.dtype) else (1.0, 1.0)
                if is_fp8(sub.dtype) and not (self.faults.fp8_descale_dropped and
                                              self.windows.get(layer) is None):
                    kw["k_scale"], kw["v_scale"] = scales  # kernels dequantize
                # else FAULT fp8_descale_dropped: the full layers' reads skip the scales
                elif is_fp8(sub.dtype) and tuple(scales) != (1.0, 1.0):
                    FAULT_COUNTS.acted("fp8_descale_dropped")
                ad = self.adapters[self.kernel_of(fplan.groups[key].window)]
                hkv, d = k_buf.shape[1], k_buf.shape[2]
                # a decode kernel that writes the step's K/V itself (not fp8: the store quantizes)
                fuse = getattr(ad, "fuses_writes", False) and not is_fp8(sub.dtype)
                entries[layer] = LayerEntry(key, k_buf, v_buf, sub, kw, (key, sub.pool_id), ad,
                                            scales, (key, sub.pool_id, "w"), hkv, d,
                                            is_fp8(sub.dtype), fuse, k_buf.device)
            # the pool is held, so its identity cannot be reused by another one
            self._layers = (pool, dict(fplan.layer_groups), entries, version)

    def _check_layer(self, layer_id: int, g, sub, pair: tuple[str, str]) -> None:
        """The typed-space checks of a layer's reads and writes, once per (group, sub-pool) per
        forward: every layer of the pair reads the same tables and writes the same rows."""
        if not sub.accepts(g.tables.kv_indices):
            raise SpaceError(f"layer {layer_id} reads {sub.pool_id!r} ({sub.space} space) but its "
                             f"plan holds {g.tables.kv_indices.space}-space locations of "
                             f"{g.tables.kv_indices.pool_id!r}")
        self._checked.add(pair)

    def _entry(self, layer_id: int) -> LayerEntry:
        try:
            return self._layers[2][layer_id]
        except (TypeError, KeyError):  # no plan yet (None), or a layer the plan does not hold
            self.plan  # noqa: B018 - raises before init_forward_metadata
            self._plan.group(layer_id)  # raises naming the plan's layers
            raise

    def write_kv(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write this forward's new tokens of one layer. k, v: [total_q, Hkv, D]."""
        self._store(layer_id, self._entry(layer_id), k, v)

    def _store(self, layer_id: int, e: tuple, k, v, fused: bool = False):
        """The per-layer write (hot: about as much Python as the raw ``index_copy_`` pair).
        e: the layer's `LayerEntry`. fused: check only, and return the int64 slots for the
        kernel that writes them (`forward`)."""
        key, k_buf, v_buf, sub, scales, wpair = e.key, e.k_buf, e.v_buf, e.sub, e.scales, e.wpair
        hkv, d, fp8 = e.hkv, e.d, e.fp8
        idx = self._writes[key]
        if idx is None:
            raise SpaceError(f"layer {layer_id}: this runner writes no KV (a read-only view)")
        # the pool's checks (typed space; bounds in check mode, on the device: `_defer`) once
        # per group and sub-pool; a graph's writes were checked at replay planning
        if self.guards and not self._graphed and wpair not in self._checked:
            self._defer(self._pool.check(layer_id, self._plan.groups[key].write_locs))
            self._checked.add(wpair)
        ks = k.shape
        if len(ks) != 3 or ks[0] != idx.shape[0] or ks[1] != hkv or ks[2] != d or v.shape != ks:
            raise ValueError(f"layer {layer_id}: k/v must be [{idx.shape[0]}, {hkv}, {d}], got "
                             f"{list(k.shape)} / {list(v.shape)}")
        if fused:  # the adapter writes, leaving the dummy page as it was
            return idx
        if sub.check_mode:  # the pool's own write keeps its dummy page poisoned
            return self._pool.write(layer_id, self._plan.groups[key].write_locs, k, v,
                                    checked=False)
        # the pool's store rule (index_copy_; fp8 quantized with the layer's cached scales)
        if fp8 or k.dtype != k_buf.dtype or v.dtype != v_buf.dtype:
            store_rows(k_buf, idx, k, scales[0])
            store_rows(v_buf, idx, v, scales[1])
        else:  # store_rows's own path, without its two calls
            k_buf.index_copy_(0, idx, k)
            v_buf.index_copy_(0, idx, v)

    def layer_scale(self, layer_id: int) -> float:
        """The softmax scale of ``layer_id`` in this forward: ``model.softmax_scale``, else the
        head_dim^-0.5 of the buffers it reads (a frozen draft layer reads a target layer)."""
        return self._scale(self._pool.sub_pool(layer_id))

    def _scale(self, sub) -> float:
        return self.cfg.model.softmax_scale or sub.head_dim ** -0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                layer_id: int, batch: ForwardBatch | None = None, save_kv: bool = True,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of one layer.

        q: [total_q, Hq, D]; k, v: [total_q, Hkv, D] (this forward's new tokens, written first
        when ``save_kv``); sinks: [Hq] fp32 or None. Returns [total_q, Hq, D] in q's dtype.
        ``batch`` is accepted for engines that pass it; the plan is the one of
        `init_forward_metadata`.
        """
        del batch
        if self.faults.sink_dropped:
            if sinks is not None:
                FAULT_COUNTS.acted("sink_dropped")
            sinks = None  # FAULT: the kernel takes sinks= and ignores it
        e = self._entry(layer_id)
        key, k_buf, v_buf, sub, kw, pair = e.key, e.k_buf, e.v_buf, e.sub, e.kw, e.pair
        ad, hkv, d, fuse, dev = e.adapter, e.hkv, e.d, e.fuse, e.device
        g = self._plan.groups[key]
        if self.guards:
            if pair not in self._checked:
                self._check_layer(layer_id, g, sub, pair)
            # metadata only (ints, dtypes, devices); `guards.forward_error` names what differs
            qs, rows = q.shape, self._plan.total_q
            if (len(qs) != 3 or qs[0] != rows or qs[1] != self.q_heads or qs[2] != d
                    or q.dtype not in Q_DTYPES or q.device != dev
                    or (save_kv and (k is None or v is None or k.device != dev
                                     or v.device != dev or k.dtype not in Q_DTYPES
                                     or v.dtype not in Q_DTYPES))
                    or (sinks is not None and (sinks.shape != (self.q_heads,)
                                               or sinks.device != dev
                                               or sinks.dtype not in Q_DTYPES))):
                raise forward_error(layer_id, self._plan.mode, rows, self.q_heads, hkv, d, dev,
                                    q, k, v, save_kv, sinks) or AssertionError(
                                        f"layer {layer_id}: a guard disagrees with its message")
        if not q.is_contiguous():  # q split from a fused qkv projection: kernels read it dense
            q = q.contiguous()
        if save_kv and not (k.is_contiguous() and v.is_contiguous()):
            k, v = k.contiguous(), v.contiguous()
        # the scale follows the buffers actually read (a frozen draft layer reads a target layer)
        if save_kv and fuse and key in self._decode and k.dtype == k_buf.dtype == v.dtype:
            new_kv = (k, v, self._store(layer_id, e, k, v, fused=True))  # the kernel writes
            return ad.run(g.tables, q, k_buf, v_buf, sinks=sinks, lse=False, new_kv=new_kv, **kw)[0]
        if save_kv:
            self._store(layer_id, e, k, v)
        if g.cascade is not None:
            pre, exp = g.cascade
            o1, l1 = ad.run(pre, q, k_buf, v_buf, **kw)
            o2, l2 = ad.run(exp, q, k_buf, v_buf, **kw)
            return ad.merge(o1, l1, o2, l2, sinks)
        o, _ = ad.run(g.tables, q, k_buf, v_buf, sinks=sinks, lse=False, **kw)
        return o


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


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the store's [n] int64 index: itself when it is one already (the planner's)."""
    return t if t.dtype is torch.int64 and t.dim() == 1 else t.reshape(-1).long()


def _only(fplan: ForwardPlan, keys: set[str]) -> ForwardPlan:
    """``fplan`` restricted to the groups ``keys`` (what one kernel of several plans)."""
    return replace(fplan, groups={k: g for k, g in fplan.groups.items() if k in keys},
                   layer_groups={l: k for l, k in fplan.layer_groups.items() if k in keys})
