"""The oracle watching any runner: the conformance run's check (each request's logical K/V
history, an fp32 reference from it), on the attention rows of an engine that runs a real model.

`AttentionWatch.watch` wraps four methods of one runner's backend *on the instance* (the class
and the engine's code stay as they are):

* ``init_forward_metadata(batch)``, ``init_forward_metadata_replay(batch, bs, tokens, …)``
  open a pass: its mode and requests; a writer's histories take the nodes' positions; the pass
  is sampled (the first of each runner × mode × eager/replay always, then ``rate`` of them);
* ``forward(q, k, v, layer, save_kv=, sinks=)``: in an eager pass each layer's written K/V
  ([total_q, Hkv, D]) goes into every request's `History` at its slots, then, when sampled, its
  output rows ([total_q, Hq, D]) are compared with `ForwardOracle` over those histories (window,
  tree, DFlash block, prefix-only queries, scale, soft-cap and the sinks the model passed);
* ``init_forward_metadata_capture(bs, tokens, mode)``: the forwards that follow (a CUDA
  capture's warm-up and capture, or an emulated capture) keep each layer's ``(q, k, v, o,
  sinks)`` in `graph_io` under the graph's key ``(mode, bs, tokens)``, as copies made inside
  the step: captured, each copy is a buffer of the graph's own, at a fixed address, that every
  replay refills. A replay pass is recorded and checked from them (`replayed`, else at the next
  plan, commit or finish, before anything can replay over them); on CPU an emulated replay calls
  `forward` again, which refreshes the entries: the same path.

Commits follow the pools (`commit`: an accepted tree path moved into place, rejected nodes
dropped), finished requests are forgotten (`finish`). A FROZEN_KV draft writes nothing and reads
the target's histories through its bound layers (its `LayerSpec.history_layer`). A sampled row
beyond the tolerance raises `OracleMismatch` (runner, mode, layer, request, position, error).
"""
from __future__ import annotations

import random
import weakref
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from swafactory.harness.forward_oracle import ForwardOracle
from swafactory.harness.history import History
from swafactory.harness.kv_quant import fp8_roundtrip
from swafactory.harness.workers import Check, LayerSpec
from swafactory.metadata.batch import ForwardBatch, ReqForward

__all__ = ["AttentionWatch", "OracleMismatch", "graph_io", "register_capture", "capture_io",
           "replayed"]

LayerIO = tuple
"""One layer's ``(q, k, v, o, sinks)`` of a captured step: q, o [bs·tokens, Hq, D]; k, v
[bs·tokens, Hkv, D] or None (a runner that writes none); sinks [Hq] fp32 or None."""

_GRAPH_IO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # backend → key → layer → io
_WATCHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # backend → its watch


def graph_io(backend) -> dict[tuple, dict[int, LayerIO]]:
    """``(mode, bs, tokens) → layer → (q, k, v, o, sinks)`` registered for ``backend``'s graphs."""
    return _GRAPH_IO.setdefault(backend, {})


def _kept(q, k, v, o, sinks, save_kv: bool) -> LayerIO:
    """A graph step's layer tensors as copies made inside the step: captured, each copy is a
    buffer of the graph's own that every replay refills, whatever the kernel reuses (an output
    workspace shared by layers, a q the next layer overwrites)."""
    kv = (k.clone(), v.clone()) if save_kv else (None, None)
    return (q.clone(), *kv, o.clone(), sinks)


def register_capture(backend, key: Sequence, layers: Mapping[int, LayerIO]) -> None:
    """At capture time: the tensors graph ``key`` = ``(mode, bs, tokens)`` computes each layer
    with (``layers``: layer → ``(q, k, v, o, sinks)``): buffers the graph itself writes, one per
    layer (no two layers' alike), that hold each replay's values after it."""
    graph_io(backend)[tuple(key)] = dict(layers)


@contextmanager
def capture_io(backend):
    """Around a graph capture made before a watch is attached (the engine's start-up capture):
    each ``init_forward_metadata_capture`` inside names a key, and the ``forward`` calls after
    it register copies of their layer's tensors under it (`register_capture`): the captured step
    copies every layer's q, k, v and o once more. Use it only with the oracle on."""
    store = graph_io(backend)
    key: list[tuple] = []
    plan0, fwd0 = backend.init_forward_metadata_capture, backend.forward

    def plan(bs, tokens, mode, *a, **kw):
        out = plan0(bs, tokens, mode, *a, **kw)
        key[:] = [(mode, bs, tokens)]
        store[key[0]] = {}
        return out

    def forward(q, k, v, layer_id, batch=None, save_kv=True, sinks=None):
        o = fwd0(q, k, v, layer_id, batch=batch, save_kv=save_kv, sinks=sinks)
        if key:
            store[key[0]][layer_id] = _kept(q, k, v, o, sinks, save_kv)
        return o

    backend.init_forward_metadata_capture, backend.forward = plan, forward
    try:
        yield store
    finally:
        for name, old in (("init_forward_metadata_capture", plan0), ("forward", fwd0)):
            if getattr(old, "__self__", None) is backend:  # the class's: drop the instance's
                backend.__dict__.pop(name, None)
            else:
                setattr(backend, name, old)


def replayed(backend) -> None:
    """Right after ``graph.replay()`` of ``backend``'s graph: record and check that replay from
    the registered tensors now (a no-op when no watch is attached: the oracle is off)."""
    watch = _WATCHES.get(backend)
    if watch is not None:
        watch.settle()


class OracleMismatch(RuntimeError):
    """A watched attention output is beyond the tolerance (the harness's `Mismatched`, with the
    request and position of the worst row)."""

    def __init__(self, runner: str, mode: str, check: Check, error: float, *, request: Hashable,
                 position: int, tolerance: float, replay: bool) -> None:
        self.worker, self.mode, self.check, self.error = runner, mode, check, error
        self.request, self.position, self.tolerance = request, position, tolerance
        how = " (graph replay)" if replay else ""
        super().__init__(f"oracle: {runner} {mode}{how} layer {check.layer} ({check.group}) "
                         f"request {request} position {position}: rel err {error:.3g} > "
                         f"tolerance {tolerance:g}")


@dataclass
class _Pass:
    mode: str
    reqs: tuple[ReqForward, ...]
    nq: int
    check: bool
    key: tuple | None = None
    """A replay's graph key (None: eager); ``capture``: a capture's."""
    capture: tuple | None = None
    pending: bool = False
    """A replay not yet recorded from `graph_io`."""
    oracle: ForwardOracle | None = None


@dataclass
class _Watched:
    name: str
    backend: object
    layers: dict[int, LayerSpec]
    hist: dict[Hashable, History]
    writes: bool
    role: str
    device: torch.device
    now: _Pass | None = None
    off: str | None = None
    """Why this runner is no longer checked (a replay with no registered tensors)."""


@dataclass
class AttentionWatch:
    """Watches runners' backends; ``tolerance``: max relative error of a row (the harness's
    `tolerance_for`); ``rate``: the fraction of later passes checked; ``seed``: their draw."""

    tolerance: float
    rate: float = 1.0
    seed: int = 0
    forwards: Counter = field(default_factory=Counter)
    """(runner, mode, ``eager``/``replay``) → passes checked."""
    passes: Counter = field(default_factory=Counter)
    """The same keys → passes seen."""
    layer_checks: Counter = field(default_factory=Counter)
    """The same keys → layer outputs compared."""
    max_err: dict = field(default_factory=dict)
    """The same keys → largest relative error seen."""
    off: dict = field(default_factory=dict)
    """runner → why it stopped being checked."""

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._runners: list[_Watched] = []
        self._pending: list[tuple] = []  # (runner, pass, layer, spec, [n] row errors)

    def watch(self, name: str, backend, layers: Mapping[int, LayerSpec],
              histories: dict[Hashable, History], *, writes: bool, role: str) -> None:
        """Watch ``backend`` as runner ``name``. layers: backend layer id → its oracle spec;
        histories: request → `History` (shared with the target's for a FROZEN_KV reader);
        role: ``target`` (its histories follow moved tree paths), ``draft`` (its own pool: a
        draft extend rewrites the accepted tokens) or ``reader`` (writes none)."""
        dev = backend.view.active_pool.sub_pools[0].device
        w = _Watched(name, backend, dict(layers), histories, writes, role, torch.device(dev))
        self._runners.append(w)
        _WATCHES[backend] = self
        plan, replay = backend.init_forward_metadata, backend.init_forward_metadata_replay
        capture, fwd = backend.init_forward_metadata_capture, backend.forward

        def init_forward_metadata(batch: ForwardBatch, *a, **kw):
            self.settle()
            out = plan(batch, *a, **kw)
            self._open(w, batch, None)
            return out

        def init_forward_metadata_replay(batch: ForwardBatch, bs: int, tokens: int, *a, **kw):
            self.settle()
            out = replay(batch, bs, tokens, *a, **kw)
            mode = kw.get("captured_mode", a[0] if a else None) or batch.mode
            self._open(w, batch, (mode, bs, tokens))
            return out

        def init_forward_metadata_capture(bs: int, tokens: int, mode, *a, **kw):
            self.settle()
            out = capture(bs, tokens, mode, *a, **kw)
            graph_io(backend)[(mode, bs, tokens)] = {}
            w.now = _Pass(mode, (), 0, False, capture=(mode, bs, tokens))
            return out

        def forward(q, k, v, layer_id, batch=None, save_kv=True, sinks=None):
            o = fwd(q, k, v, layer_id, batch=batch, save_kv=save_kv, sinks=sinks)
            p = w.now
            if p is None:
                return o
            if p.capture is not None or p.key is not None:  # a graph's step: kept by its key
                io = _kept(q, k, v, o, sinks, save_kv)
                graph_io(backend).setdefault(p.capture or p.key, {})[layer_id] = io
            else:
                self._layer(w, p, layer_id, q, *((k, v) if save_kv else (None, None)), o, sinks)
            return o

        backend.init_forward_metadata = init_forward_metadata
        backend.init_forward_metadata_replay = init_forward_metadata_replay
        backend.init_forward_metadata_capture = init_forward_metadata_capture
        backend.forward = forward

    # ------------------------------------------------------------------ passes
    def _open(self, w: _Watched, batch: ForwardBatch, key: tuple | None) -> None:
        if w.off is not None:
            w.now = None
            return
        variant = (w.name, batch.mode, "eager" if key is None else "replay")
        check = variant not in self.passes or self._rng.random() < self.rate
        self.passes[variant] += 1
        self.forwards[variant] += check
        if w.writes:  # slot order: the nodes' positions replace what followed their prefix
            for r in batch.reqs:
                h = w.hist.setdefault(r.rid, History())
                start = r.prefix_len + r.query_from
                if len(h.pos) < start:
                    raise ValueError(f"oracle: {w.name} {batch.mode} request {r.rid}: its history "
                                     f"holds {len(h.pos)} positions, the forward writes from "
                                     f"{start}: a forward of this runner went unwatched")
                del h.pos[start:]
                h.pos.extend(r.node_positions()[r.query_from:].tolist())
                for spec in w.layers.values():  # no later query sees these (positions ≥ prefix)
                    if spec.window is not None and not spec.sink:  # a sink reads from 0
                        h.drop_before(spec.history_layer, r.prefix_len - spec.window - 1)
        w.now = _Pass(batch.mode, batch.reqs, batch.total_q, check, key=key,
                      pending=key is not None)

    def _layer(self, w: _Watched, p: _Pass, layer: int, q, k, v, o, sinks) -> None:
        """Record one layer's written K/V, then compare its output rows when the pass is checked."""
        spec = w.layers.get(layer)
        if spec is None:
            raise ValueError(f"oracle: {w.name} layer {layer} has no oracle spec (known: "
                             f"{sorted(w.layers)}); watch it with every layer its model attends")
        n = p.nq  # a replay's rows past the batch are padding
        if w.writes and k is not None:
            self._record(w, p, layer, spec.history_layer, k[:n], v[:n])
        if not p.check:
            return
        if p.oracle is None:
            p.oracle = ForwardOracle(p.reqs, w.hist, w.device)
        ref = p.oracle.reference(spec, q[:n], sinks)
        diff = (o[:n].float() - ref).abs().amax(dim=(1, 2))  # [n]: NaN where the row has one
        rows = torch.nan_to_num(diff, nan=float("inf")) / ref.abs().max().clamp_min(1e-6)
        self._pending.append((w, p, layer, spec, rows))
        self.layer_checks[(w.name, p.mode, "eager" if p.key is None else "replay")] += 1
        if w.device.type == "cpu":  # reading back is free: raise inside the forward at fault
            self._evaluate()

    def _record(self, w: _Watched, p: _Pass, layer: int, hist_layer: int, k, v) -> None:
        """[total_q, Hkv, D] K/V into each request's history; an fp8 layer records what its
        pool holds (each value rounded with the layer's scales)."""
        pool = w.backend.planned_pool
        dtype = pool.sub_pool(layer).dtype
        if dtype == torch.float8_e4m3fn:
            k_scale, v_scale = pool.kv_scales(layer)
            k, v = fp8_roundtrip(k, k_scale, dtype), fp8_roundtrip(v, v_scale, dtype)
        row = 0
        for r in p.reqs:
            w.hist[r.rid].record(hist_layer, r.prefix_len + r.query_from, k[row:row + r.q_len],
                                 v[row:row + r.q_len])
            row += r.q_len

    def settle(self) -> None:
        """Record and check every replay not yet done (from `graph_io`), then read back the
        errors of every checked row and raise `OracleMismatch` on the first beyond tolerance."""
        for w in self._runners:
            p = w.now
            if p is None or not p.pending:
                continue
            p.pending = False
            io = graph_io(w.backend).get(p.key)
            if not io:
                self._blind(w, f"a replay of graph {p.key} with no registered tensors (capture "
                               "it inside swafactory.harness.watch.capture_io)")
                continue
            for layer in sorted(io):
                self._layer(w, p, layer, *io[layer])
        self._evaluate()

    def _blind(self, w: _Watched, why: str) -> None:
        """Stop checking ``w`` and every runner reading its histories: they miss a forward."""
        for x in self._runners:
            if x is w or x.hist is w.hist:
                x.off = self.off[x.name] = why
                x.now = None

    def _evaluate(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        values = torch.cat([rows for *_, rows in pending]).tolist()  # one read back
        at = 0
        for w, p, layer, spec, rows in pending:
            errs = values[at:at + rows.numel()]
            at += rows.numel()
            worst = max(range(len(errs)), key=errs.__getitem__)
            variant = (w.name, p.mode, "eager" if p.key is None else "replay")
            self.max_err[variant] = max(self.max_err.get(variant, 0.0), errs[worst])
            if not errs[worst] <= self.tolerance:
                raise self._mismatch(w, p, layer, spec, errs[worst], worst)

    def _mismatch(self, w: _Watched, p: _Pass, layer: int, spec: LayerSpec, err: float,
                  row: int) -> OracleMismatch:
        spans, at = {}, 0
        for r in p.reqs:
            spans[r.rid] = slice(at, at + r.q_len)
            if at <= row < at + r.q_len:
                rid, pos = r.rid, int(r.node_positions()[r.query_from + row - at])
            at += r.q_len
        check = Check(layer, "full" if spec.window is None else "swa", err, spans)
        return OracleMismatch(w.name, p.mode, check, err, request=rid, position=pos,
                              tolerance=self.tolerance, replay=p.key is not None)

    # ------------------------------------------------------------------ following the pools
    def commit(self, rid: Hashable, committed: int, path: Sequence[int]) -> None:
        """After a spec step moved ``rid``'s accepted ``path`` (node ids) to positions
        ``committed…`` and freed the rest (`SpecHooks.on_commit`)."""
        self.settle()
        path = list(path)
        chain = path == list(range(len(path)))
        for w in self._runners:
            if not w.writes or rid not in w.hist:
                continue
            h = w.hist[rid]
            if w.role == "target":
                if not chain:
                    h.reorder_tail(committed, path)
                h.truncate(committed + len(path))
            else:  # a draft extend from `committed` rewrites what a moved path would hold
                h.truncate(committed + len(path) if chain else committed)

    def finish(self, rid: Hashable) -> None:
        """``rid`` finished: its histories go."""
        self.settle()
        for w in self._runners:
            w.hist.pop(rid, None)

    def summary(self) -> dict[str, dict]:
        """``runner mode how`` → passes seen and checked, layer checks, largest error."""
        return {" ".join(k): {"passes": self.passes[k], "checked": self.forwards[k],
                              "layer_checks": self.layer_checks[k],
                              "max_rel_err": self.max_err.get(k, 0.0)} for k in self.passes}
