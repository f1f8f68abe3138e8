"""The spec table, stated once: the forwards of one speculative step, per family.

Both drivers use it: the conformance harness (seeded random q/k/v, a seeded tree and a seeded
accepted path) and the generator (`swafactory.engine`: a real model, greedy drafts, greedy
acceptance). What differs between them is a `SpecHooks` object; which forwards run, with which
`ReqForward` shapes, which slots are allocated, truncated and moved, is decided here.

One step for the running requests (L = a request's committed length; node 0, the root, is the
last generated token, whose K/V is not in the pools yet):

| family | draft forwards (``draft_decode``) | verify (``target_verify``) |
|---|---|---|
| chain, own pool (eagle, nextn, standalone) | step s: ``(L, s + 1, query_from=s)`` | ``(L, num_draft_tokens)`` |
| tree (eagle3, standalone topk > 1) | level l: ``(L, hi, parents, query_from=lo)`` | ``(L, num_draft_tokens, parents)`` |
| dflash | ``(L, block_size, block=True)`` | ``(L, block_size)`` |
| frozen_kv_mtp, ``mtp`` | step k: ``(L, k + 1, query_from=k, prefix_only=True)`` | ``(L, num_draft_tokens)`` |
| frozen_kv_mtp, ``reread`` | step k: ``(L - 1, 1)`` | ``(L, num_draft_tokens)`` |

then the accepted path (a hook), its K/V moved into place in every pool that holds the step's
nodes (a tree path that is not a prefix), the rest freed (`RequestSlots.truncate`), and a
``draft_extend`` ``(L, a)`` over the accepted tokens for a draft that writes its own pool.
"""
from __future__ import annotations

import random
from collections.abc import Hashable, Sequence
from typing import Literal, Protocol

import torch

from swafactory.errors import CapacityError
from swafactory.kvcache.locs import Locs
from swafactory.kvcache.move import move_kv
from swafactory.kvcache.pool import host_to_device
from swafactory.kvcache.requests import RequestSlots
from swafactory.kvcache.sizing import step_nodes
from swafactory.metadata.batch import ForwardMode, ReqForward

__all__ = ["SpecHooks", "SpecStep", "graph_modes", "graph_tokens", "MAX_GRAPH_TOKENS",
           "fault_switches", "FrozenQuery", "req_forward", "alloc_upto",
           "level_bounds", "seeded_tree", "seeded_accept", "greedy_path", "children",
           "eviction_floor"]

FrozenQuery = Literal["reread", "mtp"]
"""How a FROZEN_KV draft step queries the target's K/V: ``reread`` re-reads position L - 1 (the
harness: every step the same query, which keeps the L - 1 eviction rule under test); ``mtp``
queries position L + k over keys 0 … L - 1, as a real MTP head does (the generator)."""


class _Req(Protocol):
    rid: Hashable
    committed: int


class SpecHooks(Protocol):
    """What a driver supplies to `SpecStep.run`."""

    def forward(self, worker: str, mode: ForwardMode, reqs: list[ReqForward]) -> None:
        """Run one forward of ``worker`` (``target`` or ``draft``)."""

    def start_tree(self, reqs: Sequence[_Req]) -> dict[Hashable, list[int]]:
        """Each request's tree parents known before the first draft level (at least the root)."""

    def grow_tree(self, reqs: list[ReqForward], level: int,
                  tree: dict[Hashable, list[int]]) -> None:
        """After the draft queried tree level ``level``: append the next level's parents to
        ``tree`` (in place) for each request that still needs them."""

    def accept(self, verify: ReqForward) -> list[int]:
        """The accepted path (node ids from the root, node 0) of one request's verify."""

    def on_commit(self, rid: Hashable, committed: int, path: list[int]) -> None:
        """Bookkeeping after ``path`` was moved to positions ``committed…`` and the rest freed."""


def level_bounds(topk: int, level: int) -> tuple[int, int]:
    """Node ids ``[lo, hi)`` of tree level ``level`` (0 = the root) in BFS order."""
    return (0, 1) if level == 0 else (1 + topk * (level - 1), 1 + topk * level)


def children(parents: Sequence[int] | None, n: int, node: int) -> list[int]:
    """Children of ``node`` among the first ``n`` nodes (a chain's child of i is i + 1)."""
    return [i for i in range(1, n) if (parents[i] if parents is not None else i - 1) == node]


def seeded_tree(topk: int, steps: int, rng: random.Random) -> tuple[int, ...]:
    """A drafted tree in BFS order: a root, then `topk` nodes per level, each under a random
    node of the level above."""
    parents = [-1]
    prev = [0]
    for _ in range(steps):
        level = [len(parents) + i for i in range(topk)]
        parents.extend(rng.choice(prev) for _ in level)
        prev = level
    return tuple(parents)


def seeded_accept(parents: Sequence[int] | None, n: int, rng: random.Random,
                  p: float = 0.7) -> list[int]:
    """A seeded accepted path from the root (node 0): each next token is accepted with
    probability p, down a random child. A chain's child of node i is node i + 1."""
    path = [0]
    while True:
        kids = children(parents, n, path[-1])
        if not kids or rng.random() > p:
            return path
        path.append(rng.choice(kids))


def greedy_path(parents: Sequence[int] | None, tokens: Sequence[int],
                best: Sequence[int]) -> list[int]:
    """Greedy verification: from the root, follow the child whose drafted token is the target's
    argmax at its parent. tokens[i]: node i's token; best[i]: the target's argmax at node i."""
    path = [0]
    while True:
        nxt = [c for c in children(parents, len(tokens), path[-1]) if tokens[c] == best[path[-1]]]
        if not nxt:
            return path
        path.append(nxt[0])


def fault_switches(cfg) -> dict:
    """`SpecStep`'s fault-switch arguments from a config's ``faults`` (every runner's step
    reproduces the same engine bugs)."""
    f = cfg.faults
    return dict(leak_rejected_draft_slots=f.leak_rejected_draft_slots,
                premature_free_window=(cfg.model.sliding_window if f.premature_free_on_reject
                                       else None))


def eviction_floor(committed: int, prefilling: bool, frozen: bool) -> int:
    """The first position a later query can have: L, or L - 1 for a FROZEN_KV draft once the
    prompt is prefilled (its ``reread`` query sits there)."""
    return max(0, committed - 1 if frozen and not prefilling else committed)


def req_forward(slots: RequestSlots, rid: Hashable, prefix: int, nodes: int,
                **kw) -> ReqForward:
    """``rid``'s `ReqForward` at its `ReqToToken` row (every driver's one way to build one)."""
    return ReqForward(rid, slots.reqs[rid].row, prefix, nodes, **kw)


def alloc_upto(slots: RequestSlots, rid: Hashable, upto: int) -> None:
    """Allocate ``rid``'s positions up to ``upto`` (nothing when they are)."""
    need = upto - slots.reqs[rid].kv_len
    if need <= 0:
        return
    try:
        slots.extend(rid, need)
    except CapacityError as exc:
        raise CapacityError(f"{exc}: out-of-window SWA slots were not freed, rejected draft "
                            "slots were not freed, or the pools are too small") from exc


class SpecStep:
    """One speculative step of the spec table over a set of running requests.

    spec: the validated spec config; slots: the shared `RequestSlots`; pools: every pool that
    holds K/V of the step's nodes at the target's full slots (the target's; an own draft
    pool); draft_writes: the draft writes its own pool (not FROZEN_KV); frozen_query: see
    `FrozenQuery`; leak_rejected_draft_slots, premature_free_window: fault switches
    (`RequestSlots.truncate`).
    """

    def __init__(self, spec, slots: RequestSlots, pools: Sequence[object], *, draft_writes: bool,
                 frozen_query: FrozenQuery = "reread",
                 leak_rejected_draft_slots: bool = False,
                 premature_free_window: int | None = None) -> None:
        self.spec, self.slots, self.pools = spec, slots, [p for p in pools if p is not None]
        self.draft_writes, self.frozen_query = draft_writes, frozen_query
        self.leak, self.premature = leak_rejected_draft_slots, premature_free_window

    def _rf(self, r: _Req, prefix: int, nodes: int, **kw) -> ReqForward:
        return req_forward(self.slots, r.rid, prefix, nodes, **kw)

    def truncate(self, rid: Hashable, new_len: int) -> None:
        """Free the rejected draft slots past ``new_len``."""
        self.slots.truncate(rid, new_len, leak_rejected_draft_slots=self.leak,
                            premature_free_window=self.premature)

    def run(self, reqs: Sequence[_Req], hooks: SpecHooks) -> list[int]:
        """Draft, verify, accept, commit, draft-extend; returns each request's accepted length
        (committed tokens: the root plus the accepted drafts). ``committed`` is not updated."""
        s = self.spec
        for r in reqs:
            alloc_upto(self.slots, r.rid, r.committed + step_nodes(s))
        parents: dict[Hashable, tuple[int, ...] | None] = {r.rid: None for r in reqs}
        if s.algorithm == "dflash":
            verify_n = s.block_size
            hooks.forward("draft", "draft_decode",
                          [self._rf(r, r.committed, s.block_size, block=True) for r in reqs])
        elif s.is_tree:
            verify_n = s.num_draft_tokens
            tree = hooks.start_tree(reqs)
            for lvl in range(s.num_steps):  # the draft queries the root, then each level
                lo, hi = level_bounds(s.topk, lvl)
                fw = [self._rf(r, r.committed, hi, parents=tuple(tree[r.rid][:hi]), query_from=lo)
                      for r in reqs]
                hooks.forward("draft", "draft_decode", fw)
                hooks.grow_tree(fw, lvl, tree)
            for r in reqs:  # keep the verified subtree (BFS prefix), free the rest of the tree
                self.truncate(r.rid, r.committed + verify_n)
                parents[r.rid] = tuple(tree[r.rid][:verify_n])
        else:  # chains: eagle, nextn, standalone, frozen_kv_mtp
            verify_n = s.num_draft_tokens
            for step in range(s.num_steps):
                if self.draft_writes:
                    fw = [self._rf(r, r.committed, step + 1, query_from=step) for r in reqs]
                elif self.frozen_query == "mtp":  # position L + k over the target's keys < L
                    fw = [self._rf(r, r.committed, step + 1, query_from=step, prefix_only=True)
                          for r in reqs]
                else:  # re-read the committed KV through the last committed token
                    fw = [self._rf(r, r.committed - 1, 1) for r in reqs]
                hooks.forward("draft", "draft_decode", fw)
        verify = [self._rf(r, r.committed, verify_n, parents=parents[r.rid]) for r in reqs]
        hooks.forward("target", "target_verify", verify)
        accepted = []
        for r, v in zip(reqs, verify):
            path = hooks.accept(v)
            self._commit(r, path, hooks)
            accepted.append(len(path))
        if self.draft_writes:
            hooks.forward("draft", "draft_extend",
                          [self._rf(r, r.committed, a) for r, a in zip(reqs, accepted)])
        return accepted

    def _commit(self, r: _Req, path: list[int], hooks: SpecHooks) -> None:
        """Move the accepted path's KV to positions L.., then free everything after it."""
        L = r.committed
        if path != list(range(len(path))):
            table = self.slots.req_to_token.table[self.slots.reqs[r.rid].row]
            fid = self.slots.allocator.full_id
            # the path's columns travel pinned and asynchronously: a Python list as an index
            # would be a blocking host→device copy on every tree commit
            cols = host_to_device(torch.tensor(path, dtype=torch.int64).add_(L), table.device)
            src = Locs("full", fid, table.index_select(0, cols).long())
            dst = Locs("full", fid, table[L:L + len(path)].long())
            for pool in self.pools:
                move_kv(pool, src, dst)
        self.truncate(r.rid, L + len(path))
        hooks.on_commit(r.rid, L, path)


MAX_GRAPH_TOKENS = 16
"""Queries per request a graph holds at most (verify, draft steps); more run eagerly."""


def graph_tokens(q: int, masked: bool) -> int:
    """The queries per request of the bucket that holds ``q``: a power of two, at least 2 for
    a masked batch (it needs the prefill kernel)."""
    return 1 << (max(q, 2 if masked else 1) - 1).bit_length()


def graph_modes(spec, role: str, writes: bool = True) -> list[tuple[ForwardMode, int]]:
    """(mode, queries per request) of every graph bucket a ``role`` (``target`` or ``draft``)
    runner of ``spec`` (a `SpecConfig`) replays after its prefill, as `SpecStep` shapes its
    forwards: what the scheduler captures at start-up (`scheduler.Scheduler`). writes: the draft writes its own
    pool (not a FROZEN_KV draft), so it runs draft_extend over the accepted tokens."""
    if spec.algorithm == "none":
        return [("decode", 1)] if role == "target" else []
    dflash, tree = spec.algorithm == "dflash", spec.is_tree
    verify_n = spec.block_size if dflash else spec.num_draft_tokens
    if role == "target":
        got = [("target_verify", graph_tokens(verify_n, dflash or tree))]
    elif dflash:
        got = [("draft_decode", graph_tokens(spec.block_size, True))]
    elif tree:
        widths = {hi - lo for lo, hi in (level_bounds(spec.topk, lvl)
                                          for lvl in range(spec.num_steps))}
        got = [("draft_decode", graph_tokens(w, True)) for w in sorted(widths)]
    else:
        got = [("draft_decode", 1)]
    if role == "draft" and writes:  # over the accepted tokens: 1 … verify_n of them; first, as
        # an engine meets them (the prefill's draft_extend comes before any draft step)
        top = graph_tokens(verify_n, False)
        got = [("draft_extend", 1 << i) for i in range(top.bit_length())] + got
    return [(m, t) for m, t in dict.fromkeys(got) if t <= MAX_GRAPH_TOKENS]
