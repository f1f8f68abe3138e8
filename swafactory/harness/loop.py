"""The serving loop: admit, prefill in chunks, decode or run the spec table, evict, finish.

Each spec step follows DESIGN's table: the draft's forwards (own pool, or the target's frozen
view swapped in), target verify (chain, tree by custom mask or cascade, or a DFlash block),
a seeded accepted path, the rejected slots freed in both pools, the accepted tree KV moved into
place (translated for SWA layers), and a draft extend over the accepted tokens.
"""
from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from swafactory.errors import CapacityError
from swafactory.harness.setup import Parts, draft_nodes
from swafactory.harness.workers import Check, History, Worker
from swafactory.kvcache.locs import Locs
from swafactory.kvcache.move import move_kv
from swafactory.metadata.batch import ForwardMode, ReqForward

__all__ = ["Req", "Loop", "Mismatched", "pool_use"]


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

    # ------------------------------------------------------------------ plumbing
    def _rf(self, r: Req, prefix: int, nodes: int, **kw) -> ReqForward:
        return ReqForward(r.rid, self.p.slots.reqs[r.rid].row, prefix, nodes, **kw)

    def _alloc(self, r: Req, upto: int) -> None:
        need = upto - self.p.slots.reqs[r.rid].kv_len
        if need <= 0:
            return
        try:
            self.p.slots.extend(r.rid, need)
        except CapacityError as exc:
            raise CapacityError(f"{exc}: out-of-window SWA slots were not freed, rejected draft "
                                "slots were not freed, or the pools are too small") from exc

    def _run(self, worker: Worker, mode: ForwardMode, reqs: list[ReqForward], check: bool) -> None:
        self.current = (worker.name, mode)
        swap = worker.name == "draft" and self.p.frozen_view is not None
        if swap:  # the engine swaps the target's frozen view in for the draft's forward
            self.p.draft_view.active_pool = self.p.frozen_view
        try:
            checks = worker.forward(mode, reqs, self.p.slots.req_to_token.table,
                                    self.p.alloc.full_id, check=check, keep_above=self.tol)
        finally:
            if swap:
                self.p.draft_view.active_pool = self.p.dummy_pool
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
        if not self.p.split or self.cfg.faults.no_swa_eviction:
            return
        W, I = self.cfg.model.sliding_window, self.cfg.workload.eviction_interval
        reread = self.cfg.spec.draft_kv == "target_pool"  # FROZEN_KV re-reads position L-1
        for r in self.running:
            low = r.committed - 1 if reread and not r.prefilling else r.committed
            n = self.p.slots.evict_out_of_window(r.rid, max(0, low), W, I)
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
        s = self.cfg.spec
        T = draft_nodes(self.cfg)
        for r in reqs:
            self._alloc(r, r.committed + T)
        if s.algorithm == "dflash":
            parents, verify_n = None, s.block_size
            self._run(self.p.draft, "draft_decode",
                      [self._rf(r, r.committed, s.block_size, block=True) for r in reqs], True)
        elif s.is_tree:
            parents = _tree(s.topk, s.num_steps, self.rng)
            verify_n = s.num_draft_tokens
            for lvl in range(s.num_steps):  # the draft queries the root, then each level
                lo, hi = (0, 1) if lvl == 0 else (1 + s.topk * (lvl - 1), 1 + s.topk * lvl)
                self._run(self.p.draft, "draft_decode",
                          [self._rf(r, r.committed, hi, parents=parents[:hi], query_from=lo)
                           for r in reqs], True)
            for r in reqs:  # keep the verified subtree (BFS prefix), free the rest of the tree
                self._truncate(r, r.committed + verify_n)
            parents = parents[:verify_n]
        else:  # chains: eagle, nextn, standalone, frozen_kv_mtp
            parents, verify_n = None, s.num_draft_tokens
            for step in range(s.num_steps):
                if self.p.draft.writes:
                    fw = [self._rf(r, r.committed, step + 1, query_from=step) for r in reqs]
                else:  # FROZEN_KV: re-read the committed KV through the last committed token
                    fw = [self._rf(r, r.committed - 1, 1) for r in reqs]
                self._run(self.p.draft, "draft_decode", fw, True)
        self._run(self.p.target, "target_verify",
                  [self._rf(r, r.committed, verify_n, parents=parents) for r in reqs], True)
        accepted = []
        for r in reqs:
            path = _accept(parents, verify_n, self.rng)
            self._commit(r, path)
            accepted.append((r, len(path)))
        if self.p.draft is not None and self.p.draft.writes:
            self._run(self.p.draft, "draft_extend",
                      [self._rf(r, r.committed, a) for r, a in accepted], True)
        for r, a in accepted:
            r.committed += a
            r.generated += a
            r.fresh_eviction = False
            self.accepts.append(a)

    def _truncate(self, r: Req, new_len: int) -> None:
        """Free the rejected draft slots past ``new_len`` (the fault switch lives in RequestSlots)."""
        self.p.slots.truncate(r.rid, new_len,
                              leak_rejected_draft_slots=self.cfg.faults.leak_rejected_draft_slots)

    def _commit(self, r: Req, path: list[int]) -> None:
        """Move the accepted path's KV to positions L.., then free everything after it."""
        L = r.committed
        if path != list(range(len(path))):
            row = self.p.slots.reqs[r.rid].row
            table = self.p.slots.req_to_token.table[row]
            fid = self.p.alloc.full_id
            src = Locs("full", fid, table[[L + i for i in path]].long())
            dst = Locs("full", fid, table[L:L + len(path)].long())
            for pool in (self.p.pool, self.p.draft_pool):
                if pool is not None:
                    move_kv(pool, src, dst)
            self.p.hist_t[r.rid].reorder_tail(L, path)
        self._truncate(r, L + len(path))
        self.p.hist_t[r.rid].truncate(L + len(path))
        if r.rid in self.p.hist_d:  # the draft extend rewrites the accepted tokens' draft KV
            self.p.hist_d[r.rid].truncate(L)


def pool_use(alloc, space: str) -> float:
    """Used / total slots of one space (`swa` or `full`) of an allocator."""
    sub = getattr(alloc, space, alloc)  # an SWAAllocator has .full/.swa; a TokenAllocator is one
    return sub.used_size() / sub.size


def _tree(topk: int, steps: int, rng: random.Random) -> tuple[int, ...]:
    """A drafted tree in BFS order: a root, then `topk` nodes per level, each under a random
    node of the level above."""
    parents = [-1]
    prev = [0]
    for _ in range(steps):
        level = [len(parents) + i for i in range(topk)]
        parents.extend(rng.choice(prev) for _ in level)
        prev = level
    return tuple(parents)


def _accept(parents: tuple[int, ...] | None, n: int, rng: random.Random,
            p: float = 0.7) -> list[int]:
    """A seeded accepted path from the root (node 0): each next token is accepted with
    probability p, down a random child. A chain's child of node i is node i + 1."""
    path = [0]
    while True:
        last = path[-1]
        kids = [i for i in range(1, n) if (parents[i] if parents else i - 1) == last]
        if not kids or rng.random() > p:
            return path
        path.append(rng.choice(kids))
