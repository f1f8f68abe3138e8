"""A production-size soak of the embedding contract: Gemma 4's geometry over pools of millions of
rows, long contexts, fp8 K/V, every decode bucket captured at start-up, a host that runs ahead,
requests that come and go, and every step of a sample of requests checked against an fp32
oracle from their logical K/V history.

    python bench/soak.py --out DIR [--steps 2000] [--bs 32] [--context 65536] [--layers 6]
        [--override backend.groups.full=triton ...]

What one step does, as an overlap scheduler's host would: allocate each running request's next
slot (the allocator's host books), evict SWA pages out of the window, plan the step for its
captured bucket (`init_forward_metadata_replay`: nothing read back), fill the static q/k/v
inputs on the device, replay, and queue the oracle's comparison of the checked requests' rows
(on the device: mismatches accumulate into a counter). Nothing is read back per step: the
counter comes back through a non-blocking copy and an event, one step late. A request that
reaches its length finishes (its slots freed) and a new one takes its place a few steps later,
its prefix written in 8K-token chunks with eviction between them (so buckets see padding).

At the end every request finishes and the books must balance: `RequestSlots.leaks()` all zero.
Writes ``DIR/soak.json`` and prints one line per figure; exit status 1 on any mismatch or leak.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import swafactory  # noqa: E402
from swafactory.kvcache.factory import build_pools  # noqa: E402
from swafactory.kvcache.pool import ReqToToken  # noqa: E402
from swafactory.kvcache.quant import quantize, store_rows  # noqa: E402
from swafactory.kvcache.requests import RequestSlots  # noqa: E402
from swafactory.metadata.batch import ForwardBatch, ReqForward  # noqa: E402

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
CHUNK = 8192
TOL = 2e-2
"""Relative error of a checked row against the oracle (fp8 K/V dequantized on both sides; bf16
q and output): bf16 rounding sits near 4e-3, a wrong key or slot near 1."""


class Soak:
    def __init__(self, a) -> None:
        self.a = a
        self.dev = dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run, eager
        over = ["backend=" + a.backend, "spec=none", "model=gemma4", "workload=smoke",
                f"workload.device={dev}",
                f"model.num_layers={a.layers}", "backend.kv_dtype=fp8_e4m3", *a.override]
        self.cfg = cfg = swafactory.validate(swafactory.compose(over))
        self.W = cfg.model.sliding_window
        per = a.context + a.max_len + 64
        size_full = (a.bs + 2) * per
        size_swa = (a.bs + 2) * (self.W + 256) + CHUNK + 4096
        self.pool, self.alloc = build_pools(cfg, size_full, size_swa, dev)
        self.slots = RequestSlots(self.alloc, ReqToToken(a.bs + 2, per, dev))
        self.layers = sorted(self.pool.layers_mapping)
        for i, lay in enumerate(self.layers):  # scales set before capture, as an engine loads them
            self.pool.set_kv_scales(lay, 0.5 + 0.1 * i, 0.25 + 0.05 * i)
        self.be = swafactory.build_backend(cfg, pools=self.pool, guards=a.guards)
        self.hq = self.be.q_heads
        self.geo = {lay: (self.pool.sub_pool(lay).num_kv_heads, self.pool.sub_pool(lay).head_dim)
                    for lay in self.layers}
        self.gen = torch.Generator(device=dev).manual_seed(a.seed)
        self.host_rng = torch.Generator().manual_seed(a.seed)
        self.hist: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.length: dict[int, int] = {}  # rid → committed tokens
        self.target: dict[int, int] = {}  # rid → the length at which it finishes
        self.next_rid = 0
        self.bad = torch.zeros((), dtype=torch.int64, device=dev)
        self.worst = torch.zeros((), dtype=torch.float32, device=dev)
        self.checked = 0
        # the attention runs on its own stream, as an overlap scheduler's forward does: the
        # allocator's host books (which read back on the default stream) never wait for it
        self.fwd = torch.cuda.Stream() if dev == "cuda" else None
        self.dying: list[tuple[int, int]] = []  # (rid, last step that read it): freed later
        self.steps = 0
        self._pinned = torch.zeros(1, dtype=torch.int64, pin_memory=dev == "cuda")

    # --- requests ---------------------------------------------------------------------------------

    def _rand(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, device=self.dev, generator=self.gen)

    def _write(self, rid: int, slots: torch.Tensor, start: int) -> None:
        """Random K/V for positions ``start…`` at ``slots`` (the engine's prefill, by hand)."""
        n = slots.numel()
        for lay in self.layers:
            hkv, d = self.geo[lay]
            k, v = self._rand(n, hkv, d), self._rand(n, hkv, d)
            self._store(rid, lay, slots, start, k, v)

    def _store(self, rid, lay, slots, start, k, v) -> None:
        k_buf, v_buf, sub = self.pool.get_kv(lay)
        ks, vs = self.pool.kv_scales(lay)
        rows = self.alloc.full_to_swa[slots] if sub.space == "swa" else slots
        store_rows(k_buf, rows, k, ks)
        store_rows(v_buf, rows, v, vs)
        h = self.hist.get(rid)
        if h is not None:  # the logical history: the same quantized values, by position
            hk, hv = h[lay]
            hk[start:start + k.shape[0]] = quantize(k, ks, k_buf.dtype)
            hv[start:start + v.shape[0]] = quantize(v, vs, v_buf.dtype)

    def open(self) -> None:
        a, rid = self.a, self.next_rid
        self.next_rid += 1
        self.slots.open(rid)
        L = a.context - int(torch.randint(0, a.context // 8, (1,), generator=self.host_rng))
        if rid % a.check_every == 0:
            cap = L + a.max_len + 8
            self.hist[rid] = {lay: tuple(torch.empty(cap, *self.geo[lay], device=self.dev,
                                                     dtype=self.pool.sub_pool(lay).dtype)
                                         for _ in range(2)) for lay in self.layers}
        for s in range(0, L, CHUNK):  # chunked, evicting between chunks as a server does
            n = min(CHUNK, L - s)
            self._write(rid, self.slots.extend(rid, n).tensor, s)
            self.slots.evict_out_of_window(rid, s + n, self.W)
        self.length[rid] = L
        self.target[rid] = L + int(torch.randint(a.min_len, a.max_len, (1,),
                                                 generator=self.host_rng))

    def retire(self, rid: int) -> None:
        """Leave the batch now; the slots are freed once the last step that read them has run
        (`free_done`): a page freed earlier could be refilled under a running step."""
        del self.length[rid], self.target[rid]
        self.dying.append((rid, self.steps - 1))

    def free_done(self, done_step: int) -> None:
        """Free the requests whose last step is ``<= done_step`` (known to have run)."""
        keep = []
        for rid, last in self.dying:
            if last <= done_step:
                self.slots.finish(rid)
                self.hist.pop(rid, None)
            else:
                keep.append((rid, last))
        self.dying = keep

    # --- graphs -----------------------------------------------------------------------------------

    def capture(self) -> dict:
        a, be = self.a, self.be
        t0 = time.perf_counter()
        top = BUCKETS[-1]
        self.inp = {lay: tuple(torch.zeros(top, *shape, device=self.dev, dtype=torch.bfloat16)
                               for shape in ((self.hq, self.geo[lay][1]), self.geo[lay],
                                             self.geo[lay]))
                    for lay in self.layers}
        self.out: dict[int, dict[int, torch.Tensor]] = {}
        self.graphs = None
        if self.dev != "cuda":  # the dry run: eager forwards
            return {"capture_s": 0.0, "buckets": [], "graph_state_bytes": None}
        try:
            be.init_cuda_graph_state(BUCKETS[-1], 1, max_context=a.context + a.max_len + 64)
        except TypeError:  # a backend without the context bound
            be.init_cuda_graph_state(BUCKETS[-1], 1)
        self.graphs = {}
        pool = torch.cuda.graph_pool_handle()
        for bs in BUCKETS:
            be.init_forward_metadata_capture(bs, 1, "decode")
            outs = {}

            def step():
                for lay in self.layers:
                    q, k, v = self.inp[lay]
                    outs[lay] = be.forward(q[:bs], k[:bs], v[:bs], lay)

            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                step()  # warm-up: JIT, wrapper set-up
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                step()
            self.graphs[bs], self.out[bs] = g, dict(outs)
        torch.cuda.synchronize()
        state = getattr(be, "graph_state_bytes", None)
        return {"capture_s": time.perf_counter() - t0, "buckets": list(BUCKETS),
                "graph_state_bytes": state() if callable(state) else None}

    # --- one step ---------------------------------------------------------------------------------

    def step(self):
        """Plan and launch one step; returns the event behind it (None off CUDA)."""
        rids = sorted(self.length)
        bs = len(rids)
        bucket = next(b for b in BUCKETS if b >= bs)
        new = self.slots.decode(rids).tensor  # [bs] full slots of this step's positions
        reqs = []
        for r in rids:  # one step behind: the step before this one may still read its window
            self.slots.evict_out_of_window(r, max(self.length[r] - 1, 0), self.W, interval=4)
            reqs.append(ReqForward(r, self.slots.reqs[r].row, self.length[r], 1))
        batch = ForwardBatch.of("decode", reqs, self.slots.req_to_token.table,
                                self.alloc.full_id)
        if self.fwd is None:
            self._launch(batch, rids, bs, bucket)
            ev = None
        else:
            self.fwd.wait_stream(torch.cuda.current_stream())  # the books' writes, the fills
            with torch.cuda.stream(self.fwd):
                self._launch(batch, rids, bs, bucket)
                self._pinned.copy_(self.bad.view(1), non_blocking=True)  # read one step late
                ev = torch.cuda.Event()
                ev.record()
        for r in rids:
            self.length[r] += 1
        self.steps += 1
        del new
        return ev

    def _launch(self, batch, rids, bs: int, bucket: int) -> None:
        """Inputs, plan, kernels (a replay) and the oracle's comparisons of one step."""
        for lay in self.layers:  # this step's inputs, on the device
            q, k, v = self.inp[lay]
            q[:bs].copy_(self._rand(bs, self.hq, self.geo[lay][1]) * self.geo[lay][1] ** -0.5)
            k[:bs].copy_(self._rand(bs, *self.geo[lay]))
            v[:bs].copy_(self._rand(bs, *self.geo[lay]))
        if self.graphs is None:
            self.be.init_forward_metadata(batch)
            self.out[bucket] = {lay: self.be.forward(*(x[:bs] for x in self.inp[lay]), lay)
                                for lay in self.layers}
        else:
            self.be.init_forward_metadata_replay(batch, bucket, 1)
            self.graphs[bucket].replay()
        for i, r in enumerate(rids):
            h = self.hist.get(r)
            if h is not None:
                self._check(r, i, bucket)

    def _check(self, rid: int, i: int, bucket: int) -> None:
        """Queue the oracle for request ``rid`` (row ``i`` of the step) on every layer."""
        p = self.length[rid]  # this step's position
        h = self.hist[rid]
        for lay in self.layers:
            q, k, v = self.inp[lay]
            ks, vs = self.pool.kv_scales(lay)
            hk, hv = h[lay]
            kb = self.pool.get_kv(lay)[0]
            hk[p] = quantize(k[i:i + 1], ks, kb.dtype)[0]  # the step's own K/V join the history
            hv[p] = quantize(v[i:i + 1], vs, kb.dtype)[0]
            w = self.be.windows.get(lay)
            lo = 0 if w is None else max(0, p - w + 1)
            K = hk[lo:p + 1].float() * ks  # [n, Hkv, D]
            V = hv[lo:p + 1].float() * vs
            qq = q[i].float()  # [Hq, D]
            hkv = K.shape[1]
            g = self.hq // hkv
            s = torch.einsum("hgd,nhd->hgn", qq.view(hkv, g, -1), K) * self.be.layer_scale(lay)
            ref = torch.einsum("hgn,nhd->hgd", s.softmax(-1), V).reshape(self.hq, -1)
            o = self.out[bucket][lay][i].float()
            err = (o - ref).norm() / ref.norm().clamp_min(1e-30)
            self.bad += (err > TOL) | ~torch.isfinite(err)
            torch.maximum(self.worst, err.nan_to_num(1e9), out=self.worst)
            self.checked += 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--context", type=int, default=65536)
    ap.add_argument("--layers", type=int, default=6, help="Gemma 4's pattern SSSSSF, cut here")
    ap.add_argument("--backend", default="flashinfer")
    ap.add_argument("--override", nargs="*", default=["backend.groups.full=triton"])
    ap.add_argument("--min-len", type=int, default=200)
    ap.add_argument("--max-len", type=int, default=900)
    ap.add_argument("--check-every", type=int, default=8, help="check every k-th request")
    ap.add_argument("--guards", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    s = Soak(a)
    for _ in range(a.bs):
        s.open()
    cap = s.capture()
    cuda = s.dev == "cuda"
    late = None  # the event of the step before
    waiting = 0  # steps until a finished request's replacement arrives
    t1 = time.perf_counter()
    for n in range(a.steps):
        ev = s.step()
        if late is not None:  # one step late: the step before has run (its counter is back)
            late.synchronize()
        s.free_done(n - 1 if cuda else n)
        late = ev
        for r in [r for r in s.length if s.length[r] >= s.target[r]]:
            s.retire(r)
            waiting = 3
        waiting -= 1
        while len(s.length) < a.bs and (waiting <= 0 or not s.length):
            s.open()
    if cuda:
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    steps_s = t2 - t1
    for r in list(s.length):
        s.retire(r)
    s.free_done(s.steps)
    leaks = s.slots.leaks()
    commit = os.environ.get("SWAFACTORY_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
        cwd=ROOT).stdout.strip() or None  # a copied tree has no .git: the caller names it
    rec = {"commit": commit, "date": time.strftime("%Y-%m-%d"),
           "device": torch.cuda.get_device_name() if cuda else "cpu", "config": vars(a),
           "pool_rows": {sp.pool_id: sp.size for sp in s.pool.sub_pools},
           "pool_bytes": sum(sp.bytes for sp in s.pool.sub_pools), **cap,
           "steps": a.steps, "requests": s.next_rid, "checked_rows": s.checked,
           "mismatches": int(s.bad), "worst_rel_err": float(s.worst), "tolerance": TOL,
           "leaks": leaks, "step_ms": 1e3 * steps_s / a.steps,
           "total_s": time.perf_counter() - t0}
    (out / "soak.json").write_text(json.dumps(rec, indent=1))
    for k in ("commit", "device", "pool_rows", "pool_bytes", "graph_state_bytes", "capture_s",
              "steps", "requests", "checked_rows", "mismatches", "worst_rel_err", "leaks",
              "step_ms", "total_s"):
        print(f"{k:>18}: {rec[k]}")
    ok = rec["mismatches"] == 0 and not any(leaks.values())
    print("soak:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
