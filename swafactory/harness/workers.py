"""A worker (the target, or a draft) driven forward by forward, with each request's *logical* K/V
history kept beside its pool, so every attention output can be compared with the oracle.

Q, K and V are seeded random tensors: no model weights are needed.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch

from swafactory.backend import AttentionBackend
from swafactory.graphs.sizing import BUCKETS
from swafactory.graphs.replay import GraphedAttention
from swafactory.harness.forward_oracle import ForwardOracle, request_visibility
from swafactory.harness.history import History
from swafactory.harness.kv_check import StaleKV, kv_reads, stale_key
from swafactory.harness.kv_quant import fp8_roundtrip
from swafactory.harness.oracle import masked_attention
from swafactory.metadata.batch import ForwardBatch, ForwardMode, ReqForward
from swafactory.serving.speculative import graph_tokens

__all__ = ["History", "Check", "LayerSpec", "Worker", "oracle_for", "GRAPHED_MODES"]

GRAPHED_MODES = ("decode", "target_verify")
"""The forwards whose attention the harness replays through graphs (``backend.cuda_graph``)."""

_KEEP_BYTES = 1 << 28
"""A forward whose outputs (all layers, fp32) exceed this is checked layer by layer, one sync
each, keeping none: a Gemma 4 prefill chunk's would be gigabytes per harness process."""


@dataclass(frozen=True)
class Check:
    """One compared attention output. ``out`` ([n, Hq, D]) and ``ref`` ([n, Hq, D] fp32) stay on
    the run's device, and only on a check that failed (`Worker.forward`'s ``keep_above``)."""

    layer: int
    group: str
    err: float
    """Max relative error (inf when the output has NaN)."""
    rows: dict[Hashable, slice]
    out: torch.Tensor | None = None
    ref: torch.Tensor | None = None

    @staticmethod
    def relative_error(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        """0-dim fp32 on the device: max |out - ref| / max |ref|, inf when out has NaN."""
        err = (out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)
        return torch.where(torch.isnan(out).any(), torch.full_like(err, float("inf")), err)

    def error(self) -> float:
        return self.err

    def worst_request(self) -> Hashable:
        """The request with the largest error (a kept check only)."""
        if self.out is None:
            return "-"
        errs = {rid: float(torch.nan_to_num((self.out[s].float() - self.ref[s]).abs(), nan=1e30).max())
                for rid, s in self.rows.items() if s.stop > s.start}
        return max(errs, key=errs.get)


@dataclass(frozen=True)
class LayerSpec:
    """What the oracle needs of one layer, stated from the config (not from the backend)."""

    window: int | None
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    softcap: float | None
    history_layer: int
    """Key of the logical history it reads (a FROZEN_KV draft layer reads its bound target layer)."""
    sink: int = 0
    """Keys at positions below it stay visible beside the window (``spec.draft_sink``)."""


def oracle_for(spec: LayerSpec, r: ReqForward, hist: History, q: torch.Tensor,
               sinks: torch.Tensor | None) -> torch.Tensor:
    """The oracle's answer for one request's queries at one layer, from its logical history
    (request by request; `ForwardOracle` answers a whole forward's layers)."""
    start, keys, values = hist.kv_from(spec.history_layer, r.kv_end)
    allowed = request_visibility(spec.window, r, hist.pos, keys.device, spec.sink)
    return masked_attention(q, keys, values, allowed[:, start:], scale=spec.scale,
                            softcap=spec.softcap, sinks=sinks)


class Worker:
    """One runner: its backend (which owns the view and the pool), its layers and histories."""

    def __init__(self, name: str, backend: AttentionBackend, layers: Mapping[int, LayerSpec],
                 histories: dict[Hashable, History], *, writes: bool, q_dtype: torch.dtype,
                 device: str, gen: torch.Generator, sinks: Mapping[int, torch.Tensor],
                 shard=None) -> None:
        self.name, self.backend, self.layers = name, backend, dict(layers)
        self.hist, self.writes, self.q_dtype = histories, writes, q_dtype
        self.device, self.gen = device, gen
        self.sinks = {layer: s.to(device) for layer, s in sinks.items()}  # moved once, not per layer
        self.shard = shard  # a swafactory.parallel.Shard: this rank's heads (None = all heads)
        # steady-state seconds; a variant's first forward (JIT compiles, graph capture, NCCL
        # set-up) goes to `first_use` instead, `on_first_use(label)` announcing it beforehand
        self.plan_s = self.attn_s = self.gather_s = 0.0
        self.first_use: dict[str, float] = {}  # "mode" or "mode graph bs=N q=T" → seconds
        self.on_first_use: Callable[[str], None] | None = None
        # inputs, histories and the oracle live on the run's device: on a GPU, drawing and
        # checking on the host would cost more than the attention being checked
        self.draw_gen = gen if device == "cpu" else torch.Generator(device).manual_seed(
            int(torch.randint(2 ** 62, (1,), generator=gen)))
        self.graphs: dict[tuple[str, int], GraphedAttention] = {}
        # fp8 KV: the largest error of a checked output against attention over the unrounded
        # K/V (0-dim on the device, read once by the report; None without fp8 layers)
        self.kv_quant_err: torch.Tensor | None = None
        self._full: dict[int, tuple] = {}  # layer → this forward's full-head (q, k, v), on device
        self._kv_turn = 0  # which layer of each group the next `kv` check reads (`kv_check`)

    def forward(self, mode: ForwardMode, reqs: Sequence[ReqForward], req_to_token: torch.Tensor,
                full_id: str, *, check: bool, keep_above: float = -1.0,
                kv_check: bool = False) -> list[Check]:
        """Plan once, run every layer; compare with the oracle when ``check``. A check whose
        error is ≤ ``keep_above`` drops its tensors (-1: keep every check's). ``kv_check`` (with
        ``check``): also compare the rows the forward read with the requests' histories
        (`harness.kv_check`), and raise `StaleKV` when one differs while every oracle check of
        the forward is within ``keep_above`` (the oracle's failures are reported first)."""
        if self.writes:
            for r in reqs:
                h = self.hist[r.rid]
                del h.pos[r.prefix_len + r.query_from:]
                h.pos.extend(r.node_positions()[r.query_from:].tolist())
        batch = ForwardBatch.of(mode, reqs, req_to_token, full_id)
        graphed = self._graphed(batch)
        variant = mode if graphed is None else \
            f"{mode} graph bs={graphed.bucket(batch.batch_size)} q={graphed.tokens}"
        first = variant not in self.first_use
        if first and self.on_first_use is not None:
            self.on_first_use(f"{self.name}/{variant}")
        t0 = time.perf_counter()
        plan = None if graphed is not None else self.backend.init_forward_metadata(batch)
        plan_s, gather_s = time.perf_counter() - t0, 0.0
        oracle = ForwardOracle(reqs, self.hist, self.device) if check else None
        # a long forward (a prefill chunk) is checked layer by layer and keeps nothing; a short
        # one (decode, verify, draft steps: most forwards) keeps its outputs and syncs once
        width = sum(s.num_q_heads * s.head_dim for s in self.layers.values())
        per_layer = batch.total_q * width * 4 > _KEEP_BYTES
        timer = _Timer(self.device)
        outs: dict[int, torch.Tensor] = {}
        if graphed is not None:  # plans inside (padded to the graph's bucket)
            inputs = {layer: self._draw(layer, spec, batch.total_q)
                      for layer, spec in self.layers.items()}
            with timer:
                outs = graphed.forward(batch, {l: x[0] for l, x in inputs.items()},
                                       {l: x[1:] for l, x in inputs.items()} if self.writes else None)
            plan = self.backend.plan
        errs: dict[int, torch.Tensor | float] = {}
        kept: dict[int, torch.Tensor] = {}  # layer → output, for the checks that may fail
        for layer, spec in self.layers.items():
            if graphed is None:
                q, k, v = self._draw(layer, spec, batch.total_q)
                with timer:
                    out = self.backend.forward(q, k, v, layer, save_kv=self.writes,
                                               sinks=self._sinks(layer))
            else:
                out = outs[layer]
            if self.shard is not None:
                t0 = time.perf_counter()
                out = _all_gather_heads(out)
                gather_s += time.perf_counter() - t0
            if self.writes:
                self._record(reqs, layer, spec.history_layer, *self._full[layer][1:])
            if check:
                err = Check.relative_error(out, self._reference(oracle, layer))
                errs[layer] = float(err) if per_layer else err
                if self.hist[reqs[0].rid].has_raw(spec.history_layer):  # fp8: the cost, reported
                    qerr = Check.relative_error(out, self._reference(oracle, layer, raw=True))
                    self.kv_quant_err = qerr if self.kv_quant_err is None else \
                        torch.maximum(self.kv_quant_err, qerr)
                if not per_layer or not errs[layer] <= keep_above:
                    kept[layer] = out
            if layer not in kept:
                self._full.pop(layer, None)
        reads = []
        if check and kv_check:  # the rows read against the histories, in the same sync
            reads = kv_reads(plan, self.backend.planned_pool, reqs, self.hist, self.layers,
                             self._kv_turn, None if self.shard is None else self.shard.kv_heads)
            self._kv_turn += 1
        # one sync for a short forward's layers: on a GPU shared by many processes each sync
        # waits its turn
        pending = [e for e in errs.values() if torch.is_tensor(e)] + [x.err for x in reads]
        values = iter(torch.stack(pending).tolist() if pending else [])
        errs = {layer: next(values) if torch.is_tensor(e) else e for layer, e in errs.items()}
        kv_errs = [next(values) for _ in reads]
        if any(not e == 0.0 for e in kv_errs) and all(e <= keep_above for e in errs.values()):
            read = next(x for x, e in zip(reads, kv_errs) if not e == 0.0)
            raise StaleKV(self.name, mode, read.layer, read.group,
                          *stale_key(read, self.backend.planned_pool))
        attn_s = timer.seconds()
        if first:
            self.first_use[variant] = plan_s + attn_s + gather_s
        else:
            self.plan_s += plan_s
            self.attn_s += attn_s
            self.gather_s += gather_s
        if not check:
            return []
        rows = {r.rid: slice(o, o + r.q_len) for r, o in zip(reqs, oracle.row0)}
        checks = []
        for layer, err in errs.items():
            fails = not err <= keep_above  # a failing check keeps its tensors (recomputed: exact)
            ref = self._reference(oracle, layer) if fails else None
            checks.append(Check(layer, plan.layer_groups[layer], err, rows,
                                kept[layer].to(ref.device) if fails else None, ref))
        self._full.clear()
        return checks

    def _reference(self, oracle: ForwardOracle, layer: int, raw: bool = False) -> torch.Tensor:
        return oracle.reference(self.layers[layer], self._full[layer][0], self.sinks.get(layer),
                                raw=raw)

    def _draw(self, layer: int, spec: LayerSpec, nq: int):
        """Seeded q (and k, v when writing) of one layer; returns this runner's head shard of
        each on the device. Every rank draws the full-head tensors (same seed) and keeps its
        heads, so the gathered output is checked against the single-process oracle."""
        g = self.draw_gen
        q = torch.randn(nq, spec.num_q_heads, spec.head_dim, generator=g, device=g.device).to(self.q_dtype)
        k = v = None
        if self.writes:
            k = torch.randn(nq, spec.num_kv_heads, spec.head_dim, generator=g, device=g.device).to(self.q_dtype)
            v = torch.randn(nq, spec.num_kv_heads, spec.head_dim, generator=g, device=g.device).to(self.q_dtype)
        self._full[layer] = (q, k, v)
        qs = slice(None) if self.shard is None else self.shard.q_heads(spec.num_q_heads)
        ks = slice(None) if self.shard is None else self.shard.kv_heads(spec.num_kv_heads)
        dev = lambda x, s: None if x is None else x[:, s].contiguous().to(self.device)  # noqa: E731
        return dev(q, qs), dev(k, ks), dev(v, ks)

    def _sinks(self, layer: int) -> torch.Tensor | None:
        sinks = self.sinks.get(layer)
        if sinks is None:
            return None
        qs = slice(None) if self.shard is None else self.shard.q_heads(sinks.numel())
        return sinks[qs].to(self.device)

    def _graphed(self, batch: ForwardBatch) -> GraphedAttention | None:
        """The CUDA graph for this forward, when the config asks for graphs and its bucket ×
        mode was captured at start-up (`capture_all`); None: the forward runs eagerly."""
        if not self.backend.cfg.backend.cuda_graph or batch.mode not in GRAPHED_MODES:
            return None
        tokens = graph_tokens(max(r.q_len for r in batch.reqs), batch.needs_mask)
        key = self.backend.graph_key(batch.mode, 0, tokens)  # the engine runner's keying
        g = self.graphs.get((key.mode, key.tokens))
        if g is None or not g.captured(g.bucket_or_none(batch.batch_size)):
            return None
        return g

    def capture_all(self, modes: Sequence[tuple[ForwardMode, int]],
                    max_bs: int | None = None) -> int:
        """Capture at start-up every bucket (up to the one that holds ``max_bs`` requests) of
        each (mode, queries per request) the harness replays through graphs (decode and target
        verify; `speculative.graph_modes` lists what a runner meets); returns how many were
        captured (0 without ``backend.cuda_graph``)."""
        if not self.backend.cfg.backend.cuda_graph:
            return 0
        top = next((n for n in BUCKETS if max_bs is not None and n >= max_bs), BUCKETS[-1])
        n = 0
        for mode, tokens in modes:
            if mode not in GRAPHED_MODES:
                continue
            key = self.backend.graph_key(mode, 0, tokens)
            g = self.graphs.get((key.mode, key.tokens))
            if g is None:
                shapes = {}
                for layer, spec in self.layers.items():
                    hq = spec.num_q_heads // (1 if self.shard is None else self.shard.tp)
                    shapes[layer] = (hq, spec.head_dim)
                g = self.graphs[(key.mode, key.tokens)] = GraphedAttention(
                    self.backend, shapes, tokens=tokens, dtype=self.q_dtype, mode=mode,
                    buckets=[b for b in BUCKETS if b <= top],
                    sinks={layer: self._sinks(layer) for layer in self.layers
                           if layer in self.sinks})
            q, kv = {}, {}
            for layer, (hq, d) in g.layers.items():
                q[layer] = torch.zeros(1, hq, d, dtype=self.q_dtype, device=self.device)
                if self.writes:
                    spec = self.layers[layer]
                    hkv = spec.num_kv_heads // (1 if self.shard is None else self.shard.tp)
                    k = torch.zeros(1, max(hkv, 1), d, dtype=self.q_dtype, device=self.device)
                    kv[layer] = (k, k)
            n += g.capture_all(q, kv if self.writes else None)
        return n

    def _record(self, reqs: Sequence[ReqForward], layer: int, hist_layer: int, k: torch.Tensor,
                v: torch.Tensor) -> None:
        """This forward's written K/V ([total_q, Hkv, D]) of runner layer ``layer`` into each
        request's history; an fp8 layer records what its pool holds, and the values beside."""
        raw = None
        pool = self.backend.view.active_pool
        dtype = pool.sub_pool(layer).dtype
        if dtype == torch.float8_e4m3fn:
            k_scale, v_scale = pool.kv_scales(layer)
            raw = (k, v)
            k, v = fp8_roundtrip(k, k_scale, dtype), fp8_roundtrip(v, v_scale, dtype)
        row = 0
        for r in reqs:
            rows = slice(row, row + r.q_len)
            self.hist[r.rid].record(hist_layer, r.prefix_len + r.query_from, k[rows], v[rows],
                                    raw=None if raw is None else (raw[0][rows], raw[1][rows]))
            row += r.q_len


class _Timer:
    """Attention time of one forward, over the intervals it is entered for: CUDA events on a GPU
    (read after the forward's sync, so timing adds none), the host clock on CPU."""

    def __init__(self, device: str) -> None:
        self.cuda = device != "cpu"
        self.marks: list = []

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def __enter__(self) -> None:
        self.marks.append(self._mark())

    def __exit__(self, *exc) -> None:
        self.marks.append(self._mark())

    def seconds(self) -> float:
        pairs = zip(self.marks[::2], self.marks[1::2])
        if not self.cuda:
            return sum(b - a for a, b in pairs)
        if self.marks:
            self.marks[-1].synchronize()
        return sum(a.elapsed_time(b) for a, b in pairs) / 1e3


def _all_gather_heads(out: torch.Tensor) -> torch.Tensor:
    """[n, H/tp, D] on each rank → [n, H, D] everywhere (ranks hold consecutive head shards)."""
    import torch.distributed as dist

    parts = [torch.empty_like(out) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, out.contiguous())
    return torch.cat(parts, dim=1)
