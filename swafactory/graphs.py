"""CUDA-graph replay of decode and verify attention: capture once per batch bucket, replay after
re-planning.

The flow is sglang's: a batch of ``bs`` requests runs in the graph of the smallest bucket ``n ≥
bs``. `AttentionBackend.init_forward_metadata` plans it as usual (all host work), and the adapter,
told the bucket, pads it to ``n`` requests and copies the tables into the fixed buffers the
captured kernels read. The new tokens' K/V are written eagerly (their slots change every step),
the queries are copied into the graph's static input, and the graph replays every layer's
attention. Padding rows come back as garbage and are cut off.

The first batch of a bucket captures it: one eager warm-up pass (kernel JIT, wrapper plans) on a
side stream, then the capture. Batches may shrink or grow between replays within a bucket;
every request of a graphed forward must have the same query count (``tokens``: 1 for decode,
the draft token count for verify).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from swafactory.errors import ConfigError, Reason
from swafactory.metadata.batch import ForwardBatch

__all__ = ["GraphedAttention", "BUCKETS"]

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
"""Default batch-size buckets (requests per graph)."""


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    q: dict[int, torch.Tensor]
    """layer → [n·tokens, Hq, D] static input."""
    out: dict[int, torch.Tensor]
    """layer → [n·tokens, Hq, D] static output."""


class GraphedAttention:
    """Graph-captured attention of ``layers`` for one forward mode.

    backend: a built `AttentionBackend` whose adapter serves graphs (``capabilities.cuda_graph``).
    layers: ``layer → (num_q_heads, head_dim)`` of the heads this runner computes.
    tokens: queries per request (1 = decode). dtype: the queries' dtype.
    sinks: ``layer → [Hq]`` fp32 sink logits, for models with sinks.
    """

    def __init__(self, backend, layers: Mapping[int, tuple[int, int]], *, tokens: int,
                 dtype: torch.dtype, buckets: Sequence[int] = BUCKETS,
                 sinks: Mapping[int, torch.Tensor] | None = None) -> None:
        caps = backend.capabilities
        if not caps.cuda_graph or not hasattr(backend.adapter, "graph"):
            raise ConfigError([Reason("backend", "backend.cuda_graph",
                                      f"{caps.name} has no CUDA-graph path", "backend.cuda_graph=false",
                                      rule="cuda_graph")])
        self.backend, self.layers, self.tokens, self.dtype = backend, dict(layers), tokens, dtype
        self.buckets = tuple(sorted(buckets))
        self.sinks = dict(sinks or {})
        self._graphs: dict[int, _Captured] = {}
        self.replays = 0
        self.captures = 0

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
        """Plan ``batch``, write ``kv`` eagerly, replay; returns ``layer → [total_q, Hq, D]``.

        q: ``layer → [total_q, Hq, D]``; kv: ``layer → (k, v)`` each ``[total_q, Hkv, D]``, the
        forward's new tokens (None: a read-only runner). Outputs are views of the graph's static
        buffers, valid until the next replay of the same bucket.
        """
        n = self.bucket(batch.batch_size)
        adapter = self.backend.adapter
        adapter.graph = (n, self.tokens)
        try:
            self.backend.init_forward_metadata(batch)
        finally:
            adapter.graph = None
        for layer, (k, v) in (kv or {}).items():
            self.backend.write_kv(layer, k, v)
        rows = batch.total_q
        st = self._graphs.get(n)
        if st is None:
            st = self._graphs[n] = self._capture(n, q, rows)
        else:
            for layer, x in q.items():
                st.q[layer][:rows].copy_(x)
            st.graph.replay()
            self.replays += 1
        return {layer: o[:rows] for layer, o in st.out.items()}

    def _attend(self, qs: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        return {layer: self.backend.forward(x, None, None, layer, save_kv=False,
                                            sinks=self.sinks.get(layer))
                for layer, x in qs.items()}

    def _capture(self, n: int, q: Mapping[int, torch.Tensor], rows: int) -> _Captured:
        dev = next(iter(q.values())).device
        qs = {}
        for layer, (hq, d) in self.layers.items():
            qs[layer] = torch.zeros(n * self.tokens, hq, d, dtype=self.dtype, device=dev)
            qs[layer][:rows].copy_(q[layer])
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm-up: JIT and the wrappers' first plans, not captured
            self._attend(qs)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._attend(qs)
        graph.replay()  # capture records without running: this replay is the forward's output
        self.captures += 1
        return _Captured(graph, qs, out)
