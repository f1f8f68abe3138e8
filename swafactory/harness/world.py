"""A small world for tests: a target's real pools, allocator and built backend, driven forward by
forward through a `Worker`, whose logical histories feed the oracle."""
from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from swafactory.backend import AttentionBackend, build_backend
from swafactory.config.schema import SwaFactoryConfig
from swafactory.harness.kv_quant import set_harness_scales
from swafactory.harness.workers import Check, History, LayerSpec, Worker, oracle_for
from swafactory.kvcache.factory import build_pools, compute_dtype, torch_dtype
from swafactory.kvcache.pool import ReqToToken
from swafactory.kvcache.requests import RequestSlots
from swafactory.metadata.batch import ForwardMode, ReqForward

__all__ = ["World", "Check", "oracle_for", "target_layer_specs"]


def target_layer_specs(cfg: SwaFactoryConfig, windows_from: dict[int, int | None] | None = None
                       ) -> dict[int, LayerSpec]:
    """The oracle's view of every target layer, from the model config alone."""
    m = cfg.model
    out = {}
    for i, t in enumerate(m.layer_types):
        geo = m.geometry(i)
        w = m.sliding_window if t == "sliding_attention" else None
        out[i] = LayerSpec(w, m.num_attention_heads, geo.num_kv_heads, geo.head_dim,
                           m.softmax_scale or geo.head_dim ** -0.5, m.logit_softcap, i)
    return out


class World:
    """Target pools + allocator + backend for ``cfg``, with logical histories."""

    def __init__(self, cfg: SwaFactoryConfig, *, size_full: int, size_swa: int,
                 max_requests: int = 16, max_context: int = 4096, check_mode: bool = True,
                 seed: int = 0, device: str = "cpu", backend: AttentionBackend | None = None) -> None:
        self.cfg, self.device = cfg, device
        self.gen = torch.Generator().manual_seed(seed)
        self.pool, self.alloc = build_pools(cfg, size_full, size_swa, device, check_mode)
        set_harness_scales(self.pool)  # fp8 KV: per-layer scales, as a calibrated checkpoint has
        if cfg.workload.page_order == "shuffled":
            self.alloc.shuffle(self.gen)  # random page permutations
        self.slots = RequestSlots(self.alloc, ReqToToken(max_requests, max_context, device))
        self.backend = backend or build_backend(cfg, pools=self.pool)
        self.hist: dict[Hashable, History] = {}
        self.specs = target_layer_specs(cfg)
        m = cfg.model
        self.sinks = {i: torch.randn(m.num_attention_heads, generator=self.gen) * 2
                      for i in range(m.num_layers)} if m.attention_sinks else {}
        kv = cfg.backend.kv_dtype
        self.q_dtype = compute_dtype(kv)
        self._workers: dict[tuple, Worker] = {}

    def open(self, rid: Hashable) -> None:
        """Start a request with no tokens."""
        self.slots.open(rid)
        self.hist[rid] = History()

    def kv_len(self, rid: Hashable) -> int:
        """Allocated positions of ``rid``."""
        return self.slots.reqs[rid].kv_len

    def req(self, rid: Hashable, prefix_len: int, nodes: int, **kw) -> ReqForward:
        """A `ReqForward` for ``rid`` (its ReqToToken row filled in)."""
        return ReqForward(rid, self.slots.reqs[rid].row, prefix_len, nodes, **kw)

    def forward(self, mode: ForwardMode, reqs: Sequence[ReqForward],
                layers: Sequence[int], *, kv_tolerance: float | None = None) -> list[Check]:
        """Allocate the nodes not yet allocated, run ``layers`` and return their checks.
        ``kv_tolerance``: also run the `kv` check (`harness.kv_check`), which raises `StaleKV`
        when every oracle check is within this tolerance but a row read differs."""
        for r in reqs:
            need = r.prefix_len + r.nodes - self.kv_len(r.rid)
            if need > 0:  # raises CapacityError (pool, ask, free) when the pools are full
                self.slots.extend(r.rid, need)
        key = tuple(layers)
        worker = self._workers.get(key)
        if worker is None or worker.backend is not self.backend:  # a test may swap the backend
            # one per layer set and backend: its kv-check turn carries on from forward to forward
            worker = self._workers[key] = Worker(
                "target", self.backend, {i: self.specs[i] for i in key}, self.hist, writes=True,
                q_dtype=self.q_dtype, device=self.device, gen=self.gen, sinks=self.sinks)
        return worker.forward(mode, reqs, self.slots.req_to_token.table, self.alloc.full_id,
                              check=True, keep_above=-1.0 if kv_tolerance is None else kv_tolerance,
                              kv_check=kv_tolerance is not None)
