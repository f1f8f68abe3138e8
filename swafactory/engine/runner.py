"""One runner of the generator: an HF model whose attention is one `AttentionBackend`.

A forward packs the batch's query tokens into one sequence ``[1, T]`` with per-token
``position_ids`` (tree nodes at ``prefix + depth``), plans it once
(``backend.init_forward_metadata``), then calls the model with ``use_cache=False`` inside
`routing(backend)`: every attention module attends through the backend, which holds the K/V.

With ``graphs=True`` (``backend.cuda_graph=true``) every forward but a prefill (``extend``)
replays a CUDA graph of the whole model call through the backend's graph contract
(`swafactory.graphs.state`): the engine's own step, each layer's q from the layer before. A graph
is filed under `backend.graph_key` (the mode, requests rounded up to `BUCKETS`, queries per
request to a power of two): the mode decides the pass, and so the kernels and the buffers they
read, so one mode's graph never replays over another mode's tables. Every bucket × mode the
spec meets (`graph_modes`) is captured at start-up (`capture_all`, called by `models.build`);
none is captured inside the generation loop: a forward whose bucket was not captured runs
eagerly, counted. On CPU (the torch backend's ``graph_emulation``) a replay runs the captured
step over the buffers its capture bound (`graphs.EmulatedGraph`).
"""
from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager, nullcontext

import torch

from swafactory.serving.readback import pinned_ids
from swafactory.errors import SpaceError
from swafactory.graphs.sizing import BUCKETS
from swafactory.graphs.state import GraphKey
from swafactory.graphs.replay import capture_step, refill
from swafactory.harness.watch import capture_io, replayed
from swafactory.models.transformers import ATTENTION, register, routing
from swafactory.metadata.batch import ForwardBatch, ForwardMode, ReqForward
from swafactory.serving.speculative import MAX_GRAPH_TOKENS, graph_modes, graph_tokens

__all__ = ["Runner", "NonFinite", "attn_implementation", "graph_modes", "graph_tokens", "BUCKETS"]



class NonFinite(SpaceError):
    """The NaN guard: a forward's logits are not finite (a poisoned, freed or dummy slot was
    read). Only raised with ``run.guards=true``."""


@contextmanager
def attn_implementation(model, name: str):
    """Switch ``model`` (and its sub-configs) to the attention implementation ``name`` inside."""
    old = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield model
    finally:
        model.set_attn_implementation(old)


class Runner:
    """An HF model + the backend its attention runs through.

    writes: the runner writes its K/V (False: a FROZEN_KV draft). swap: a FROZEN_KV draft's
    `serving.FrozenSwap`, which puts the target's frozen view in around each forward and
    capture (sglang's runner does the same). max_context: the
    most keys a request reads (sizes the graph state; None: `init_cuda_graph_state`'s default).
    guards: check every forward's logits for NaN/inf (the NaN guard; the pools are poisoned in
    check mode). tap: a target's `FeatureTap` (the hidden states a feature draft reads).

    After each forward, ``features`` holds its rows' features ([T, F], on the device): the tap's
    (a target), or a feature draft's own output (`drafters.DraftOut.hidden`); else None.
    """

    def __init__(self, name: str, model, backend, *, writes: bool = True, swap=None,
                 guards: bool = True, graphs: bool = False,
                 max_context: int | None = None, tap=None) -> None:
        register()
        self.name, self.model, self.backend = name, model, backend
        self.writes, self.swap, self.guards = writes, swap, guards
        self.tap = tap
        # a feature draft (`drafters`) says so; imports point down, so no isinstance here
        self.reads_features = bool(getattr(model, "reads_features", False))
        self.features: torch.Tensor | None = None
        self.model.set_attn_implementation(ATTENTION)
        self.device = next(model.parameters()).device
        self.forwards = 0
        self.graphs = graphs
        # backend.graph_key(mode, bs, tokens) → (the mode it was captured in, graph, ids, pos,
        # features, outputs)
        self._graphs: dict[GraphKey, tuple] = {}
        self.graph_use = {"captures": 0, "replays": 0, "eager": 0, "uncaptured": 0}
        if graphs:
            # graph buffers sized by what a bucket reads (max_context: the longest request)
            backend.init_cuda_graph_state(BUCKETS[-1], MAX_GRAPH_TOKENS, max_context)

    @torch.no_grad()
    def forward(self, mode: ForwardMode, reqs: Sequence[ReqForward],
                tokens: Sequence[int] | torch.Tensor, positions: Sequence[int],
                req_to_token: torch.Tensor, full_id: str, *, check: bool = True,
                features: torch.Tensor | None = None) -> torch.Tensor:
        """tokens, positions: [T] of the batch's query rows, request by request (tokens may be
        a [T] int64 tensor on the device: an overlap driver's inputs never visit the host).
        features: [T, F] in the model's dtype, on the device (a feature draft's inputs).
        Returns the logits [T, vocab] fp32. check=False leaves the NaN guard to the caller,
        which reads a finite flag back with the tokens instead of syncing here."""
        batch = ForwardBatch.of(mode, reqs, req_to_token, full_id)
        if batch.total_q != len(tokens):
            raise ValueError(f"{self.name} {mode}: {len(tokens)} tokens for {batch.total_q} queries")
        if self.reads_features and (features is None or len(features) != batch.total_q):
            raise ValueError(f"{self.name} {mode}: a feature draft needs features [{batch.total_q}, "
                             f"F], got {None if features is None else tuple(features.shape)}")
        with self._swapped():  # a FROZEN_KV draft: the target's frozen view in, then out
            ids = (tokens.to(self.device).view(1, -1) if isinstance(tokens, torch.Tensor)
                   else pinned_ids(list(tokens), self.device).view(1, -1))
            pos = pinned_ids(list(positions), self.device).view(1, -1)
            bucket = self._bucket(batch)
            graph = None if bucket is None else self._graph(batch, bucket)
            if graph is None:
                self.backend.init_forward_metadata(batch)
                kw = {} if features is None else {"features": features.view(1, len(features), -1)}
                with routing(self.backend, writes=self.writes):
                    out = self.model(input_ids=ids, position_ids=pos, use_cache=False, **kw)
                logits = out.logits[0]
                self.features = self._features_of(out)
                self.graph_use["eager"] += 1
            else:
                logits = self._replay(batch, bucket, graph, ids, pos, features)
        self.forwards += 1
        logits = logits.float()
        if check:  # this read back is a sync point: the guards' deferred checks report first
            self.backend.raise_pending()
        if check and self.guards and not bool(torch.isfinite(logits).all()):
            raise NonFinite(f"{self.name} {mode}: non-finite logits (a poisoned, freed or dummy "
                            "slot was read)")
        return logits

    def _features_of(self, out) -> torch.Tensor | None:
        """[T, F] features of a model call's rows (see the class doc)."""
        if self.reads_features:
            return out.hidden[0]
        return None if self.tap is None else self.tap.take()

    def _bucket(self, batch: ForwardBatch) -> tuple[int, int] | None:
        """(requests, queries per request) of the graph that serves ``batch``, or None (eager)."""
        if not self.graphs or batch.mode == "extend":
            return None
        tokens = graph_tokens(max(r.q_len for r in batch.reqs), batch.needs_mask)
        bs = next((n for n in BUCKETS if n >= batch.batch_size), None)
        if bs is None or tokens > MAX_GRAPH_TOKENS:
            return None
        return bs, tokens

    @torch.no_grad()
    def capture_all(self, modes: Sequence[tuple[ForwardMode, int]] = (("decode", 1),),
                    max_bs: int | None = None) -> int:
        """Capture every bucket of `BUCKETS` (up to the first that holds ``max_bs`` requests;
        None: all) for each (mode, queries per request) at start-up, as an engine does (graph
        state is allocated once, sized by bucket and context); returns how many were captured.
        Buckets captured already are kept."""
        if not self.graphs:
            return 0
        top = next((n for n in BUCKETS if max_bs is not None and n >= max_bs), BUCKETS[-1])
        n = 0
        with self._swapped():  # captured against the frozen view, as forwards run
            for m, t in modes:
                for bs in (b for b in BUCKETS if b <= top):
                    key = self.backend.graph_key(m, bs, t)
                    if key not in self._graphs:
                        self._graphs[key] = (m, *self._capture(m, bs, t))
                        n += 1
        return n

    def _swapped(self):
        """The FROZEN_KV swap around a forward or capture (a no-op for other runners)."""
        return nullcontext() if self.swap is None else self.swap.active()

    def _graph(self, batch: ForwardBatch, bucket: tuple[int, int]) -> tuple | None:
        """The graph captured for ``batch``'s mode and ``bucket`` (its key: `graph_key`), or
        None when none was captured at start-up or its fp8 scales went stale: the forward then
        runs eagerly (an engine re-captures between steps, never inside one)."""
        st = self._graphs.get(self.backend.graph_key(batch.mode, *bucket))
        if st is None or self.backend.graph_stale(*bucket, st[0]) is not None:
            self.graph_use["uncaptured"] += 1
            return None
        return st

    def _replay(self, batch: ForwardBatch, bucket: tuple[int, int], st: tuple,
                ids: torch.Tensor, pos: torch.Tensor,
                features: torch.Tensor | None) -> torch.Tensor:
        """Plan ``batch`` for the captured graph ``st`` (`_graph`), copy the inputs and replay;
        returns the batch's logits rows [T, vocab] (and sets ``features``)."""
        mode, graph, s_ids, s_pos, s_feat, out = st
        rows = batch.total_q
        self.backend.init_forward_metadata_replay(batch, *bucket, captured_mode=mode)
        # padding rows are token 0 at position 0: no request's token (not an earlier batch's)
        for static, new in ((s_ids, ids), (s_pos, pos)):
            refill(static[0], new[0], rows)
        if s_feat is not None:
            refill(s_feat[0], features, rows)
        graph.replay()
        replayed(self.backend)  # the oracle's check of this replay's rows (run.oracle)
        self.graph_use["replays"] += 1
        feats = out.get("features")
        self.features = None if feats is None else feats[0, :rows].clone()
        return out["logits"][0, :rows].clone()  # the static buffers are the next replay's

    def _capture(self, mode: ForwardMode, bs: int, tokens: int) -> tuple:
        ids = torch.zeros(1, bs * tokens, dtype=torch.long, device=self.device)
        pos = torch.zeros_like(ids)
        feat = None
        if self.reads_features:
            width = self.model.feature_width
            feat = torch.zeros(1, bs * tokens, width, device=self.device,
                               dtype=next(self.model.parameters()).dtype)

        def step():  # the whole model call, every layer's attention through the backend
            kw = {} if feat is None else {"features": feat}
            with routing(self.backend, writes=self.writes):
                out = self.model(input_ids=ids, position_ids=pos, use_cache=False, **kw)
            got = {"logits": out.logits}
            if self.reads_features:
                got["features"] = out.hidden
            elif self.tap is not None:
                got["features"] = self.tap.take()[None]
            return got

        self.graph_use["captures"] += 1
        # run.oracle: the step keeps each layer's q, k, v and o in buffers the graph owns, which
        # every replay refills, for the oracle to read after it (`harness.watch`)
        io = capture_io(self.backend) if self.backend.cfg.run.oracle else nullcontext()
        with io:
            graph, out = capture_step(self.backend, bs, tokens, mode, step, self.device)
        return graph, ids, pos, feat, out
