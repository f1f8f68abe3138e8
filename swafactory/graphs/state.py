"""The CUDA-graph contract's state: what an engine's captured step reads, refilled in place.

sglang's shape (`AttentionBackend` exposes it):

    backend.init_cuda_graph_state(max_bs, max_tokens, max_context)
    for bs in buckets:                                   # once per bucket, at start-up
        backend.init_forward_metadata_capture(bs, tokens, mode)
        step(static_inputs)                              # eager warm-up (JIT, wrapper set-up)
        with torch.cuda.graph(graphs[bs]):
            step(static_inputs)                          # backend.forward(q, k, v, layer) inside
    ...
    backend.init_forward_metadata_replay(batch, bs, tokens)   # every step: plan, refill
    static_inputs[:rows].copy_(inputs); graphs[bs].replay()

The engine captures its *own* step: layer l's q may come from layer l − 1's output. A bucket
holds up to ``bs`` requests of up to ``tokens`` query rows each (rows ``bs · tokens``); the
batch's rows come first, padding rows after them. Padding rows write their K/V to, and padding
requests read, the pool's dummy row 0, which no request owns. Captured kernels read buffers that
replay planning refills in place: the write locations here (one static tensor per layer group)
and the kernel adapter's own (FlashInfer's ``use_cuda_graph`` wrappers).

Every buffer is sized by what a bucket can read, never by the pool: ``bs · max_context`` keys
in a full group, ``bs · (W + tokens + page)`` in a window group (`sizing.bucket_keys`), so
capturing every bucket at start-up costs the same over a 1M-row pool as over a small one; a
replay whose requests read more raises (`GraphState.check_keys`). What the kernels take as host
constants is recorded at capture: fp8 K/V scales (`GraphState.record_scales`); a replay after
`set_kv_scales` changed one raises `StaleGraphError` naming the layer, and an engine re-captures
(`AttentionBackend.graph_stale`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from swafactory.errors import ConfigError, Reason, SpaceError
from swafactory.fault_counts import FAULT_COUNTS
from swafactory.graphs.sizing import bucket_keys
from swafactory.guards import DeviceCheck
from swafactory.kvcache.locs import Locs
from swafactory.metadata.batch import ForwardMode
from swafactory.metadata.plan import AttnTables, ForwardPlan, GroupPlan, group_key

__all__ = ["GraphState", "GraphKey", "Captured", "StaleGraphError", "GraphRouteError",
           "capture_plan", "bucket_writes", "check_graphable", "check_padding", "bucket_keys"]


class StaleGraphError(ValueError):
    """A captured bucket baked in what has changed since (a layer's fp8 K/V scales)."""


class GraphRouteError(SpaceError):
    """A replay would run a graph captured for another route (the kernels and buffers a forward
    mode decides) over this batch: its kernels would read buffers this replay never refilled."""


class GraphKey(NamedTuple):
    """What a captured graph is keyed by: the forward mode (it decides the pass, and so the
    kernels and the buffers they read), requests and queries per request. Keying by the shape
    alone lets one mode's graph replay over another mode's tables."""

    mode: str
    bs: int
    tokens: int

    def __str__(self) -> str:
        return f"{self.mode} bucket of {self.bs} requests × {self.tokens} tokens"


@dataclass(frozen=True, eq=False)
class Captured:
    """One captured bucket: the pool it was captured against (its buffers are in the graph), its
    route (each kernel's pass and variant, `AttentionBackend.graph_route`) and the binding its
    kernels hold (the capture plan and each adapter's static tables:
    `AttentionBackend.graph_binding`), which an emulated replay runs over."""

    pool: object
    route: tuple
    binding: object



def check_graphable(caps: list, device_type: str, cascade: bool, max_bs: int,
                    max_tokens: int) -> None:
    """Refuse a graph state the backend cannot replay: a kernel (its `Capabilities` in ``caps``)
    with no graph path on ``device_type`` (off CUDA the contract's planning serves an
    emulation), a cascade (its split depends on the batch), or empty limits."""
    for c in caps:
        if not (c.replays_graphs(device_type) or c.cuda_graph):
            raise ConfigError([Reason("backend", "backend.cuda_graph",
                                      f"{c.name} has no graph path on {device_type}",
                                      "backend.cuda_graph=false, or backend=flashinfer",
                                      rule="cuda_graph")])
    if cascade:
        raise ConfigError([Reason("backend", "backend.tree_mask",
                                  "a cascade's prefix/expand split depends on the batch, so "
                                  "a captured graph cannot replay it",
                                  "backend.tree_mask=custom_mask", rule="cuda_graph")])
    if max_bs < 1 or max_tokens < 1:
        raise ValueError(f"init_cuda_graph_state needs max_bs >= 1 and max_tokens >= 1, got "
                         f"{max_bs}, {max_tokens}")


@dataclass
class GraphState:
    """Static buffers of one backend's graphs (`AttentionBackend.init_cuda_graph_state`)."""

    max_bs: int
    max_tokens: int
    device: torch.device
    max_context: int = 1
    """Most keys (context tokens, this forward's included) one request of a bucket reads: full
    groups' buffers hold ``bs · max_context`` keys, SWA groups' ``bs · (W + tokens + page)``."""
    page: int = 1
    """The pool's page size (page-aligned SWA lists start up to a page before the window)."""
    nodes: int = 1
    """The most nodes one request adds in a step (`kvcache.sizing.step_nodes` of the spec)."""
    writes: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict)
    """(group key, bs, tokens) → ``[bs · tokens]`` int64 write slots of that bucket's graph;
    rows past a batch's hold 0, the dummy row. The groups of one bucket are rows of one block
    (`blocks`)."""
    blocks: dict[tuple[int, int], tuple[torch.Tensor, tuple[str, ...]]] = \
        field(default_factory=dict)
    """(bs, tokens) → (``[groups, bs · tokens]`` int64, the groups' keys in row order): every
    writing group's slots of a bucket in one tensor, so the padding guard is one reduction."""
    filled: dict[tuple[str, int, int], int] = field(default_factory=dict)
    """Same keys → rows of the buffer that hold slots a replay wrote (fault accounting: the
    rows past a batch that ``stale_swa`` leaves unpadded)."""
    captured: dict[GraphKey, Captured] = field(default_factory=dict)
    """(mode, bs, tokens) → what the bucket was captured with (`Captured`)."""
    scales: dict[GraphKey, tuple[int, dict[int, tuple[float, float]]]] = \
        field(default_factory=dict)
    """(mode, bs, tokens) → (the pool's ``scales_version``, fp8 layer → (k_scale, v_scale)) at
    its capture: the kernels take the scales as host floats, so a graph holds the ones it had."""

    def keys(self, window: int | None, tokens: int) -> int:
        """Most keys per request of a group with ``window`` in a bucket of ``tokens`` queries."""
        return bucket_keys(window, tokens, self.max_context, self.page, self.nodes)

    def check_keys(self, plan: ForwardPlan, bs: int, tokens: int) -> None:
        """ValueError when a request of ``plan`` lists more keys than bucket (bs, tokens)'s
        buffers hold per request: from the planner's host indptrs, nothing read back."""
        for key, g in plan.groups.items():
            need = g.tables.max_keys
            cap = self.keys(g.window, tokens)
            if need > cap:
                bound = (f"max_context={self.max_context}" if g.window is None else
                         f"min(max_context={self.max_context}, W {g.window} + max(tokens "
                         f"{tokens}, step nodes {self.nodes}) + page {self.page})")
                raise ValueError(
                    f"graph bucket of {bs} requests × {tokens} tokens: a request of group {key} "
                    f"reads {need} keys, past the {cap} per request its buffers hold ({bound}); "
                    "pass a larger max_context to init_cuda_graph_state before capturing, or run "
                    "this forward eagerly")

    def stale(self, key: GraphKey, pool) -> str | None:
        """Why bucket ``key`` cannot replay over ``pool``'s current fp8 scales (the layer, the
        captured and current scales and versions), or None when it can."""
        bs, tokens = key.bs, key.tokens
        version, scales = self.scales.get(key, (None, {}))
        now = pool.scales_version
        if version is None or version == now:
            return None
        for layer, old in sorted(scales.items()):
            cur = tuple(pool.kv_scales(layer))
            if cur != old:
                return (f"graph bucket of {bs} requests × {tokens} tokens was captured with layer "
                        f"{layer}'s fp8 scales (k, v) = {old} (scales version {version}); the pool "
                        f"now has {cur} (version {now}): re-capture the bucket "
                        "(init_forward_metadata_capture + your capture) after set_kv_scales")
        return None

    def record_scales(self, key: GraphKey, pool, fp8_layers) -> None:
        """Note ``pool``'s scales of ``fp8_layers`` as bucket ``key``'s, at its capture."""
        self.scales[key] = (pool.scales_version,
                                     {l: tuple(pool.kv_scales(l)) for l in fp8_layers})

    @property
    def bytes(self) -> int:
        """Bytes of the write buffers held here (the adapters' own are theirs to count)."""
        return sum(t.numel() * t.element_size() for t in self.writes.values())

    def check(self, bs: int, tokens: int) -> None:
        """ValueError naming the limit when a bucket exceeds `init_cuda_graph_state`'s."""
        if not 1 <= bs <= self.max_bs or not 1 <= tokens <= self.max_tokens:
            raise ValueError(f"a graph bucket of {bs} requests × {tokens} tokens is outside "
                             f"init_cuda_graph_state(max_bs={self.max_bs}, "
                             f"max_tokens={self.max_tokens})")

    def write_buffer(self, key: str, bs: int, tokens: int) -> torch.Tensor:
        """The static write slots of group ``key`` in bucket (bs, tokens) (a row of the
        bucket's block when `write_block` made one)."""
        buf = self.writes.get((key, bs, tokens))
        if buf is None:
            buf = self.writes[(key, bs, tokens)] = torch.zeros(bs * tokens, dtype=torch.int64,
                                                               device=self.device)
        return buf

    def write_block(self, keys: tuple[str, ...], bs: int, tokens: int) -> None:
        """Make bucket (bs, tokens)'s write buffers for groups ``keys`` rows of one block
        (once: a captured graph holds their addresses)."""
        if (bs, tokens) in self.blocks or not keys:
            return
        block = torch.zeros(len(keys), bs * tokens, dtype=torch.int64, device=self.device)
        self.blocks[(bs, tokens)] = (block, keys)
        for key, row in zip(keys, block.unbind(0)):
            self.writes[(key, bs, tokens)] = row


def capture_plan(state: GraphState, pool, layers_mapping, windows, *, bs: int, tokens: int,
                 mode: ForwardMode, writes: bool) -> ForwardPlan:
    """A plan of ``bs`` requests × ``tokens`` queries that read one key each and write, all at
    the dummy row 0 of each group's space: the shapes of the bucket, no request's data.

    layers_mapping: the pool's ``layer -> (sub_pool, local_id)``; windows: ``layer -> W | None``.
    """
    dev = state.device
    i32 = dict(dtype=torch.int32)
    qo_host = torch.arange(0, (bs + 1) * tokens, tokens, **i32)
    kv_host = torch.arange(bs + 1, **i32)
    groups: dict[str, GroupPlan] = {}
    layer_groups: dict[int, str] = {}
    if writes:
        state.write_block(tuple(dict.fromkeys(group_key(sub, windows[l]) for l, (sub, _)
                                              in sorted(layers_mapping.items()))), bs, tokens)
    for layer, (sub_name, _) in sorted(layers_mapping.items()):
        key = group_key(sub_name, windows[layer])
        layer_groups[layer] = key
        if key in groups:
            continue
        sub = pool.sub_pool(layer)
        tables = AttnTables(qo_host.to(dev), kv_host.to(dev),
                            Locs.dummy(sub.space, sub.indexed_by, bs, dev),
                            torch.zeros(bs * tokens, device=dev, **i32),
                            torch.zeros(bs, device=dev, **i32), max_q_len=tokens,
                            qo_host=qo_host, kv_host=kv_host)
        w = None
        if writes:
            w = Locs.dummy(sub.space, sub.indexed_by, 0, dev).copy_into(
                state.write_buffer(key, bs, tokens))
        groups[key] = GroupPlan(key, sub_name, windows[layer], tables, None, w)
    return ForwardPlan(mode, groups, layer_groups, "graph capture", bs * tokens)


def bucket_writes(state: GraphState, plan: ForwardPlan, bs: int, tokens: int, *,
                  stale_swa: bool = False) -> ForwardPlan:
    """``plan`` with each group's write slots copied into its static buffer (rows past the
    batch's set to the dummy row 0): the tensors the captured writes index.

    stale_swa: FAULT graph_pad_stale_swa_loc (sglang #24743): the SWA groups' padding rows keep
    the slots an earlier, larger replay wrote there, so padding K/V lands in live SWA slots."""
    rows = bs * tokens
    groups = {}
    for key, g in plan.groups.items():
        if g.write_locs is None:
            groups[key] = g
            continue
        stale, n, at = stale_swa and g.window is not None, len(g.write_locs), (key, bs, tokens)
        if stale and state.filled.get(at, 0) > n:  # acted: padding keeps an earlier replay's slots
            FAULT_COUNTS.acted("graph_pad_stale_swa_loc")
        state.filled[at] = max(n, state.filled.get(at, 0)) if stale else n
        groups[key] = replace(g, write_locs=g.write_locs.copy_into(
            state.write_buffer(key, bs, tokens), pad=not stale))
    return replace(plan, groups=groups, total_q=rows)


def check_padding(state: GraphState, plan: ForwardPlan, bs: int, tokens: int,
                  rows: int) -> DeviceCheck | None:
    """The padding guard as a `guards.DeviceCheck` (None: the bucket has no padding writes): a
    SpaceError when a group's write slots past the batch's ``rows`` are not the dummy row 0. The
    captured step writes every row of the bucket, so a padding row holding a real slot
    overwrites live K/V. ``plan`` is `bucket_writes`'s.

    One reduction on the device, no read back: the largest padding slot of each group (the
    bucket's write block, `GraphState.write_block`); slots are never negative, so 0 means every
    padding row writes the dummy row. The caller reads the word where reading is free
    (`AttentionBackend`: at once on CPU, at `raise_pending` on CUDA)."""
    writing = tuple(k for k, g in plan.groups.items() if g.write_locs is not None)
    if not writing or rows >= bs * tokens:
        return None
    block, keys = state.blocks.get((bs, tokens), (None, ()))
    if set(keys) == set(writing):  # the plan's write slots are its rows (`bucket_writes`)
        word = block[:, rows:].amax(dim=1)
    else:  # groups outside the bucket's block (not captured together): a reduction each
        keys = writing
        word = torch.stack([plan.groups[k].write_locs.tensor.reshape(-1)[rows:].amax()
                            for k in keys])
    pools = {k: plan.groups[k].write_locs.pool_id for k in keys}
    total = plan.total_q

    def explain(word: list[int]) -> SpaceError | None:
        live = [(k, m) for k, m in zip(keys, word) if m != 0]
        if not live:
            return None
        key, top = live[0]
        return SpaceError(f"graph bucket of {total} rows: group {key}'s padding rows (past the "
                          f"batch's {rows}) write live slots (the largest {top}) of "
                          f"{pools[key]!r}, not the dummy row 0: the captured step would "
                          "overwrite live K/V (write slots left from an earlier replay)")
    return DeviceCheck(word, explain)
