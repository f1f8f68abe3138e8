"""CUDA-graph replay of the attention of every layer, for a runner that has every layer's q up
front (the conformance harness): a thin user of the backend's graph contract
(`swafactory.graph_state`).

A batch of ``bs`` requests runs in the graph of the smallest bucket ``n ≥ bs``. The first batch
of a bucket captures it: `init_forward_metadata_capture`, one eager warm-up pass (kernel JIT) on
a side stream, then the capture of each layer's K/V write and attention. Every batch then plans
with `init_forward_metadata_replay` (which refills the captured buffers: tables, masks and write
slots), copies its q, k and v into the graph's static inputs and replays. Padding rows write the
dummy row and come back as garbage, cut off. On CPU (a backend with ``graph_emulation``) a
bucket's step is recorded instead of captured and each replay re-runs it over the same buffers.
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
from swafactory.graph_sizing import BUCKETS
from swafactory.metadata.batch import ForwardBatch, ForwardMode

__all__ = ["GraphedAttention", "RecordedStep", "BUCKETS"]



class RecordedStep:
    """A CPU stand-in for a captured graph (``graph_emulation``): replay re-runs the recorded
    step over the same static inputs and copies into the same static outputs, so the backend's
    replay planning (the buffers refilled in place, the padding rows) runs as on a GPU.

    step: reads only static inputs; returns a tensor or ``key → tensor`` (kept as ``out``)."""

    def __init__(self, step: Callable[[], torch.Tensor | dict[int, torch.Tensor]]) -> None:
        self.step = step
        self.out = step()

    def replay(self) -> None:
        new = self.step()
        if isinstance(new, torch.Tensor):
            self.out.copy_(new)
            return
        for key, o in new.items():
            self.out[key].copy_(o)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph | RecordedStep
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
        if st is None or self.backend.graph_stale(n, self.tokens) is not None:
            st = self._graphs[n] = self._capture(n, q, kv)  # stale: the scales it baked in
        self.backend.init_forward_metadata_replay(batch, n, self.tokens)
        rows = batch.total_q
        # padding rows carry no request's data (an engine's padded tokens are not any request's
        # tokens either): zeros, not the stale rows of an earlier, larger batch
        for layer, x in q.items():
            st.q[layer][:rows].copy_(x)
            st.q[layer][rows:].zero_()
        for layer, (k, v) in (kv or {}).items():
            for buf, new in zip(st.kv[layer], (k, v)):
                buf[:rows].copy_(new)
                buf[rows:].zero_()
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
        self.backend.init_forward_metadata_capture(n, self.tokens, self.mode)
        self.captures += 1
        if dev.type != "cuda":  # emulated (the backend's graph_emulation)
            rec = RecordedStep(lambda: self._attend(qs, kvs))
            return _Captured(rec, qs, kvs, rec.out)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm-up: kernel JIT, not captured (writes: dummy row)
            self._attend(qs, kvs)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._attend(qs, kvs)
        return _Captured(graph, qs, kvs, out)
