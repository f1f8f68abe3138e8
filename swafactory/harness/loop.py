"""The serving loop: admit, prefill in chunks, decode or run the spec table, evict, finish.

Each spec step is one run of the spec table (`swafactory.speculative.SpecStep`, shared with the
generator): the draft's forwards (own pool, or the target's frozen view swapped in), target
verify (chain, tree by custom mask or cascade, or a DFlash block), a seeded accepted path, the
rejected slots freed in both pools, the accepted tree KV moved into place (translated for SWA
layers), and a draft extend over the accepted tokens. A FROZEN_KV draft step re-reads position
L - 1 here (``frozen_query="reread"``).
"""
from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

from swafactory.errors import CapacityError
from swafactory.fault_counts import FAULT_COUNTS
from swafactory.harness.setup import Parts
from swafactory.harness.workers import Check, History, Worker
from swafactory.kvcache.allocator import pool_use
from swafactory.metadata.batch import ForwardMode, ReqForward
from swafactory.speculative import (SpecStep, alloc_upto, eviction_floor, fault_switches,
                                    req_forward, seeded_accept, seeded_tree)

__all__ = ["Req", "Loop", "Mismatched"]


@dataclass
class Req:
    """One request's progress."""

    rid: int
    prompt: int
    out: int
    committed: int = 0
    """Tokens whose KV the target holds (positions [0, committed))."""
    generated: int = 0
    fresh_eviction: bool = False

    @property
    def prefilling(self) -> bool:
        return self.committed < self.prompt


class Mismatched(Exception):
    """An oracle check failed; carries the failing check and where it happened."""

    def __init__(self, worker: str, mode: str, check: Check, error: float) -> None:
        self.worker, self.mode, self.check, self.error = worker, mode, check, error
        super().__init__(f"{worker} {mode} layer {check.layer} ({check.group}): rel err {error:.3g}")


class Loop:
    """Drives `Parts` through a whole workload; `on_forward(worker, mode, checks)` sees results."""

    def __init__(self, parts: Parts, prompts: list[int], outs: list[int], *, tolerance: float,
                 rng: random.Random,
                 on_forward: Callable[[Worker, str, int, list[Check]], None]) -> None:
        self.p, self.cfg, self.rng, self.tol = parts, parts.cfg, rng, tolerance
        self.waiting = deque(Req(i, pr, o) for i, (pr, o) in enumerate(zip(prompts, outs)))
        self.running: list[Req] = []
        self.done: list[Req] = []
        self.on_forward = on_forward
        self.step = 0
        self.evicted = 0
        self.step_evicted = 0
        self.accepts: list[int] = []
        self.current = ("-", "setup")
        self.swa_use = self.full_use = 0.0
        self.spec_step = SpecStep(
            self.cfg.spec, parts.slots, (parts.pool, parts.draft_pool),
            draft_writes=parts.draft is not None and parts.draft.writes, frozen_query="reread",
            **fault_switches(self.cfg))

    # ------------------------------------------------------------------ plumbing
    def _rf(self, r: Req, prefix: int, nodes: int, **kw) -> ReqForward:
        return req_forward(self.p.slots, r.rid, prefix, nodes, **kw)

    def _alloc(self, r: Req, upto: int) -> None:
        alloc_upto(self.p.slots, r.rid, upto)

    def _run(self, worker: Worker, mode: ForwardMode, reqs: list[ReqForward], check: bool) -> None:
        self.current = (worker.name, mode)
        swap = self.p.swap if worker.name == "draft" and self.p.swap is not None else None
        # a FROZEN_KV draft: the target's frozen view in for its forward (serving.FrozenSwap)
        with nullcontext() if swap is None else swap.active():
            checks = worker.forward(mode, reqs, self.p.slots.req_to_token.table,
                                    self.p.alloc.full_id, check=check, keep_above=self.tol,
                                    kv_check=True)
        worker.backend.raise_pending()  # the checks read back already: guards report here
        self.on_forward(worker, mode, len(worker.layers), checks)
        for c in checks:
            err = c.error()
            if not err <= self.tol:
                raise Mismatched(worker.name, mode, c, err)

    # ------------------------------------------------------------------ scheduling
    def _admit(self) -> None:
        R = self.cfg.workload.max_running_requests
        while self.waiting and len(self.running) < R:
            r = self.waiting.popleft()
            self.p.slots.open(r.rid)
            self.p.hist_t[r.rid] = History()
            if self.p.draft is not None and self.p.draft.writes:
                self.p.hist_d[r.rid] = History()
            self.running.append(r)

    def step_once(self) -> str:
        """One scheduler step; returns `prefill` or `decode`."""
        self._admit()
        self.step_evicted = 0
        prefill = [r for r in self.running if r.prefilling]
        kind = "prefill" if prefill else "decode"
        if prefill:
            self._prefill(prefill)
        elif self.cfg.spec.algorithm == "none":
            self._decode(self.running)
        else:
            self._spec(self.running)
        # pool use at its peak: after the step's forwards, before finished requests and evictions
        self.swa_use = pool_use(self.p.alloc, "swa" if self.p.split else "full")
        self.full_use = pool_use(self.p.alloc, "full")
        for r in list(self.running):
            if r.generated >= r.out:
                self.p.slots.finish(r.rid)
                self.p.hist_t.pop(r.rid, None)
                self.p.hist_d.pop(r.rid, None)
                self.running.remove(r)
                self.done.append(r)
        self._evict()
        self._trim_histories()
        self.step += 1
        return kind

    def finished(self) -> bool:
        return not self.waiting and not self.running

    def _evict(self) -> None:
        if not self.p.split:
            return
        W, I = self.cfg.model.sliding_window, self.cfg.workload.eviction_interval
        reread = self.cfg.spec.draft_kv == "target_pool"  # FROZEN_KV re-reads position L-1
        if self.cfg.faults.no_swa_eviction:  # FAULT: acted once a request has dead SWA slots
            if any(eviction_floor(r.committed, r.prefilling, reread) - W + 1 >= I
                   for r in self.running):
                FAULT_COUNTS.acted("no_swa_eviction")
            return
        for r in self.running:
            low = eviction_floor(r.committed, r.prefilling, reread)
            n = self.p.slots.evict_out_of_window(
                r.rid, low, W, I, paged_free_stale_mapping=self.cfg.faults.paged_free_stale_mapping)
            if n:
                r.fresh_eviction = True
                self.evicted += n
                self.step_evicted += n

    def _trim_histories(self) -> None:
        """Drop the logical-history rows of sliding-window layers that no query to come can see:
        every later query sits at position ≥ committed - 1 (a FROZEN_KV draft re-reads L-1)."""
        for worker, hists in ((self.p.target, self.p.hist_t), (self.p.draft, self.p.hist_d)):
            if worker is None:
                continue
            for spec in worker.layers.values():
                if spec.window is None:
                    continue
                for r in self.running:
                    if r.rid in hists:
                        hists[r.rid].drop_before(spec.history_layer, r.committed - spec.window - 1)

    # ------------------------------------------------------------------ modes
    def _prefill(self, reqs: list[Req]) -> None:
        w, P = self.cfg.workload, self.cfg.backend.page_size
        fwd, cross, fresh = [], False, False
        W = self.cfg.model.sliding_window or 0
        for r in reqs:
            n = min(w.chunk_size, r.prompt - r.committed)
            if self.p.split:  # stay inside this request's share of the SWA pool
                st = self.p.slots.reqs[r.rid]
                n = min(n, self.p.sizes.swa_pages_per_req * P + st.swa_evicted - st.kv_len)
                if n <= 0:
                    raise CapacityError(f"request {r.rid}: its SWA share is full at position "
                                        f"{r.committed} (evicted up to {st.swa_evicted})")
            self._alloc(r, r.committed + n)
            fwd.append((r, n))
            cross |= r.committed < W <= r.committed + n
            fresh |= r.fresh_eviction
        check = cross or fresh or self.rng.random() < w.check_rate
        reqs_f = [self._rf(r, r.committed, n) for r, n in fwd]
        self._run(self.p.target, "extend", reqs_f, check)
        if self.p.draft is not None and self.p.draft.writes:
            self._run(self.p.draft, "draft_extend", reqs_f, check)
        for r, n in fwd:
            r.committed += n
            r.fresh_eviction = False
            if not r.prefilling:
                r.generated += 1  # the prefill's last logits give the first token

    def _decode(self, reqs: list[Req]) -> None:
        for r in reqs:
            self._alloc(r, r.committed + 1)
        self._run(self.p.target, "decode", [self._rf(r, r.committed, 1) for r in reqs], True)
        for r in reqs:
            r.committed += 1
            r.generated += 1
            r.fresh_eviction = False

    def _spec(self, reqs: list[Req]) -> None:
        """One step of the spec table (`swafactory.speculative`), with the harness's hooks:
        a seeded tree, a seeded accepted path, histories kept beside the pools."""
        accepted = self.spec_step.run(reqs, self)
        for r, a in zip(reqs, accepted):
            r.committed += a
            r.generated += a
            r.fresh_eviction = False
            self.accepts.append(a)

    # ------------------------------------------------------------------ SpecHooks
    def forward(self, worker: str, mode: ForwardMode, reqs: list[ReqForward]) -> None:
        self._run(self.p.target if worker == "target" else self.p.draft, mode, reqs, True)

    def start_tree(self, reqs) -> dict:
        s = self.cfg.spec
        parents = list(seeded_tree(s.topk, s.num_steps, self.rng))  # one tree for every request
        return {r.rid: parents for r in reqs}

    def grow_tree(self, reqs, level, tree) -> None:
        return None  # the seeded tree was drawn whole

    def accept(self, verify: ReqForward) -> list[int]:
        return seeded_accept(verify.parents, verify.nodes, self.rng)

    def on_commit(self, rid, committed: int, path: list[int]) -> None:
        if path != list(range(len(path))):
            self.p.hist_t[rid].reorder_tail(committed, path)
        self.p.hist_t[rid].truncate(committed + len(path))
        if rid in self.p.hist_d:  # the draft extend rewrites the accepted tokens' draft KV
            self.p.hist_d[rid].truncate(committed)
