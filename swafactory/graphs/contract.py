"""The CUDA-graph contract of `AttentionBackend` (`swafactory.graphs.state` says how an engine uses
it): graph state sized once, a bucket's capture plan, a replay's plan refilled in place.

A base of `AttentionBackend`: it uses the attributes `core.AttentionBackend.__init__` sets
(``cfg``, ``view``, ``windows``, ``guards``, ``_graph``, ``_pool``) and its planning methods
(``_plan_forward``, ``_plan_kernels``, ``_set_plan``, ``_defer``, ``_capture_pool``)."""
from __future__ import annotations

import torch

from contextlib import contextmanager
from dataclasses import dataclass

from swafactory.graphs.state import (Captured, GraphKey, GraphRouteError, GraphState,
                                   StaleGraphError, bucket_writes, capture_plan, check_graphable,
                                   check_padding)
from swafactory.guards import CallOrderError
from swafactory.kvcache.quant import is_fp8
from swafactory.kvcache.sizing import step_nodes
from swafactory.metadata.batch import MODE_PASS, ForwardBatch, ForwardMode
from swafactory.metadata.plan import ForwardPlan

__all__ = ["GraphContract", "GraphBinding"]


@dataclass(frozen=True, eq=False)
class GraphBinding:
    """What a captured step's kernels hold, taken right after its capture planning: the capture
    plan (its groups' tables, write slots and layer entries) and each adapter's host state (which
    static tables its launches read). A GPU graph holds these as addresses; an emulated replay
    (`graphs.EmulatedGraph`) runs the step with this binding put back, so it reads what the
    capture bound, refilled or not, never what the replay planned."""

    plan: ForwardPlan
    pool: object
    entries: dict
    writes: dict
    decode: frozenset
    adapters: dict


class GraphContract:
    """init_cuda_graph_state, init_forward_metadata_capture / _replay and what they report."""


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
        nodes, `sizing.bucket_keys`), never the pool's rows. Default:
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
        spec = self.cfg.spec  # a chain spec's verify and draft extend batches are plain chains
        chains = spec.algorithm != "none" and not spec.is_tree
        for ad in self.adapters.values():  # the adapters size their graph buffers by it
            if hasattr(ad, "graph_keys"):
                ad.graph_keys = st.keys
            if hasattr(ad, "graph_chains"):
                ad.graph_chains = chains

    def graph_state_bytes(self) -> int:
        """Bytes of every static buffer held for graphs: the write slots here and each
        adapter's (FlashInfer's graph wrappers and their int workspaces, Triton's static
        tables); 0 before `init_cuda_graph_state`. Shared eager workspaces are not counted."""
        if self._graph is None:
            return 0
        return self._graph.bytes + sum(ad.graph_bytes() for ad in self.adapters.values()
                                       if hasattr(ad, "graph_bytes"))

    def graph_stale(self, bs: int, tokens: int, mode: ForwardMode | None = None) -> str | None:
        """Why captured bucket (bs, tokens) of ``mode`` (None: of any mode) may not replay now (a
        layer's fp8 scales changed since its capture: `set_kv_scales`), or None. An engine
        re-captures it on a reason."""
        st = self._graph
        for key, cap in ({} if st is None else st.captured).items():
            if (key.bs, key.tokens) == (bs, tokens) and mode in (None, key.mode):
                why = st.stale(key, cap.pool)
                if why is not None:
                    return why
        return None

    def graph_key(self, mode: ForwardMode, bs: int, tokens: int) -> GraphKey:
        """The key an engine files its captured graph of this bucket under: the mode decides
        the pass, and so the kernels and the buffers they read (`graph_route`)."""
        return GraphKey(mode, bs, tokens)

    def graph_route(self, mode: ForwardMode, tokens: int) -> tuple:
        """(kernel, its route) for each kernel that serves a layer group in a bucket of ``mode``
        with ``tokens`` queries per request (a pass may run on another family's kernel): the
        buffers the kernel binds for it (its pass's tables or wrapper, and the variant: decode,
        causal chain, masked). Two modes may share a graph only when their routes are equal."""
        used = sorted({self.kernel_of(w, mode) for w in set(self.windows.values())})
        return tuple((name, ad.graph_route(mode, tokens) if hasattr(ad, "graph_route")
                      else MODE_PASS.get(mode, "extend"))
                     for name, ad in self.adapters.items() if name in used)

    def graph_binding(self) -> GraphBinding:
        """The current plan's binding (`GraphBinding`): taken after a capture's planning."""
        return GraphBinding(self._plan, self._pool, self._entries, dict(self._writes),
                            frozenset(self._decode),
                            {n: ad.graph_binding() for n, ad in self.adapters.items()
                             if hasattr(ad, "graph_binding")})

    @contextmanager
    def bound_as(self, binding: GraphBinding):
        """Run the block over ``binding`` (an emulated replay of the step captured with it), then
        put back the plan the replay made (its guards' checks and write accounting stay)."""
        now = self.graph_binding()
        self._install(binding)
        try:
            yield
        finally:
            self._install(now)

    def _install(self, b: GraphBinding) -> None:
        self._plan, self._pool, self._entries = b.plan, b.pool, b.entries
        self._writes, self._decode = dict(b.writes), set(b.decode)
        self._graphed = True
        for name, state in b.adapters.items():
            self.adapters[name].restore_binding(state)

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
        pool = self._capture_pool()
        fplan = capture_plan(st, pool, pool.layers_mapping, self.windows, bs=bs, tokens=tokens,
                             mode=mode, writes=not pool.read_only)
        self._plan_kernels(fplan, pool, (bs, tokens))
        key = GraphKey(mode, bs, tokens)
        st.record_scales(key, pool, [l for l in pool.layers_mapping
                                     if is_fp8(pool.sub_pool(l).dtype)])
        self._pool = pool
        self._set_plan(fplan, graphed=True)
        st.captured[key] = Captured(pool, self.graph_route(mode, tokens), self.graph_binding())
        return fplan

    def init_forward_metadata_replay(self, batch: ForwardBatch, bs: int, tokens: int,
                                     captured_mode: ForwardMode | None = None) -> ForwardPlan:
        """Plan ``batch`` for the captured bucket (``bs``, ``tokens``) and refill the buffers its
        graph reads, in place; the engine then copies its inputs and replays. The batch has at
        most ``bs`` requests of at most ``tokens`` queries each.

        captured_mode: the mode the graph the engine will replay was captured in (None: the
        batch's, or another mode of the same route). With guards on, a graph captured for
        another route raises `GraphRouteError` here, on the host, before anything is planned:
        its kernels read buffers this replay would not refill."""
        st = self._graph_state()
        key, captured = self._captured(st, batch.mode, bs, tokens, captured_mode)
        if self.guards:
            route = self.graph_route(batch.mode, tokens)
            if route != captured.route:
                raise GraphRouteError(
                    f"graph {key} replayed for a {batch.mode} batch: it was captured for route "
                    f"{_route(captured.route)}, the batch plans {_route(route)}; its kernels "
                    "would read buffers this replay does not refill. Key captured graphs by "
                    "backend.graph_key(mode, bs, tokens) and capture each mode at start-up")
        if batch.batch_size > bs:
            raise ValueError(f"{batch.batch_size} requests do not fit the graph bucket of {bs}")
        stale = st.stale(key, captured.pool)
        if stale is not None:  # the graph's kernels hold the captured scales as constants
            raise StaleGraphError(stale)
        fplan = self._plan_forward(batch, (bs, tokens))
        if self._pool is not captured.pool:  # the graph holds the captured pool's addresses
            raise ValueError("the runner's active pool is not the one this graph was captured "
                             "against; capture per pool (a FROZEN_KV draft's frozen view)")
        padded = self._bucket_writes(st, fplan, bs, tokens)
        if self.guards:  # the captured writes are unchecked: check what they will write, here
            # (typed space now; bounds and padding on the device: raised at once on CPU, at
            # raise_pending on CUDA, so a replay reads nothing back)
            seen: set[str] = set()
            for layer, key in fplan.layer_groups.items():
                g = fplan.groups[key]
                if g.write_locs is not None and key not in seen:
                    seen.add(key)
                    self._defer(self._pool.check(layer, g.write_locs))
            self._defer(check_padding(st, padded, bs, tokens, batch.total_q))
        self._set_plan(padded, graphed=True)
        return self._plan

    def _captured(self, st: GraphState, mode: ForwardMode, bs: int, tokens: int,
                  captured_mode: ForwardMode | None) -> tuple[GraphKey, Captured]:
        """The captured bucket a replay runs: ``captured_mode``'s, else ``mode``'s, else one of
        the same (bs, tokens) whose route is ``mode``'s (an engine that captured once per
        route); ValueError naming what was captured."""
        key = GraphKey(captured_mode or mode, bs, tokens)
        cap = st.captured.get(key)
        if cap is None and captured_mode is None:
            route = self.graph_route(mode, tokens)
            key, cap = next(((k, c) for k, c in st.captured.items()
                             if (k.bs, k.tokens) == (bs, tokens) and c.route == route),
                            (key, None))
        if cap is None:
            have = ", ".join(map(str, st.captured)) or "none"
            raise ValueError(f"no graph was captured for the {key}; captured: {have}")
        return key, cap

    def _bucket_writes(self, st: GraphState, fplan: ForwardPlan, bs: int,
                       tokens: int) -> ForwardPlan:
        """``fplan`` padded to the bucket: padding rows write the dummy row
        (`state.bucket_writes`)."""
        return bucket_writes(st, fplan, bs, tokens)


def _route(route: tuple) -> str:
    return ", ".join(f"{name}: {r if isinstance(r, str) else '/'.join(map(str, r))}"
                     for name, r in route)
