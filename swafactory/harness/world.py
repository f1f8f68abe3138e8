"""A small world of real pools, a real allocator and a built backend, with each request's *logical*
K/V history kept beside it, so every attention output can be checked against the oracle.

Tests drive it forward by forward; the serving harness drives it step by step. Q, K and V are
seeded random tensors: no model weights are needed.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from swafactory.backend import AttentionBackend, build_backend
from swafactory.config.schema import SwaFactoryConfig
from swafactory.harness.oracle import oracle_attention, tree_visibility
from swafactory.kvcache.factory import build_pools, torch_dtype
from swafactory.kvcache.pool import ReqToToken
from swafactory.kvcache.requests import RequestSlots
from swafactory.metadata.batch import ForwardBatch, ForwardMode, ReqForward

__all__ = ["World", "Check", "oracle_for"]


@dataclass
class _History:
    """One request's tokens in slot order: position, and K/V per layer."""

    pos: list[int] = field(default_factory=list)
    k: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    v: dict[int, list[torch.Tensor]] = field(default_factory=dict)


@dataclass(frozen=True)
class Check:
    """One compared attention output."""

    layer: int
    group: str
    out: torch.Tensor
    ref: torch.Tensor
    rows: dict[Hashable, slice]

    def error(self) -> float:
        """Max relative error (inf when the output has NaN)."""
        if torch.isnan(self.out).any():
            return float("inf")
        return float((self.out.float() - self.ref).abs().max() / self.ref.abs().max().clamp_min(1e-6))


def oracle_for(model, layer: int, r: ReqForward, hist: _History, q: torch.Tensor,
               sinks: torch.Tensor | None, scale: float) -> torch.Tensor:
    """The oracle's answer for one request's queries at one layer, from its logical history."""
    n = r.prefix_len + r.nodes
    keys = torch.stack(hist.k[layer][:n])
    values = torch.stack(hist.v[layer][:n])
    k_pos = torch.tensor(hist.pos[:n])
    q_pos = k_pos[r.prefix_len + r.query_from:]
    if r.parents is not None:
        structure = tree_visibility(r.prefix_len, list(r.parents))
    elif r.block:
        structure = torch.ones(r.nodes, n, dtype=torch.bool)
    else:  # committed history and a chain: causal by position
        structure = k_pos[None, :] <= k_pos[r.prefix_len:, None]
    structure = structure[r.query_from:]
    window = model.sliding_window if model.layer_types[layer] == "sliding_attention" else None
    return oracle_attention(q, keys, values, q_pos, k_pos, structure, window=window, scale=scale,
                            softcap=model.logit_softcap, sinks=sinks)


class World:
    """Target pools + allocator + backend for ``cfg``, with logical histories."""

    def __init__(self, cfg: SwaFactoryConfig, *, size_full: int, size_swa: int,
                 max_requests: int = 16, max_context: int = 4096, check_mode: bool = True,
                 seed: int = 0, device: str = "cpu", backend: AttentionBackend | None = None) -> None:
        self.cfg, self.device = cfg, device
        self.gen = torch.Generator().manual_seed(seed)
        self.pool, self.alloc = build_pools(cfg, size_full, size_swa, device, check_mode)
        self.alloc.shuffle(self.gen)  # random page permutations
        self.slots = RequestSlots(self.alloc, ReqToToken(max_requests, max_context, device))
        self.backend = backend or build_backend(cfg, pools=self.pool)
        self.hist: dict[Hashable, _History] = {}
        m = cfg.model
        self.sinks = {i: torch.randn(m.num_attention_heads, generator=self.gen) * 2
                      for i in range(m.num_layers)} if m.attention_sinks else {}
        self.q_dtype = torch_dtype(cfg.backend.kv_dtype) if cfg.backend.kv_dtype != "fp8_e4m3" \
            else torch.bfloat16

    def open(self, rid: Hashable) -> None:
        """Start a request with no tokens."""
        self.slots.open(rid)
        self.hist[rid] = _History()

    def kv_len(self, rid: Hashable) -> int:
        """Allocated positions of ``rid``."""
        return self.slots.reqs[rid].kv_len

    def req(self, rid: Hashable, prefix_len: int, nodes: int, **kw) -> ReqForward:
        """A `ReqForward` for ``rid`` (its ReqToToken row filled in)."""
        return ReqForward(rid, self.slots.reqs[rid].row, prefix_len, nodes, **kw)

    def forward(self, mode: ForwardMode, reqs: Sequence[ReqForward],
                layers: Sequence[int]) -> list[Check]:
        """Allocate the nodes not yet allocated, run ``layers`` and return their checks."""
        m = self.cfg.model
        for r in reqs:
            need = r.prefix_len + r.nodes - self.kv_len(r.rid)
            if need > 0 and self.slots.extend(r.rid, need) is None:
                raise RuntimeError(f"pools are full: request {r.rid!r} needs {need} slots")
            h = self.hist[r.rid]
            del h.pos[r.prefix_len + r.query_from:]
            h.pos.extend((r.node_positions()[r.query_from:]).tolist())
        batch = ForwardBatch.of(mode, reqs, self.slots.req_to_token.table, self.alloc.full_id)
        plan = self.backend.init_forward_metadata(batch)
        checks = []
        for layer in layers:
            geo = m.geometry(layer)
            nq = batch.total_q
            q = torch.randn(nq, m.num_attention_heads, geo.head_dim, generator=self.gen)
            k = torch.randn(nq, geo.num_kv_heads, geo.head_dim, generator=self.gen)
            v = torch.randn(nq, geo.num_kv_heads, geo.head_dim, generator=self.gen)
            q, k, v = (t.to(self.q_dtype) for t in (q, k, v))
            sinks = self.sinks.get(layer)
            out = self.backend.forward(q.to(self.device), k.to(self.device), v.to(self.device),
                                       layer, sinks=sinks)
            refs, rows, row = [], {}, 0
            for r in reqs:
                h = self.hist[r.rid]
                keep = r.prefix_len + r.query_from
                for store, new in ((h.k, k), (h.v, v)):
                    lst = store.setdefault(layer, [])
                    del lst[keep:]
                    lst.extend(new[row:row + r.q_len].float().unbind(0))
                scale = self.backend.scales[layer]
                refs.append(oracle_for(m, layer, r, h, q[row:row + r.q_len].float(), sinks, scale))
                rows[r.rid] = slice(row, row + r.q_len)
                row += r.q_len
            checks.append(Check(layer, plan.layer_groups[layer], out.cpu(), torch.cat(refs), rows))
        return checks
