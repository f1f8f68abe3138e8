"""`FaultyBackend`: the `AttentionBackend` with the catalog's injected faults (`conf/faults`),
composed by `build_backend` only when the config switches one on. Each fault overrides one
step of the plain backend and counts the times it changed something (`swafactory.fault_counts`),
so the default path carries no fault code at all.

| fault | step it changes |
|---|---|
| window_off_by_one | the runner's windows: sliding layers see W + 1 keys |
| pool_cached_at_init | `_source`/`_tables`: "split?" decided at construction, over the runner's own pool: full slots index the target's SWA buffer (sglang #26957) |
| allocator_pool_for_own_pool_draft | `_source`: an own-pool draft resolved to the allocator's pool, its reads keyed on it (the own-pool branch of sglang #27737) |
| swa_pool_missed | `_tables`: an own draft's split pool read with full slots, written at SWA slots (sglang #27737); `draft_swa_rows`: that pool holds a slot per target token, as sglang's draft runner does |
| skip_spec_translation, plan_without_window, tree_mask_not_rebased | `_tables`: the planner's switches (sglang #24402, #31501, #39160) |
| graph_pad_stale_swa_loc | `_bucket_writes`: padding rows keep an earlier replay's SWA slots (sglang #24743) |
| graph_key_without_mode | `graph_key`: an engine files graphs by shape alone, so one mode's graph replays another's batch |
| fp8_descale_dropped | `_read_scales`: full layers read fp8 K/V without their scales |
| sink_dropped | `forward`: sinks are taken and ignored |
| block_window_one_left_bound | `_tables`: a DFlash block's or verify's windowed groups keep their first query's left bound (sglang #35208) |
| draft_planned_with_group0 | the draft runner's windows: every layer takes the target's layer 0's (vLLM #50169) |
| windowed_draft_admitted_as_full | the scheduler's admission need (`admission_for`): a window-retained draft's K/V at the whole sequence (vLLM #55800) |
| swa_metadata_missing_in_spec_modes, window_gather_from_zero, verify_rows_share_write_loc, verify_as_decode | `_tables`: the plan transforms of `fault_plans` (sglang #22679, #39160; atlas #745; flashinfer #3864) |
| graph_draft_extend_untranslated | `_tables`: a draft_extend planned for a graph reads its SWA groups' full slots (sglang #29858) |
| lookahead_not_retained, paged_free_stale_mapping | the scheduler's eviction (`evictor_for`): a block short of what the next query needs (vLLM #42784); a page freed whole, its mapping per token (sglang #27779) |
| frozen_draft_fp8_unscaled | `_read_scales`: a FROZEN_KV draft reads the target's fp8 K/V without its scales (vLLM #48666) |

The storage-side faults (leaked or early-freed slots, a stale page mapping) are switches of the
slot books' calls, which the drivers pass (`swafactory.serving.speculative.fault_switches`).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

import torch

from swafactory.backend.core import AttentionBackend
from swafactory.backend.fault_plans import (gather_from_zero, rows_share_write_loc,
                                            verify_as_decode, windows_dropped)
from swafactory.backend.layer_contract import sinks_error
from swafactory.config.schema import SwaFactoryConfig
from swafactory.fault_counts import FAULT_COUNTS
from swafactory.graphs.state import GraphKey, GraphState, bucket_writes
from swafactory.kvcache.shares import admission_need
from swafactory.metadata.batch import ForwardBatch
from swafactory.metadata.plan import ForwardPlan, lists_past_window, plan
from swafactory.resolve.source import RunnerView, resolve_kv_source

__all__ = ["FaultyBackend", "with_faults", "admission_for", "draft_swa_rows",
           "retained_window_for", "evictor_for"]

_BLOCK_MODES = ("target_verify", "draft_decode")
"""Where a DFlash block's queries share a window: its verify and its drafted block."""


class FaultyBackend(AttentionBackend):
    """An `AttentionBackend` that injects ``cfg.faults`` (at least one switched on)."""

    def __init__(self, cfg: SwaFactoryConfig, adapter, view: RunnerView,
                 windows: Mapping[int, int | None], guards: bool = True,
                 adapters: Mapping[str, object] | None = None) -> None:
        f = self.faults = cfg.faults
        self._own_windows = dict(windows)  # what the layers should read (the faults' yardstick)
        if f.window_off_by_one:  # FAULT: sliding layers see W + 1 keys
            windows = {j: (None if w is None else w + 1) for j, w in windows.items()}
        if f.draft_planned_with_group0 and view.role == "draft_own_pool":
            # FAULT (vLLM #50169): the draft's layers take the target's group 0's metadata
            w0 = cfg.model.sliding_window if cfg.model.layer_types[0] == "sliding_attention" \
                else None
            windows = {j: w0 for j in windows}
        super().__init__(cfg, adapter, view, windows, guards, adapters)
        self._frozen = None
        if f.sink_dropped:  # `forward` checks the caller's sinks itself, then drops them
            self._sinks_rule = None
        if f.pool_cached_at_init:  # FAULT: "is my pool split?" asked once, of the pool the
            # runner was built over (sglang #25103's predicate on a FROZEN_KV draft: its own
            # dummy pool, unsplit, so no translation)
            self._frozen = (view.active_pool, resolve_kv_source(view, "active_pool"))

    def _source(self):
        f = self.faults
        if self._frozen is not None:
            # FAULT pool_cached_at_init (sglang #26957): the target's split pool, swapped in
            # per forward, is read with that decision: full slots index its SWA buffer, in
            # bounds until the full pool hands out a slot past the SWA pool's size
            built, source = self._frozen
            pool = self.view.active_pool
            if pool is not built and source is None:
                FAULT_COUNTS.acted("pool_cached_at_init")  # the view moved on since then
            return pool, source, pool.layers_mapping
        pool = self.view.active_pool
        source = resolve_kv_source(self.view, self.cfg.backend.resolver,
                                   fault_allocator_for_own_draft=f.allocator_pool_for_own_pool_draft)
        lmap = pool.layers_mapping
        if f.allocator_pool_for_own_pool_draft and source is not None and source.pool is not pool:
            lmap = {j: source.pool.layers_mapping[j] for j in lmap}  # FAULT: reads keyed on it
        return pool, source, lmap

    def _tables(self, batch: ForwardBatch, pool, source, lmap) -> ForwardPlan:
        f = self.faults
        # FAULT swa_pool_missed (sglang #27737): "split?" for reads asked of the allocator's
        # pool, not this own draft's SWA-backed one: writes land at SWA slots, reads at full
        missed = (f.swa_pool_missed and self.view.role == "draft_own_pool"
                  and source is not None and source.pool is pool)
        # FAULT graph_draft_extend_untranslated (sglang #29858): the draft-extend graph path
        # never builds its SWA window indices: a replay reads full slots, an eager run does not
        graphed = (f.graph_draft_extend_untranslated and getattr(self, "_graph_plan", False)
                   and batch.mode == "draft_extend" and self.view.role == "draft_own_pool"
                   and source is not None)
        windows = self.windows
        if f.swa_metadata_missing_in_spec_modes:  # FAULT (sglang #22679): no SWA metadata
            windows = windows_dropped(windows, batch.mode, any(
                sub == "swa" for sub, _ in lmap.values()))
        fplan = plan(batch, lmap, windows, source, cascade=self.cascade,
                     writes=not pool.read_only, page_size=pool.sub_pools[0].page_size,
                     skip_spec_translation=f.skip_spec_translation,
                     plan_without_window=f.plan_without_window,
                     tree_mask_not_rebased=f.tree_mask_not_rebased,
                     untranslated=self._frozen is not None and source is None,
                     reads_untranslated=missed or graphed, sink=self.sink)
        read_full = any(g.sub_pool == "swa" and g.tables.kv_indices.tensor.numel()
                        for g in fplan.groups.values())
        if missed and read_full:
            FAULT_COUNTS.acted("swa_pool_missed")  # an SWA group read a list of full slots
        if graphed and read_full:
            FAULT_COUNTS.acted("graph_draft_extend_untranslated")
        if f.window_off_by_one and lists_past_window(fplan.groups, narrower=1):
            FAULT_COUNTS.acted("window_off_by_one")  # a list holds the key W positions back
        if f.block_window_one_left_bound and batch.mode in _BLOCK_MODES and \
                self.cfg.spec.algorithm == "dflash":
            fplan = self._one_left_bound(fplan)
        if f.draft_planned_with_group0 and self._group0_misread(fplan):
            FAULT_COUNTS.acted("draft_planned_with_group0")
        if windows is not self.windows and lists_past_window(
                {k: replace(g, window=self._swa_window(fplan, k)) for k, g in fplan.groups.items()
                 if g.sub_pool == "swa"}):
            FAULT_COUNTS.acted("swa_metadata_missing_in_spec_modes")  # a key past the window
        if f.window_gather_from_zero:
            fplan = gather_from_zero(fplan, source)
        if f.verify_rows_share_write_loc:
            fplan = rows_share_write_loc(fplan)
        if f.verify_as_decode:
            fplan = verify_as_decode(fplan)
        return fplan

    def _plan_forward(self, batch: ForwardBatch, graph: tuple[int, int] | None) -> ForwardPlan:
        self._graph_plan = graph is not None  # a capture's or a replay's plan
        return super()._plan_forward(batch, graph)

    def _swa_window(self, fplan: ForwardPlan, key: str) -> int | None:
        """The window the layers of group ``key`` were built with (before a fault dropped it)."""
        return next((self.windows.get(j) for j, k in fplan.layer_groups.items() if k == key),
                    None)

    def _one_left_bound(self, fplan: ForwardPlan) -> ForwardPlan:
        """FAULT block_window_one_left_bound (sglang #35208): each windowed group of a block is
        planned W + (block - 1) wide over its key lists, which start at the first query's bound,
        so every query of the block sees from there: query j, j keys its window excludes."""
        groups = dict(fplan.groups)
        for key, g in fplan.groups.items():
            n = g.tables.max_q_len
            if g.window is None or n < 2:
                continue
            if lists_past_window({key: g}):
                FAULT_COUNTS.acted("block_window_one_left_bound")  # a later query gains a key
            groups[key] = replace(g, window=g.window + n - 1)
        return replace(fplan, groups=groups)

    def _group0_misread(self, fplan: ForwardPlan) -> bool:
        """Whether a draft layer's planned window lets a listed key in that its own window
        excludes, or trims one it sees (draft_planned_with_group0 acted)."""
        for j, key in fplan.layer_groups.items():
            g, own = fplan.groups[key], self._own_windows.get(j)
            narrow = min((w for w in (own, g.window) if w is not None), default=None)
            if own != g.window and narrow is not None and g.tables.max_keys > narrow:
                return True
        return False

    def _bucket_writes(self, st: GraphState, fplan: ForwardPlan, bs: int,
                       tokens: int) -> ForwardPlan:
        return bucket_writes(st, fplan, bs, tokens,
                             stale_swa=self.faults.graph_pad_stale_swa_loc)

    def graph_key(self, mode, bs: int, tokens: int) -> GraphKey:
        if self.faults.graph_key_without_mode:  # FAULT: every mode of a shape shares one graph
            return GraphKey("any mode", bs, tokens)
        return super().graph_key(mode, bs, tokens)

    def init_forward_metadata_replay(self, batch: ForwardBatch, bs: int, tokens: int,
                                     captured_mode=None) -> ForwardPlan:
        if (self.faults.graph_key_without_mode and captured_mode is not None
                and self.graph_route(captured_mode, tokens)
                != self.graph_route(batch.mode, tokens)):
            FAULT_COUNTS.acted("graph_key_without_mode")  # another route's graph replays it
        return super().init_forward_metadata_replay(batch, bs, tokens, captured_mode)

    def _read_scales(self, layer_id: int, scales: tuple[float, float]) -> dict:
        if self.faults.frozen_draft_fp8_unscaled and self.view.role == "draft_reads_target":
            # FAULT (vLLM #48666): the MTP draft aliases the target's fp8 K/V, not its scales
            if tuple(scales) != (1.0, 1.0):
                FAULT_COUNTS.acted("frozen_draft_fp8_unscaled")
            return {}
        if self.faults.fp8_descale_dropped and self.windows.get(layer_id) is None:
            # FAULT fp8_descale_dropped: the full layers' reads skip the scales
            if tuple(scales) != (1.0, 1.0):
                FAULT_COUNTS.acted("fp8_descale_dropped")
            return {}
        return super()._read_scales(layer_id, scales)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                layer_id: int, batch: ForwardBatch | None = None, save_kv: bool = True,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        if self.faults.sink_dropped:
            # the caller's side of the contract still holds: only the kernel drops them
            err = self.guards and sinks_error(layer_id, self.plan.mode, self.cfg.model,
                                              self.q_heads, sinks, self.takes_sinks)
            if err:
                raise err
            if sinks is not None:
                FAULT_COUNTS.acted("sink_dropped")
            sinks = None  # FAULT: the kernel takes sinks= and ignores it
        return super().forward(q, k, v, layer_id, batch, save_kv, sinks)


def with_faults(backend: AttentionBackend, **switches: bool) -> FaultyBackend:
    """``backend`` (built without a fault) switched to inject ``switches`` (fault field → True)
    from its next plan on: the same object, its class changed (tests that break a built
    backend). Only faults that act after construction: not window_off_by_one or
    pool_cached_at_init, which change what the constructor sets up."""
    early = {"window_off_by_one", "pool_cached_at_init"} & {k for k, v in switches.items() if v}
    if early:
        raise ValueError(f"{sorted(early)} act at construction: build with cfg.faults instead")
    backend.__class__ = FaultyBackend
    backend.faults = backend.cfg.faults.model_copy(update=switches)
    backend._frozen = None
    backend._sinks_rule = None if backend.faults.sink_dropped else backend.takes_sinks
    return backend


def admission_for(cfg: SwaFactoryConfig) -> Callable[..., dict[str, int]]:
    """The scheduler's admission need (`kvcache.shares.admission_need`'s signature): that
    function itself, or under ``windowed_draft_admitted_as_full`` (vLLM #55800) one that counts
    a window-retained draft's K/V at the whole sequence on the SWA side, as full attention's."""
    if not cfg.faults.windowed_draft_admitted_as_full:
        return admission_need

    def as_full(cfg, sizes, prompt_len: int, out: int) -> dict[str, int]:
        need = admission_need(cfg, sizes, prompt_len, out)
        windowed = cfg.spec.draft_kv_retention == "window"
        if windowed and "swa" in need and need["full"] > need["swa"]:
            FAULT_COUNTS.acted("windowed_draft_admitted_as_full")  # the SWA need grew
            need["swa"] = need["full"]  # FAULT: the whole sequence
        return need
    return as_full


def draft_swa_rows(cfg: SwaFactoryConfig, full_slots: int) -> int | None:
    """The SWA slots of a split draft pool (`kvcache.draft.split_draft_pool`): None (its share
    of the target's SWA capacity), or under ``swa_pool_missed`` one per target token, as
    sglang's draft runner holds them (a ratio of 1.0). Its full-slot reads then stay inside the
    buffer and land on rows the shared mapping has not filled yet: the wrong keys sglang #27737's
    users saw, and no crash."""
    return full_slots if cfg.faults.swa_pool_missed else None


def retained_window_for(cfg: SwaFactoryConfig) -> int:
    """The positions SWA eviction keeps before the next query (`RequestSlots.
    evict_out_of_window`'s ``window``): the model's window, or under ``lookahead_not_retained``
    (vLLM #42784, #44082) a block (a page) fewer, as an engine that counts a draft's lookahead
    block against the window instead of keeping it: the next verify's first query loses the
    oldest keys of its window."""
    W, P = cfg.model.sliding_window or 0, cfg.backend.page_size
    if cfg.faults.lookahead_not_retained and cfg.spec.algorithm != "none" and W > P:
        return W - P
    return W


def evictor_for(cfg: SwaFactoryConfig) -> Callable[..., int]:
    """The scheduler's SWA eviction of one request, ``evict(slots, rid, low, window, interval,
    prefilling) -> positions freed`` (`RequestSlots.evict_out_of_window`): that call, or under
    ``no_swa_eviction`` / ``paged_free_stale_mapping`` / ``lookahead_not_retained`` the faults'
    versions (nothing freed; a page freed whole with its mapping left per token; a decoding
    request keeping `retained_window_for`)."""
    f = cfg.faults
    keep = retained_window_for(cfg)
    if f.no_swa_eviction:
        def never(slots, rid, low: int, window: int, interval: int, prefilling: bool) -> int:
            if low - window + 1 >= interval:  # FAULT (sglang #33805): dead SWA slots stay
                FAULT_COUNTS.acted("no_swa_eviction")
            return 0
        return never
    if not (f.paged_free_stale_mapping or keep < (cfg.model.sliding_window or 0)):
        return lambda slots, rid, low, window, interval, prefilling: \
            slots.evict_out_of_window(rid, low, window, interval)

    def faulty_evict(slots, rid, low: int, window: int, interval: int, prefilling: bool) -> int:
        short = keep < window and not prefilling  # FAULT: the lookahead block not kept
        n = slots.evict_out_of_window(rid, low, keep if short else window, interval,
                                      paged_free_stale_mapping=f.paged_free_stale_mapping)
        if n and short and low - window + 1 > 0:
            FAULT_COUNTS.acted("lookahead_not_retained")  # a block of the window freed
        return n
    return faulty_evict
