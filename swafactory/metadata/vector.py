"""The vectorized half of planning: a forward's per-request host numbers, built once and shared
by every layer group (`HostBatch`), shipped to the device in one copy (`Pack`), and each key
list either as one running sum over increments (`key_pieces` on the host, `key_tables` on the
device: the CPU path, a few torch ops per list) or, on a GPU, computed by one Triton launch for
every list (`metadata.keys_triton`); none read back. `metadata.plan` assembles the tables from
these pieces.

The host arithmetic is numpy on ``[B]``-sized arrays: a torch op on a small CPU tensor costs
3–7 µs of dispatch, a numpy op about 1 µs, and a forward makes about fifty of them. Only the
packed buffer becomes a torch tensor (one copy to the device; its host view is what kernel
libraries that plan on the host read).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np
import torch

from swafactory.metadata.batch import ForwardBatch, ReqForward, StepShape

__all__ = ["Pack", "HostBatch", "key_pieces", "mask_pieces", "key_tables", "mask_tables",
           "to_device"]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without a host sync: pinned, copied asynchronously."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


_I32, _I64 = torch.int32, torch.int64


class Pack:
    """Host numbers of a whole forward, shipped to the device in one copy.

    ``int32`` pieces are what the tables hold as int32 (indptrs, query positions): they need no
    cast on the device. ``int64`` pieces are indices. `add` returns a handle; after `ship`,
    `host` and `dev` give the piece as a view of one buffer on either side (torch tensors)."""

    def __init__(self) -> None:
        self._parts: dict[torch.dtype, list[np.ndarray]] = {_I32: [], _I64: []}
        self._n = {_I32: 0, _I64: 0}

    def add(self, t: np.ndarray, dtype: torch.dtype) -> tuple[torch.dtype, int, int]:
        """Queue ``t`` (host integers, any shape) to travel as ``dtype`` (int32 or int64)."""
        if type(t) is not np.ndarray or t.ndim != 1:  # the planner's pieces are mostly 1-D
            t = np.asarray(t).reshape(-1)
        at = self._n[dtype]
        self._parts[dtype].append(t)
        self._n[dtype] = at + t.size
        return dtype, at, at + t.size

    def ship(self, device: torch.device) -> None:
        """One host buffer, one copy; int32 pieces are cast while they are joined."""
        n32, n64 = self._n[_I32], self._n[_I64]
        k = (n32 + 1) // 2  # int32 pieces travel as int64 pairs
        cuda = device.type == "cuda"
        # on CUDA the pieces are joined straight into pinned memory: the host views stay pinned
        # (a kernel library copying them to the device, FlashInfer's plan, copies async) and
        # the copy to the device needs no staging copy first
        host = torch.empty(k + n64, dtype=_I64, pin_memory=True) if cuda else None
        buf = host.numpy() if cuda else np.empty(k + n64, dtype=np.int64)
        if n32:  # joined straight into the buffer's int32 words (cast on the way)
            np.concatenate(self._parts[_I32], out=buf.view(np.int32)[:n32], casting="unsafe")
            if n32 % 2:
                buf.view(np.int32)[n32] = 0
        if n64:
            np.concatenate(self._parts[_I64], out=buf[k:])
        if cuda:
            dev = host.to(device, non_blocking=True)
        elif device.type == "cpu":
            dev = host = torch.from_numpy(buf)  # what host.to(device) returns, unparsed
        else:
            host = torch.from_numpy(buf)
            dev = host.to(device)
        # pieces are sliced from these four on demand: int32 ones from word 0, int64 from k
        self._k = k
        h32 = host.view(_I32)
        self._h = {_I32: h32, _I64: host}
        self._d = {_I32: h32 if dev is host else dev.view(_I32), _I64: dev}

    def words(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(the shipped buffer as int64 words, as int32 words, k): int32 piece ``(_, a, b)`` is
        int32 words a..b; int64 piece ``(_, a, b)`` is int64 words k+a..k+b (a kernel reads
        every piece through two pointers)."""
        return self._d[_I64], self._d[_I32], self._k

    def host(self, h: tuple[torch.dtype, int, int]) -> torch.Tensor:
        o = 0 if h[0] is _I32 else self._k
        return self._h[h[0]][h[1] + o:h[2] + o]

    def dev(self, h: tuple[torch.dtype, int, int]) -> torch.Tensor:
        o = 0 if h[0] is _I32 else self._k
        return self._d[h[0]][h[1] + o:h[2] + o]


@dataclass(frozen=True, eq=False)
class _ShapeTables:
    """Per-node facts of one `StepShape` as host int64 tables, built once per shape."""

    queries: np.ndarray
    """[q_len, 2]: (node index, depth) of each query."""
    fixes: np.ndarray
    """[f, 2]: (node, increment - 1) of each key node whose position is not the previous key's
    + 1 (tree nodes): positions are a running sum of increments."""
    last_fix: int
    """Sum of ``fixes[:, 1]``: the last key's position minus its slot index."""
    shape: StepShape

    @cached_property
    def holes(self) -> np.ndarray:
        """[h, 2]: (query row, node) of each node the query does not see. Mask batches only:
        built on first use, since a plain chunk's (its upper triangle, q_len²/2 pairs) would
        cost gigabytes at 8K tokens and a batch without a mask never reads it."""
        s = self.shape
        sm = ReqForward(0, 0, 0, s.nodes, s.query_from, s.parents, s.block,
                        s.prefix_only).node_structure()
        if sm is None:  # a chain inside a masked batch: causal by node order
            sm = torch.ones(s.nodes, s.nodes, dtype=torch.bool).tril()[s.query_from:]
        return np.argwhere(~sm.numpy()).astype(np.int64).reshape(-1, 2)


@lru_cache(maxsize=4096)
def _shape_tables(s: StepShape, flat: bool = False) -> _ShapeTables:
    """flat: the fault switch of sglang #39160: a node's position is prefix + its node index
    (its flat slot), not prefix + its depth."""
    d = tuple(range(s.nodes)) if flat else s.depths  # FAULT when flat
    queries = np.array([(i, d[i]) for i in range(s.query_from, s.nodes)],
                       dtype=np.int64).reshape(-1, 2)
    inc = [d[0] + 1] + [d[i] - d[i - 1] for i in range(1, s.kv_nodes)] if s.kv_nodes else []
    fixes = np.array([(i, v - 1) for i, v in enumerate(inc) if v != 1],
                     dtype=np.int64).reshape(-1, 2)
    return _ShapeTables(queries, fixes, int(fixes[:, 1].sum()), s)


class _Items:
    """A per-shape item table (a `_ShapeTables` field) laid out request by request: ``i`` and
    ``j`` are the items' two columns, ``at(col)`` puts a per-request column beside each item.
    With one shape they broadcast ([B, 1] against [n]); with several they are gathered ([T]);
    ``n`` counts the items either way."""

    def __init__(self, h: HostBatch, pick) -> None:
        ts = [pick(t) for t in h.tables]
        if h.of is None:
            self.n, self.b, t = ts[0].shape[0] * h.B, None, ts[0]
        else:
            sizes = np.array([t.shape[0] for t in ts], dtype=np.int64)
            per_req = sizes[h.of]
            self.b = np.repeat(np.arange(h.B), per_req)  # request of each item
            self.n = self.b.size
            first = np.cumsum(sizes) - sizes  # each shape's offset in the joined tables
            t = np.concatenate(ts)[np.arange(self.n) - (np.cumsum(per_req) - per_req)[self.b]
                                   + first[h.of][self.b]]
        self.i, self.j = t[:, 0], t[:, 1]

    def at(self, col: int | np.ndarray) -> int | np.ndarray:
        if not isinstance(col, np.ndarray):
            return col
        return col[:, None] if self.b is None else col[self.b]


class HostBatch:
    """A forward's per-request numbers as host tensors: one pass over the requests, shared by
    every layer group (they see the same requests; only window starts differ)."""

    def __init__(self, batch: ForwardBatch, need_mask: bool, page_size: int = 1,
                 flat_tree_positions: bool = False) -> None:
        reqs, table = batch.reqs, batch.req_to_token
        self.page_size = page_size
        self.B = B = len(reqs)
        self.C = C = table.shape[1]
        rows = [r.row for r in reqs]
        if min(rows) < 0 or max(rows) >= table.shape[0]:
            bad = next(r for r in reqs if not 0 <= r.row < table.shape[0])
            raise IndexError(f"request {bad.rid!r}: row {bad.row} is outside req_to_token's "
                             f"{table.shape[0]} rows")
        self.row_c = np.array(rows, dtype=np.int64) * C
        pre = [r.prefix_len for r in reqs]
        self.pre = np.array(pre, dtype=np.int64)
        self.shapes = batch.step_shapes
        self.tables = [_shape_tables(s, flat_tree_positions) for s in self.shapes]
        self.of = None  # shape index of each request, when there are several
        if len(self.shapes) > 1:
            index = {s: k for k, s in enumerate(self.shapes)}
            self.of = np.array([index[r.step] for r in reqs], dtype=np.int64)
        self.q_len = self._col([s.nodes - s.query_from for s in self.shapes])
        self.kvn = self._col([s.kv_nodes for s in self.shapes])
        self.fqd = self._col([s.first_query_depth for s in self.shapes])
        self.kv_end = self.pre + self.kvn
        # with one shape the longest is the longest prefix's: a Python max, not a numpy reduce
        self.kv_max = max(pre) + self.kvn if self.of is None else int(self.kv_end.max())
        """The longest request's key count (slot after its last key)."""
        if self.kv_max > C:
            bad = next(r for r in reqs if r.kv_end > C)
            raise IndexError(f"request {bad.rid!r}: keys up to slot {bad.kv_end} but "
                             f"req_to_token holds {C} per row")
        self.max_q = max(s.nodes - s.query_from for s in self.shapes)
        self.total_q = B * self.q_len if self.of is None else int(self.q_len.sum())
        self.zeros = np.zeros(B, dtype=np.int64)
        self.queries = _Items(self, lambda t: t.queries)
        holes = _Items(self, lambda t: t.holes) if need_mask else None
        self.holes = holes if holes is not None and holes.n else None
        # Flat table indices fit int32 (almost always): the running sums are then int32, and
        # their position row is kv_pos as it is.
        self.idx_dtype = _I32 if table.numel() < 2**31 else _I64

    @cached_property
    def fixes(self) -> _Items | None:
        """Tree nodes' position fixes (only the running sums of `key_tables` need them)."""
        fixes = _Items(self, lambda t: t.fixes)
        return fixes if fixes.n else None

    @cached_property
    def last_fix(self) -> int | np.ndarray:
        return self._col([t.last_fix for t in self.tables])

    def _col(self, per_shape: list[int]) -> int | np.ndarray:
        """A per-request column: a plain int when every request has one shape."""
        return per_shape[0] if self.of is None else np.array(per_shape, dtype=np.int64)[self.of]

    def starts(self, window: int | None) -> np.ndarray:
        """[B] int64: each request's first key slot: ``first query position - W + 1``, never
        past its prefix (queries see the step's nodes from the prefix on), floored to a page
        start (page_size > 1): a kernel that reads whole pages gets lists that start on one.
        The keys before the window in that first page are still allocated (eviction frees whole
        pages only) and every kernel masks them by position."""
        if window is None:
            return self.zeros
        st = self.pre + (self.fqd - (window - 1))  # in place from here: one array, not four
        np.maximum(st, 0, out=st)
        np.minimum(st, self.pre, out=st)
        if self.page_size > 1:
            st -= st % self.page_size
        return st


def key_pieces(h: HostBatch, start: np.ndarray, pack: Pack, running: bool = True) -> dict:
    """Host numbers of one start set (one or more layer groups): indptrs, each request's key
    count (``kvl``), and (``running``) the increments whose running sum gives every key's flat
    table index (row 0) and position (row 1). Without ``running``, the fused kernel
    (`keys_triton`) computes keys from ``start``."""
    kvl = h.kv_end - start
    kvptr = np.zeros(h.B + 1, dtype=np.int64)
    np.add.accumulate(kvl, out=kvptr[1:])  # np.cumsum's wrapper costs 3x the scan
    n = int(kvptr[-1])
    if not running:
        return dict(n=n, kv_host=pack.add(kvptr, _I32), start=start, mask=None, kvl=kvl)
    first = np.stack([h.row_c + start, start])  # [2, B]: first key's (flat index, position)
    ends = first + kvl
    if h.fixes is not None:
        ends[1] += h.last_fix
    steps = first - np.concatenate([np.ones((2, 1), dtype=np.int64), ends[:, :-1]], 1)
    idx, vals = [kvptr[:-1], kvptr[:-1] + (n + 1)], [steps.reshape(-1)]
    if h.fixes is not None:  # tree nodes: a key node's position is prefix + depth
        f = h.fixes
        idx.append((f.at(kvptr[1:] - h.kvn + (n + 1)) + f.i).reshape(-1))
        vals.append((f.j + h.zeros[:, None] if f.b is None else f.j).reshape(-1))
    return dict(n=n, kv_host=pack.add(kvptr, _I32), idx=pack.add(np.concatenate(idx), _I64),
                vals=pack.add(np.concatenate(vals), h.idx_dtype), start=start, mask=None,
                kvl=kvl)


def mask_pieces(h: HostBatch, start: np.ndarray, pack: Pack) -> tuple:
    """(elements, indptr handle, hidden elements handle or None) of one start set's mask:
    request b's [q_len, kv_len] block is all visible but for the structure's holes."""
    kvl = h.kv_end - start
    mptr = np.zeros(h.B + 1, dtype=np.int64)
    np.cumsum(h.q_len * kvl, out=mptr[1:])
    holes = None
    if h.holes is not None:  # a hidden node's element: row start + prefix keys + node
        o = h.holes
        holes = pack.add(o.at(mptr[:-1] + kvl - h.kvn) + o.i * o.at(kvl) + o.j, _I64)
    return int(mptr[-1]), pack.add(mptr, _I32), holes


def key_tables(p: dict, pack: Pack, flat_table: torch.Tensor, dtype: torch.dtype):
    """(full-space key slots [n] int64, kv_pos [n] int32, mask, mask_indptr) on the device:
    one running sum gives both the flat table index and the position of every key."""
    n, device = p["n"], flat_table.device
    vals = pack.dev(p["vals"])
    if device.type == "cpu":  # torch's CPU scan of int32 writes int64 at twice an int64 scan's cost
        dtype, vals = _I64, vals.long()
    x = torch.ones(2 * (n + 1), dtype=dtype, device=device)
    x.index_add_(0, pack.dev(p["idx"]), vals)
    # two 1-D scans (a [2, n] scan along dim 1 runs one block per row on CUDA), not in place
    # (an aliased out= scan takes 2.4x as long on CPU)
    idx, pos = (torch.cumsum(row, 0) for row in x.view(2, n + 1))
    slots = flat_table.index_select(0, idx[:n])
    return (slots.long(), pos[:n].to(_I32), *mask_tables(p, pack, device))


def mask_tables(p: dict, pack: Pack, device: torch.device):
    """(mask, mask_indptr) of one start set on the device, or (None, None): every element
    visible (prefix keys) but the structure's holes."""
    if p["mask"] is None:
        return None, None
    total, mptr, holes = p["mask"]
    mask = torch.ones(total, dtype=torch.bool, device=device)
    if holes is not None:
        mask.index_fill_(0, pack.dev(holes), False)
    return mask, pack.dev(mptr)
