"""The conformance payload on the serving core (`swafactory.serving.scheduler`): seeded Q/K/V, each
checked attention output compared with the fp32 oracle, seeded drafts and accepts.

The scheduler admits, prefills, decodes, evicts and finishes; this payload runs each forward
through a `Worker` (the target's, or the draft's, with a FROZEN_KV draft's frozen view swapped
in), raises `Mismatched` on a check beyond the tolerance and reports every forward to
``on_forward``. It samples which prefill chunks are checked (a chunk that crosses the window or
follows a fresh eviction always is, the others at ``workload.check_rate``; every other forward
is), keeps each request's logical K/V history beside the pools and trims the rows no query to
come can see. Each spec step is one run of the spec table (`swafactory.serving.speculative.SpecStep`,
shared with the generator) with a seeded tree and a seeded accepted path; a FROZEN_KV draft
step re-reads position L - 1 here (``frozen_query="reread"``).
"""
from __future__ import annotations

import random
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

from swafactory.harness.workers import Check, History, Worker
from swafactory.metadata.batch import ForwardMode, ReqForward
from swafactory.serving.scheduler import Payload, Scheduler, StepKind
from swafactory.serving.parts import Parts
from swafactory.serving.speculative import seeded_accept, seeded_tree

__all__ = ["Req", "Loop", "Mismatched"]


@dataclass
class Req:
    """One request's progress (a `scheduler.Request`)."""

    rid: int
    prompt: int
    out: int
    committed: int = 0
    """Tokens whose KV the target holds (positions [0, committed))."""
    generated: int = 0

    @property
    def prompt_len(self) -> int:
        return self.prompt

    @property
    def prefilling(self) -> bool:
        return self.committed < self.prompt

    @property
    def complete(self) -> bool:
        return self.generated >= self.out


class Mismatched(Exception):
    """An oracle check failed; carries the failing check and where it happened."""

    def __init__(self, worker: str, mode: str, check: Check, error: float) -> None:
        self.worker, self.mode, self.check, self.error = worker, mode, check, error
        super().__init__(f"{worker} {mode} layer {check.layer} ({check.group}): rel err {error:.3g}")


class Loop(Payload):
    """A whole workload through the scheduler (``core``), each forward checked; ``on_forward(
    worker, mode, layers, checks)`` sees every forward's results."""

    frozen_query = "reread"

    def __init__(self, parts: Parts[Worker], prompts: list[int], outs: list[int], *,
                 tolerance: float, rng: random.Random,
                 on_forward: Callable[[Worker, str, int, list[Check]], None]) -> None:
        self.p, self.cfg, self.rng, self.tol = parts, parts.cfg, rng, tolerance
        self.on_forward = on_forward
        self.current = ("-", "setup")
        # the logical histories the workers record into (a FROZEN_KV draft reads the target's)
        self.hist_t = parts.target.hist
        d = parts.draft
        self.hist_d = d.hist if d is not None and d.writes else {}
        self.core = Scheduler(parts, self, (Req(i, pr, o) for i, (pr, o)
                                            in enumerate(zip(prompts, outs))))

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

    # ------------------------------------------------------------------ scheduler hooks
    def forward(self, worker: str, mode: ForwardMode, reqs: list[ReqForward],
                check: bool = True) -> None:
        self._run(self.p.target if worker == "target" else self.p.draft, mode, reqs, check)

    def admitted(self, r: Req) -> None:
        self.hist_t[r.rid] = History()
        if self.p.draft is not None and self.p.draft.writes:
            self.hist_d[r.rid] = History()

    def check_prefill(self, cross: bool, fresh: bool) -> bool:
        return cross or fresh or self.rng.random() < self.cfg.workload.check_rate

    def advanced(self, r: Req, n: int, kind: StepKind) -> None:
        # a prefill's last chunk gives the first token (its last logits)
        r.generated += (0 if r.prefilling else 1) if kind == "prefill" else n

    def released(self, r: Req) -> None:
        self.hist_t.pop(r.rid, None)
        self.hist_d.pop(r.rid, None)

    def stepped(self, kind: StepKind, accepts: list[int]) -> None:
        self._trim_histories()

    def _trim_histories(self) -> None:
        """Drop the logical-history rows of sliding-window layers that no query to come can see:
        every later query sits at position ≥ committed - 1 (a FROZEN_KV draft re-reads L-1)."""
        for worker, hists in ((self.p.target, self.hist_t), (self.p.draft, self.hist_d)):
            if worker is None:
                continue
            for spec in worker.layers.values():
                if spec.window is None or spec.sink:  # a sink reads from position 0
                    continue
                for r in self.running:
                    if r.rid in hists:
                        hists[r.rid].drop_before(spec.history_layer, r.committed - spec.window - 1)

    # ------------------------------------------------------------------ SpecHooks
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
            self.hist_t[rid].reorder_tail(committed, path)
        self.hist_t[rid].truncate(committed + len(path))
        if rid in self.hist_d:  # the draft extend rewrites the accepted tokens' draft KV
            self.hist_d[rid].truncate(committed)
