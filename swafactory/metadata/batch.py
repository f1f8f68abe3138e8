"""What one forward asks for: the mode and, per request, which keys exist and which are queries.

A request's tokens live in its `ReqToToken` row by *slot order*: positions ``[0, prefix_len)``
are its committed history, and the ``nodes`` entries after them are the tokens of this step
(new prefill or decode tokens, a draft chain, a draft tree, a DFlash block). The last
``nodes - query_from`` of them are this forward's queries, and their K/V are written by it.
A token's *position* is its index for committed and chain tokens, and ``prefix_len + depth``
for a tree node: the window and RoPE follow positions, never slot order.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Literal

import torch

from swafactory.guards import batch_table

__all__ = ["ForwardMode", "MODE_PASS", "MODES", "StepShape", "step_shape", "ReqForward", "ForwardBatch"]

ForwardMode = Literal["extend", "decode", "target_verify", "draft_decode", "draft_extend"]
MODE_PASS = {"decode": "decode", "draft_decode": "decode", "target_verify": "verify",
             "draft_extend": "verify", "extend": "extend"}
"""A forward mode → the pass whose kernel choice serves it (and whose buffers a graph binds)."""
MODES: tuple[ForwardMode, ...] = ("extend", "decode", "target_verify", "draft_decode",
                                  "draft_extend")


@dataclass(frozen=True, eq=False)
class StepShape:
    """What a request's step looks like apart from where it is (its row and prefix length):
    requests of one shape share every per-node fact. Built by `step_shape`, which hands out one
    object per shape, so the planner groups requests by identity instead of hashing parents."""

    nodes: int
    query_from: int
    parents: tuple[int, ...] | None
    block: bool
    prefix_only: bool

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """Depth of each node: its index for a chain or block, its tree depth otherwise."""
        if self.parents is None:
            return tuple(range(self.nodes))
        d: list[int] = []
        for p in self.parents:
            d.append(0 if p < 0 else d[p] + 1)
        return tuple(d)

    @cached_property
    def first_query_depth(self) -> int:
        """Smallest depth among the queries (where the earliest query's window starts from)."""
        return min(self.depths[self.query_from:])

    @property
    def kv_nodes(self) -> int:
        """Nodes that are keys of this step (none for `prefix_only` queries)."""
        return 0 if self.prefix_only else self.nodes


@lru_cache(maxsize=4096)  # bounded: an engine has a handful of shapes, a fuzzer many
def step_shape(nodes: int, query_from: int, parents: tuple[int, ...] | None, block: bool,
               prefix_only: bool) -> StepShape:
    """The one `StepShape` of these facts (while it stays in the cache)."""
    return StepShape(nodes, query_from, parents, block, prefix_only)


@dataclass(frozen=True)
class ReqForward:
    """One request's part of a forward."""

    rid: Hashable
    """Request id (for error messages and the harness)."""
    row: int
    """Its `ReqToToken` row."""
    prefix_len: int
    """Committed tokens already in the pool: positions ``[0, prefix_len)``."""
    nodes: int
    """Tokens of this step after the prefix, in slot order (all written by now or by this forward)."""
    query_from: int = 0
    """Index of the first node that is a query of this forward (draft decode: the newest level)."""
    parents: tuple[int, ...] | None = None
    """Tree: parent node index of each node (-1 = child of the prefix). None = a causal chain."""
    block: bool = False
    """DFlash: the nodes see each other (non-causal inside the block)."""
    prefix_only: bool = False
    """The queries see the committed prefix only, none of the step's nodes (whose keys are not in
    the pool): a FROZEN_KV MTP draft step k queries position ``prefix_len + k`` over the target's
    keys ``0 … prefix_len - 1``, as ``ReqForward(L, k + 1, query_from=k, prefix_only=True)``."""

    def __post_init__(self) -> None:
        if self.prefix_len < 0 or self.nodes < 1 or not 0 <= self.query_from < self.nodes:
            raise ValueError(f"request {self.rid!r}: need prefix_len >= 0, nodes >= 1 and "
                             f"0 <= query_from < nodes; got {self.prefix_len}, {self.nodes}, "
                             f"{self.query_from}")
        if self.parents is not None:
            if len(self.parents) != self.nodes:
                raise ValueError(f"request {self.rid!r}: {len(self.parents)} parents for "
                                 f"{self.nodes} nodes")
            if any(not -1 <= p < i for i, p in enumerate(self.parents)):
                raise ValueError(f"request {self.rid!r}: each parent must precede its node")
        if self.parents is not None and self.block:
            raise ValueError(f"request {self.rid!r}: a DFlash block is not a tree")
        if self.prefix_only and (self.parents is not None or self.block):
            raise ValueError(f"request {self.rid!r}: prefix_only queries see no node, so they "
                             "take no tree or block structure")
        # Not a field: equality, hashing and repr stay those of the fields.
        parents = None if self.parents is None else tuple(self.parents)
        object.__setattr__(self, "_step", step_shape(self.nodes, self.query_from, parents,
                                                     self.block, self.prefix_only))

    @property
    def step(self) -> StepShape:
        """This request's `StepShape` (shared with every request of the same shape)."""
        return self._step

    @property
    def q_len(self) -> int:
        """Queries of this forward."""
        return self.nodes - self.query_from

    @property
    def depths(self) -> tuple[int, ...]:
        """Depth of each node: its index for a chain or block, its tree depth otherwise."""
        return self._step.depths

    def node_positions(self) -> torch.Tensor:
        """[nodes] int64: token positions of the step's nodes."""
        return self.prefix_len + torch.tensor(self.depths, dtype=torch.int64)

    @property
    def kv_end(self) -> int:
        """Slot index after the request's last key: the step's nodes are keys unless
        `prefix_only`."""
        return self.prefix_len + (0 if self.prefix_only else self.nodes)

    def node_structure(self) -> torch.Tensor | None:
        """[q_len, nodes] bool: which nodes each query sees, or None when causal by position
        (a `prefix_only` query sees none: [q_len, 0])."""
        if self.prefix_only:
            return torch.zeros(self.q_len, 0, dtype=torch.bool)
        if self.block:
            return torch.ones(self.q_len, self.nodes, dtype=torch.bool)
        if self.parents is None:
            return None
        vis = torch.zeros(self.nodes, self.nodes, dtype=torch.bool)
        for i in range(self.nodes):
            j = i
            while j != -1:
                vis[i, j] = True
                j = self.parents[j]
        return vis[self.query_from:]


@dataclass(frozen=True)
class ForwardBatch:
    """The frozen input of one forward: what the planner turns into per-group tables."""

    mode: ForwardMode
    reqs: tuple[ReqForward, ...]
    req_to_token: torch.Tensor = field(repr=False)
    """[max_requests, max_context] int: each request's full slot per slot index (a
    `ReqToToken` given here is replaced by its ``.table``)."""
    full_id: str
    """Id of the full index space the table's slots belong to (the allocator's)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not self.reqs:
            raise ValueError("a forward needs at least one request")
        if not isinstance(self.req_to_token, torch.Tensor):  # a ReqToToken: its table
            object.__setattr__(self, "req_to_token", batch_table(self.req_to_token))

    @classmethod
    def of(cls, mode: ForwardMode, reqs: Sequence[ReqForward], req_to_token: torch.Tensor,
           full_id: str) -> ForwardBatch:
        """Build from any sequence of requests."""
        return cls(mode, tuple(reqs), req_to_token, full_id)

    @property
    def batch_size(self) -> int:
        """Requests in the forward."""
        return len(self.reqs)

    # Cached: the batch is frozen, and the planner asks once per layer group.
    @cached_property
    def total_q(self) -> int:
        """Query rows of the forward (rows of q, k, v)."""
        return sum(r.q_len for r in self.reqs)

    @cached_property
    def step_shapes(self) -> tuple[StepShape, ...]:
        """The requests' distinct `StepShape`s, first seen first (one pass over the requests)."""
        return tuple(dict.fromkeys([r._step for r in self.reqs]))

    @cached_property
    def has_tree(self) -> bool:
        """Some request verifies or drafts a tree."""
        return any(s.parents is not None for s in self.step_shapes)

    @cached_property
    def needs_mask(self) -> bool:
        """Some request's visibility is not causal by position over keys ending at its queries
        (a tree, a DFlash block, prefix-only queries): kernels get the structure mask."""
        return self.has_tree or any(s.block or s.prefix_only for s in self.step_shapes)
