"""CUDA-graph replay of the attention of every layer, for a runner that has every layer's q up
front (the conformance harness): a thin user of the backend's graph contract
(`swafactory.graphs.state`).

A batch of ``bs`` requests runs in the graph of the smallest bucket ``n ≥ bs``. The first batch
of a bucket captures it: `init_forward_metadata_capture`, one eager warm-up pass (kernel JIT) on
a side stream, then the capture of each layer's K/V write and attention. Every batch then plans
with `init_forward_metadata_replay` (which refills the captured buffers: tables, masks and write
slots), copies its q, k and v into the graph's static inputs and replays. Padding rows write the
dummy row and come back as garbage, cut off. On CPU (a backend with ``graph_emulation``) a
bucket's step is emulated (`EmulatedGraph`): a replay runs it over the buffers its capture bound.
Batches may shrink or grow between replays; each request may have up to ``tokens`` queries. An
engine whose layer l's q comes from layer l − 1 captures its own step with the same three calls.
`GraphedAttention.capture_all` captures every bucket at start-up (an engine's way: graph state
is then allocated once, before the pool fills). A bucket captured before `set_kv_scales` changed
an fp8 layer's scales is re-captured at its next forward (`AttentionBackend.graph_stale`).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from swafactory.errors import ConfigError, Reason
from swafactory.graphs.sizing import BUCKETS
from swafactory.metadata.batch import ForwardBatch, ForwardMode

__all__ = ["GraphedAttention", "EmulatedGraph", "BUCKETS", "capture_step", "refill"]



class EmulatedGraph:
    """A CPU stand-in for a captured CUDA graph (``graph_emulation``), as faithful as one: the
    capture runs ``step`` once over the bucket's capture plan and keeps the backend's binding
    (`AttentionBackend.graph_binding`: the capture plan, its write slots, each adapter's static
    tables); a replay runs ``step`` again with that binding put back (`bound_as`), so every
    launch reads the buffers its capture bound, as their contents stand at replay time, and
    never re-plans. A replay whose planning refilled other buffers (another route) or left one
    unrefilled then computes from stale tables, on CPU as on a GPU. Outputs are copied into the
    capture's (``out``), whose tensors keep their identity as a graph's static outputs do.

    step: reads only static inputs and calls the backend's `forward` per layer; returns a tensor
    or ``key → tensor``."""

    def __init__(self, backend, step: Callable[[], torch.Tensor | dict]) -> None:
        self.backend, self.step = backend, step
        self.binding = backend.graph_binding()
        self.out = step()

    def replay(self) -> None:
        with self.backend.bound_as(self.binding):
            new = self.step()
        if isinstance(new, torch.Tensor):
            self.out.copy_(new)
            return
        for key, o in new.items():
            self.out[key].copy_(o)


def capture_step(backend, bs: int, tokens: int, mode: ForwardMode,
                 step: Callable[[], object], device: torch.device) -> tuple[object, object]:
    """Plan bucket (``bs`` requests × ``tokens`` queries) of ``mode`` for capture and capture
    ``step`` (which reads only static inputs and calls the backend's `forward` per layer): one
    warm-up run on a side stream (kernel JIT and library set-up stay outside the graph), then
    the capture. Returns (the graph, or an `EmulatedGraph` off CUDA, its static output). Both
    graph drivers capture through here: `GraphedAttention` (attention only) and the engine's
    runner (whole model calls); each files the graph under `backend.graph_key(mode, bs,
    tokens)` and replays it with ``captured_mode=mode``."""
    backend.init_forward_metadata_capture(bs, tokens, mode)
    if device.type != "cuda":  # emulated: the backend's graph_emulation (CPU)
        rec = EmulatedGraph(backend, step)
        return rec, rec.out
    cur = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        step()  # warm-up, not captured (its writes go to the dummy row)
    cur.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def refill(static: torch.Tensor, new: torch.Tensor, rows: int) -> None:
    """Copy a replay's ``rows`` input rows into a graph's static input and zero the padding
    rows: padding carries no request's data, not the rows of an earlier, larger batch."""
    static[:rows].copy_(new)
    static[rows:].zero_()


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph | EmulatedGraph
    q: dict[int, torch.Tensor]
    """layer → [n·tokens, Hq, D] static input."""
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]
    """layer → static [n·tokens, Hkv, D] new K and V (empty for a read-only runner)."""
    out: dict[int, torch.Tensor]
    """layer → [n·tokens, Hq, D] static output."""


class GraphedAttention:
    """Graph-captured attention of ``layers`` for one forward mode.

    backend: a built `AttentionBackend` whose adapter serves graphs (``capabilities.cuda_graph``).
    layers: ``layer → (num_q_heads, head_dim)`` of the heads this runner computes.
    tokens: queries per request (1 = decode; at most this many). dtype: the queries' dtype.
    sinks: ``layer → [Hq]`` fp32 sink logits, for models with sinks. mode: the forward mode.
    """

    def __init__(self, backend, layers: Mapping[int, tuple[int, int]], *, tokens: int,
                 dtype: torch.dtype, buckets: Sequence[int] = BUCKETS,
                 sinks: Mapping[int, torch.Tensor] | None = None,
                 mode: ForwardMode | None = None) -> None:
        kind = backend.view.active_pool.sub_pools[0].device.type
        for ad in backend.adapters.values():
            if not ad.capabilities.replays_graphs(kind):
                raise ConfigError([Reason("backend", "backend.cuda_graph",
                                          f"{ad.capabilities.name} has no graph path on {kind}",
                                          "backend.cuda_graph=false", rule="cuda_graph")])
        self.backend, self.layers, self.tokens, self.dtype = backend, dict(layers), tokens, dtype
        self.buckets = tuple(sorted(buckets))
        self.sinks = dict(sinks or {})
        self.mode: ForwardMode = mode or ("decode" if tokens == 1 else "target_verify")
        self._graphs: dict[int, _Captured] = {}
        self.replays = 0
        self.captures = 0
        st = backend.cuda_graph_state
        if st is None or st.max_bs < self.buckets[-1] or st.max_tokens < tokens:
            backend.init_cuda_graph_state(max(self.buckets[-1], st.max_bs if st else 0),
                                          max(tokens, st.max_tokens if st else 0))

    @property
    def captured_on_device(self) -> bool:
        """True for CUDA graphs; False where replays are emulated (CPU)."""
        return self.backend.view.active_pool.sub_pools[0].device.type == "cuda"

    def bucket_or_none(self, batch_size: int) -> int | None:
        """The smallest bucket that holds ``batch_size`` requests, or None past the largest."""
        return next((n for n in self.buckets if n >= batch_size), None)

    def captured(self, bucket: int | None) -> bool:
        """Whether ``bucket`` was captured (and may replay: not stale)."""
        return (bucket in self._graphs
                and self.backend.graph_stale(bucket, self.tokens, self.mode) is None)

    def bucket(self, batch_size: int) -> int:
        """The smallest bucket that holds ``batch_size`` requests."""
        for n in self.buckets:
            if n >= batch_size:
                return n
        raise ValueError(f"{batch_size} requests exceed the largest graph bucket "
                         f"({self.buckets[-1]}); run this forward eagerly")

    def forward(self, batch: ForwardBatch, q: Mapping[int, torch.Tensor],
                kv: Mapping[int, tuple[torch.Tensor, torch.Tensor]] | None = None
                ) -> dict[int, torch.Tensor]:
        """Plan ``batch``, copy the inputs, replay; returns ``layer → [total_q, Hq, D]``.

        q: ``layer → [total_q, Hq, D]``; kv: ``layer → (k, v)`` each ``[total_q, Hkv, D]``, the
        forward's new tokens (None: a read-only runner). Outputs are views of the graph's static
        buffers, valid until the next replay of the same bucket.
        """
        n = self.bucket(batch.batch_size)
        st = self._graphs.get(n)
        if st is None or self.backend.graph_stale(n, self.tokens, self.mode) is not None:
            st = self._graphs[n] = self._capture(n, q, kv)  # stale: the scales it baked in
        self.backend.init_forward_metadata_replay(batch, n, self.tokens, captured_mode=self.mode)
        rows = batch.total_q
        for layer, x in q.items():
            refill(st.q[layer], x, rows)
        for layer, (k, v) in (kv or {}).items():
            for buf, new in zip(st.kv[layer], (k, v)):
                refill(buf, new, rows)
        st.graph.replay()
        self.replays += 1
        return {layer: o[:rows] for layer, o in st.out.items()}

    def capture_all(self, q: Mapping[int, torch.Tensor],
                    kv: Mapping[int, tuple[torch.Tensor, torch.Tensor]] | None = None) -> int:
        """Capture every bucket not captured yet (start-up); returns how many were. q, kv: one
        example input per layer as in `forward` (only their device and trailing shapes count)."""
        todo = [n for n in self.buckets if n not in self._graphs]
        for n in todo:
            self._graphs[n] = self._capture(n, q, kv)
        return len(todo)

    def _attend(self, qs, kvs) -> dict[int, torch.Tensor]:
        return {layer: self.backend.forward(x, *kvs.get(layer, (None, None)), layer,
                                            save_kv=layer in kvs, sinks=self.sinks.get(layer))
                for layer, x in qs.items()}

    def _capture(self, n: int, q: Mapping[int, torch.Tensor], kv) -> _Captured:
        dev = next(iter(q.values())).device
        rows = n * self.tokens
        qs = {layer: torch.zeros(rows, hq, d, dtype=self.dtype, device=dev)
              for layer, (hq, d) in self.layers.items()}
        kvs = {}
        for layer, (k, _) in (kv or {}).items():
            kvs[layer] = (k.new_zeros(rows, *k.shape[1:]), k.new_zeros(rows, *k.shape[1:]))
        self.captures += 1
        graph, out = capture_step(self.backend, n, self.tokens, self.mode,
                                  lambda: self._attend(qs, kvs), dev)
        return _Captured(graph, qs, kvs, out)
