"""The serving core: one scheduler admits, prefills, decodes, runs every spec step, evicts and
finishes requests, for every kind of run.

A run is a `Payload` on it: the conformance harness (`harness.loop`: seeded Q/K/V checked
against an fp32 oracle, seeded drafts and accepts) or the generator (`engine.generator`: an HF
model, greedy drafts and acceptance). The payload says how a forward is run and checked, how
tokens are drafted and accepted (`speculative.SpecHooks`) and what a request keeps beside its
slots. The scheduler decides which forwards run with which shapes, and when slots are taken and
freed, so the two runs can never drift apart in either.

One step (`Scheduler.step_once`):

1. admit waiting requests up to ``workload.max_running_requests`` (a `ReqToToken` row each);
2. if a running request is prefilling: a chunk of each prefilling request (``chunk_size``,
   clamped to the request's share of the SWA pool), target ``extend``, then ``draft_extend``
   for a draft that writes its own pool; else ``decode`` (``spec=none``) or one step of the
   spec table (`speculative.SpecStep`);
3. read the pool use, at its peak: after the forwards, before anything is freed;
4. finish the requests that have all their tokens (every slot and row released);
5. free every running request's out-of-window SWA slots (`RequestSlots.evict_out_of_window`).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Literal, Protocol

from swafactory.errors import CapacityError
from swafactory.kvcache.allocator import pool_use
from swafactory.backend.faulty import admission_for, evictor_for
from swafactory.metadata.batch import ForwardMode, ReqForward
from swafactory.serving.parts import Parts
from swafactory.serving.speculative import (FrozenQuery, SpecStep, alloc_upto, eviction_floor,
                                    fault_switches, graph_modes, req_forward)

__all__ = ["StepKind", "Request", "Payload", "Scheduler", "capture_graphs", "replay_steps",
           "AdmissionError"]


class AdmissionError(CapacityError):
    """A request that needs more slots of a space than a running request's share: admission
    and the pools' sizing disagree, so it would wait forever. A failed run, never a refusal:
    the sizing already admitted the workload."""

StepKind = Literal["prefill", "decode", "spec"]


class Request(Protocol):
    """What the scheduler reads of a payload's request."""

    rid: Hashable
    committed: int
    """Positions ``[0, committed)`` have their K/V in the pools."""
    out: int
    """Tokens it asks for beyond its prompt."""

    @property
    def prompt_len(self) -> int: ...

    @property
    def prefilling(self) -> bool: ...

    @property
    def complete(self) -> bool:
        """Every token it asked for is generated (counted on the host: no device value)."""


class Payload:
    """What differs between runs. A subclass implements `forward` and, with speculative
    decoding, `speculative.SpecHooks` (``start_tree``, ``grow_tree``, ``accept``,
    ``on_commit``); the other hooks default to doing nothing. Its ``__init__`` builds
    ``self.core = Scheduler(parts, self, requests)``; the core's state reads through it."""

    frozen_query: FrozenQuery = "reread"
    """How a FROZEN_KV draft step queries (`speculative.FrozenQuery`)."""
    current: tuple[str, str] = ("-", "setup")
    """(runner, mode) of the forward running or last run, for error reports."""
    core: Scheduler

    # ------------------------------------------------------------------ the core, read here
    @property
    def step(self) -> int:
        return self.core.step

    @property
    def waiting(self) -> deque:
        return self.core.waiting

    @property
    def running(self) -> list:
        return self.core.running

    @property
    def done(self) -> list:
        return self.core.done

    def step_once(self) -> StepKind:
        return self.core.step_once()

    def finished(self) -> bool:
        return self.core.finished()

    def run(self) -> None:
        """Step until every request finished, then `ended`."""
        while not self.core.finished():
            self.core.step_once()
        self.ended()

    # ------------------------------------------------------------------ hooks
    def forward(self, worker: str, mode: ForwardMode, reqs: list[ReqForward],
                check: bool = True) -> None:
        """Run one forward of ``worker`` (``target`` or ``draft``); ``check``: the scheduler
        asks for it to be checked (a sampled prefill chunk may not be)."""
        raise NotImplementedError

    def admitted(self, r: Request) -> None:
        """``r`` got its slot books (`RequestSlots.open`)."""

    def check_prefill(self, cross: bool, fresh: bool) -> bool:
        """Whether this step's prefill chunks are checked: ``cross``, a chunk crosses the
        window; ``fresh``, a request had SWA slots evicted since its last forward."""
        return True

    def before_spec(self, reqs: Sequence[Request]) -> None:
        """Before one step of the spec table over ``reqs``."""

    def advanced(self, r: Request, n: int, kind: StepKind) -> None:
        """``r.committed`` moved on by ``n`` in a ``kind`` step (a spec step: ``n`` accepted)."""

    def released(self, r: Request) -> None:
        """``r`` finished: its slots and row are back."""

    def stepped(self, kind: StepKind, accepts: list[int]) -> None:
        """The step ended (``core.step`` counts it); ``accepts``: its accept lengths."""

    def ended(self) -> None:
        """Every request finished (`run`)."""


def capture_graphs(parts: Parts) -> int:
    """Capture every graph bucket × mode the runners meet (`speculative.graph_modes`), up to
    the bucket that holds ``workload.max_running_requests``, before the first step: graph state
    is allocated once, and nothing is captured inside the loop (a capture synchronizes the
    device). Each runner files its graphs under its backend's `graph_key` (the mode decides the
    kernels and buffers a graph binds). Returns how many were captured (0 without
    ``backend.cuda_graph``)."""
    cfg, n = parts.cfg, 0
    for runner in (parts.target, parts.draft):
        if runner is not None:
            n += runner.capture_all(graph_modes(cfg.spec, runner.name, runner.writes),
                                    max_bs=cfg.workload.max_running_requests)
    return n


class Scheduler:
    """Drives `Parts` through a payload's requests, step by step (see the module doc)."""

    def __init__(self, parts: Parts, payload: Payload, requests: Iterable[Request]) -> None:
        self.p, self.cfg, self.payload = parts, parts.cfg, payload
        self.waiting: deque = deque(requests)
        self.running: list = []
        self.done: list = []
        self.step = 0
        self.evicted = 0  # SWA positions freed by eviction, over the run
        self.overheld: tuple | None = None
        """The first (step, request, dead SWA positions held, its frontier, the window's) where
        a running request still held SWA slots no later query can see after eviction: eviction
        that never ran or fell behind (the run's leak check names it; the pools' sizing assumes
        each request holds its window)."""
        self.step_evicted = 0  # … in the last step
        self.accepts: list[int] = []  # every spec step's accept lengths, in order
        self.swa_use = self.full_use = 0.0  # the last step's peak use
        self.fresh: set[Hashable] = set()  # SWA slots evicted since the request's last forward
        s = self.cfg.spec
        self.draft_writes = parts.draft is not None and parts.draft.writes
        self.spec = None if s.algorithm == "none" else SpecStep(
            s, parts.slots, (parts.pool, parts.draft_pool), draft_writes=self.draft_writes,
            frozen_query=payload.frozen_query, **fault_switches(self.cfg))
        self._need = admission_for(self.cfg)  # `kvcache.shares.admission_need`, or a fault's
        self._evict_one = evictor_for(self.cfg)  # `RequestSlots.evict_out_of_window`, or a fault's
        self.captured = capture_graphs(parts)  # start-up: never inside a step

    def finished(self) -> bool:
        return not self.waiting and not self.running

    def step_once(self) -> StepKind:
        """One scheduler step; returns its kind."""
        self._admit()
        self.step_evicted = 0
        prefill = [r for r in self.running if r.prefilling]
        accepts: list[int] = []
        kind: StepKind = "prefill" if prefill else "decode" if self.spec is None else "spec"
        if prefill:
            self._prefill(prefill)
        elif self.spec is None:
            self._decode(self.running)
        else:
            accepts = self._spec(self.running)
        # pool use at its peak: after the step's forwards, before finished requests and evictions
        self.swa_use = pool_use(self.p.alloc, "swa" if self.p.split else "full")
        self.full_use = pool_use(self.p.alloc, "full")
        self._finish()
        self._evict()
        self._held()
        self.step += 1
        self.payload.stepped(kind, accepts)
        return kind

    # ------------------------------------------------------------------ admission and finish
    def _admit(self) -> None:
        R = self.cfg.workload.max_running_requests
        while self.waiting and len(self.running) < R:
            self._fits(self.waiting[0])
            r = self.waiting.popleft()
            self.p.slots.open(r.rid)
            self.payload.admitted(r)
            self.running.append(r)

    def _fits(self, r: Request) -> None:
        """A request holds at most `kvcache.shares.admission_need` slots of each space, which
        must fit the share each running request was sized for; one that cannot would wait
        forever, so it is refused here, naming the request, the space and both counts."""
        sizes = self.p.sizes
        need = self._need(self.cfg, sizes, r.prompt_len, r.out)
        share = {"full": sizes.full_per_request, "swa": sizes.swa_per_request}
        for space, n in need.items():
            if n > share[space]:
                raise AdmissionError(
                    f"request {r.rid} ({r.prompt_len} prompt + {r.out} output tokens) needs "
                    f"{n} {space} slots, but each running request's share is {share[space]}: "
                    "it can never be admitted and would wait forever (admission and the "
                    "pools' sizing disagree: size each share for the longest request, and count "
                    "a window-retained draft on the SWA side at its window)")

    def _finish(self) -> None:
        for r in list(self.running):
            if r.complete:
                self.p.slots.finish(r.rid)
                self.payload.released(r)
                self.fresh.discard(r.rid)
                self.running.remove(r)
                self.done.append(r)

    def _evict(self) -> None:
        if not self.p.split:
            return
        W, I = self.cfg.model.sliding_window, self.cfg.workload.eviction_interval
        frozen = self.cfg.spec.draft_kv == "target_pool"  # FROZEN_KV may re-read position L-1
        for r in self.running:
            low = eviction_floor(r.committed, r.prefilling, frozen)
            n = self._evict_one(self.p.slots, r.rid, low, W, I, r.prefilling)
            if n:
                self.fresh.add(r.rid)
                self.evicted += n
                self.step_evicted += n


    def _held(self) -> None:
        """Record the first request that, after eviction, still holds SWA slots of positions no
        later query can see, by more than the eviction interval and a page allow."""
        if self.overheld is not None or not self.p.split:
            return
        W, I = self.cfg.model.sliding_window, self.cfg.workload.eviction_interval
        P, frozen = self.cfg.backend.page_size, self.cfg.spec.draft_kv == "target_pool"
        for r in self.running:
            st = self.p.slots.reqs[r.rid]
            front = max(0, eviction_floor(r.committed, r.prefilling, frozen) - W + 1) // P * P
            if front - st.swa_evicted >= I + P:
                self.overheld = (self.step, r.rid, front - st.swa_evicted, st.swa_evicted, front)
                return

    # ------------------------------------------------------------------ modes
    def _rf(self, r: Request, prefix: int, nodes: int, **kw) -> ReqForward:
        return req_forward(self.p.slots, r.rid, prefix, nodes, **kw)

    def _advance(self, r: Request, n: int, kind: StepKind) -> None:
        r.committed += n
        self.fresh.discard(r.rid)
        self.payload.advanced(r, n, kind)

    def _prefill(self, reqs: list) -> None:
        w = self.cfg.workload
        W = self.cfg.model.sliding_window or 0
        chunks, cross, fresh = [], False, False
        for r in reqs:
            n = min(w.chunk_size, r.prompt_len - r.committed)
            if self.p.split:  # stay inside this request's share of the SWA pool
                st = self.p.slots.reqs[r.rid]
                n = min(n, self.p.sizes.swa_per_request + st.swa_evicted - st.kv_len)
                if n <= 0:
                    raise CapacityError(f"request {r.rid}: its SWA share is full at position "
                                        f"{r.committed} (evicted up to {st.swa_evicted})")
            alloc_upto(self.p.slots, r.rid, r.committed + n)
            chunks.append((r, n))
            cross |= r.committed < W <= r.committed + n
            fresh |= r.rid in self.fresh
        check = self.payload.check_prefill(cross, fresh)
        fw = [self._rf(r, r.committed, n) for r, n in chunks]
        self.payload.forward("target", "extend", fw, check=check)
        if self.draft_writes:
            self.payload.forward("draft", "draft_extend", fw, check=check)
        for r, n in chunks:
            self._advance(r, n, "prefill")

    def _decode(self, reqs: list) -> None:
        for r in reqs:
            alloc_upto(self.p.slots, r.rid, r.committed + 1)
        self.payload.forward("target", "decode", [self._rf(r, r.committed, 1) for r in reqs])
        for r in reqs:
            self._advance(r, 1, "decode")

    def _spec(self, reqs: list) -> list[int]:
        """One step of the spec table with the payload's hooks; returns the accept lengths."""
        self.payload.before_spec(reqs)
        accepted = self.spec.run(reqs, self.payload)
        for r, a in zip(reqs, accepted):
            self._advance(r, a, "spec")
            self.accepts.append(a)
        return accepted


def replay_steps(cfg, prompts: list[int], outs: list[int], accepted: Callable[[], int],
                 swa_share: int | None = None, *, evicts: bool = True) -> int:
    """Scheduler steps to serve ``prompts`` / ``outs`` (tokens per request) under ``cfg`` (a
    `SwaFactoryConfig`), replayed on paper with this module's rules: admission, prefill chunks
    clamped to ``swa_share`` SWA slots a request (None: no clamp) with the eviction frontier
    moving as `Scheduler` moves it (``evicts=False``: it never moves, as under the harness's
    no_swa_eviction fault), then decode or spec steps committing ``accepted()`` tokens per
    request (progress estimates: no pool is touched)."""
    m, w, P = cfg.model, cfg.workload, cfg.backend.page_size
    W = m.sliding_window or 0
    split = bool(m.swa_layers) and m.hybrid_pool
    evicts = split and evicts
    reread = cfg.spec.draft_kv == "target_pool"  # FROZEN_KV keeps position L-1
    # per request: [prompt, out, committed, generated, swa_evicted]
    split = split and swa_share is not None
    waiting = deque([p, o, 0, 0, 0] for p, o in zip(prompts, outs))
    running: list[list[int]] = []
    steps = 0
    while waiting or running:
        while waiting and len(running) < w.max_running_requests:
            running.append(waiting.popleft())
        prefill = [r for r in running if r[2] < r[0]]
        for r in prefill:
            n = min(w.chunk_size, r[0] - r[2])
            if split:
                n = min(n, swa_share + r[4] - r[2])
            if n <= 0:  # the loop raises CapacityError here: the run stops
                return steps + 1
            r[2] += n
            if r[2] >= r[0]:
                r[3] += 1  # the prefill's last logits give the first token
        if not prefill:
            for r in running:
                a = accepted()
                r[2] += a
                r[3] += a
        running = [r for r in running if r[3] < r[1]]
        if evicts:
            for r in running:
                low = r[2] - 1 if reread and r[2] >= r[0] else r[2]
                frontier = max(0, max(0, low) - W + 1) // P * P
                if frontier - r[4] >= w.eviction_interval:
                    r[4] = frontier
        steps += 1
    return steps
