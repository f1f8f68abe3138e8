"""`plan(batch, pool, source, windows) -> ForwardPlan`: all host work of a forward, done once.

For each layer group (a sub-pool and a window) it builds the kernel contract of
`swafactory.kernels`: CSR key lists in the group's typed index space, each key's and query's
position, the structure mask (trees, DFlash blocks), cascade tables, and write locations.
Full slots are translated to SWA slots here, once, *before* any split or reorder (DESIGN
invariant 1); SWA key lists are trimmed to start at ``first query position - W + 1`` (not at 0),
and their mask columns start there too (sglang #39160).

The per-request host work is done once per forward and shared by every group (`_Host`); all
host numbers reach the device in one copy (`_Pack`), and each key list is one running sum over
increments (`_key_tables`): a few device ops per group whatever the batch size, none read back.
"""
from __future__ import annotations

from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

import torch

from swafactory.errors import SpaceError
from swafactory.kvcache.locs import Locs
from swafactory.metadata.batch import ForwardBatch, ForwardMode, ReqForward, StepShape

__all__ = ["AttnTables", "GroupPlan", "ForwardPlan", "PassCache", "plan", "group_key"]


@dataclass(frozen=True, eq=False)
class AttnTables:
    """One attention pass over one layer group: the kernel contract.

    qo_indptr, kv_indptr: [B+1] int32. kv_indices: [total_kv] rows in the group's index space.
    q_pos: [total_q] int32, kv_pos: [total_kv] int32 (token positions). mask: flattened bool, request
    b's [q_len_b, kv_len_b] block starting at mask_indptr[b] ([B+1] int32); None = causal by
    position. The window applies by position: visible = structure & (q_pos - kv_pos < W).
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: Locs
    q_pos: torch.Tensor
    kv_pos: torch.Tensor
    mask: torch.Tensor | None = None
    mask_indptr: torch.Tensor | None = None
    max_q_len: int = 0
    """Longest request's query count (host-known: kernels need no device read for it)."""
    qo_host: torch.Tensor | None = None
    """[B+1] int32 on the host: ``qo_indptr`` built from the batch's host lengths (the planner
    always sets it). Kernel libraries whose plan reads host indptrs (FlashInfer) take these:
    nothing is read back."""
    kv_host: torch.Tensor | None = None
    """[B+1] int32 on the host: ``kv_indptr``, likewise."""

    @property
    def batch_size(self) -> int:
        return self.qo_indptr.numel() - 1


@dataclass(frozen=True, eq=False)
class GroupPlan:
    """Everything the layers of one group need in this forward."""

    key: str
    """`group_key(sub_pool, window)`: `swa/w<W>`, `full`, or `full/w<W>` (a window applied as a
    mask on an unsplit pool)."""
    sub_pool: str
    """Sub-pool whose buffers the group's layers read: `swa` or `full`."""
    window: int | None
    """HF W of the group's layers; None = full attention."""
    tables: AttnTables
    """One pass with the structure mask (custom-mask strategy, and every non-tree forward)."""
    cascade: tuple[AttnTables, AttnTables] | None
    """(prefix pass, expand pass) for tree forwards under the cascade strategy; merged by LSE."""
    write_locs: Locs | None
    """[total_q] slots of this forward's new tokens in the group's space; None = writes nothing."""

    @property
    def passes(self) -> tuple[tuple[str, AttnTables], ...]:
        """(role, tables) of every pass an adapter may be asked to run: ``main``, then the
        cascade's ``pre`` and ``exp`` when there is one."""
        extra = () if self.cascade is None else (("pre", self.cascade[0]), ("exp", self.cascade[1]))
        return (("main", self.tables), *extra)


class PassCache(dict):
    """An adapter's host work for each pass of one forward (`GroupPlan.passes`), keyed by the
    tables' identity: the forward plan keeps them alive until the next plan clears this."""

    def __init__(self, adapter: str) -> None:
        super().__init__()
        self.adapter = adapter

    def put(self, tables: AttnTables, work):
        self[id(tables)] = work
        return work

    def of(self, tables: AttnTables):
        """The work planned for ``tables``; RuntimeError when they were not planned."""
        work = self.get(id(tables))
        if work is None:
            raise RuntimeError(f"{self.adapter} adapter: these tables were not planned in this "
                               "forward (call AttentionBackend.init_forward_metadata first)")
        return work


@dataclass(frozen=True, eq=False)
class ForwardPlan:
    """A forward's plan: one GroupPlan per layer group, and which layer uses which."""

    mode: ForwardMode
    groups: Mapping[str, GroupPlan]
    layer_groups: Mapping[int, str]
    source_rule: str
    """Why the resolver chose its KV source ("none" when nothing is translated)."""
    total_q: int

    def group(self, layer_id: int) -> GroupPlan:
        """The plan of ``layer_id``'s group."""
        try:
            return self.groups[self.layer_groups[layer_id]]
        except KeyError:
            raise KeyError(f"layer {layer_id} is not in this plan; layers: "
                           f"{sorted(self.layer_groups)}") from None


def group_key(sub_pool: str, window: int | None) -> str:
    """Layers share a plan only when they share a sub-pool *and* a window: ``swa/w1024``,
    ``full``, ``full/w16`` (a window applied as a mask on an unsplit pool). Tables are trimmed and
    masked by the window, so two windows never share one set."""
    return sub_pool if window is None else f"{sub_pool}/w{window}"


def _start(r: ReqForward, window: int | None) -> int:
    if window is None:
        return 0
    first_q = r.prefix_len + min(r.depths[r.query_from:])
    return min(r.prefix_len, max(0, first_q - window + 1))


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without a host sync: pinned, copied asynchronously."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _indptr(lens: list[int]) -> torch.Tensor:
    """[n+1] int32 host offsets of ``lens``."""
    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    if lens:
        torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0, out=out[1:])
    return out


def _tables(kv: Locs, reqs: list[ReqForward], kv_lens: list[int], kv_pos: list[torch.Tensor],
            q_pos: torch.Tensor, masks: list[torch.Tensor] | None, device: torch.device) -> AttnTables:
    qo_host, kv_host = _indptr([r.q_len for r in reqs]), _indptr(kv_lens)
    mask = mask_indptr = None
    if masks is not None:
        mask = _to(torch.cat([m.reshape(-1) for m in masks]), device)
        mask_indptr = _to(_indptr([m.numel() for m in masks]), device)
    return AttnTables(_to(qo_host, device), _to(kv_host, device), kv,
                      _to(q_pos.to(torch.int32), device),
                      _to(torch.cat(kv_pos).to(torch.int32), device), mask, mask_indptr,
                      max(r.q_len for r in reqs), qo_host, kv_host)


_I32, _I64 = torch.int32, torch.int64


class _Pack:
    """Host numbers of a whole forward, shipped to the device in one copy.

    ``int32`` pieces are what the tables hold as int32 (indptrs, query positions): they need no
    cast on the device. ``int64`` pieces are indices. `add` returns a handle; after `ship`,
    `host` and `dev` give the piece as a view of one buffer on either side."""

    def __init__(self) -> None:
        self._parts: dict[torch.dtype, list[torch.Tensor]] = {_I32: [], _I64: []}
        self._n = {_I32: 0, _I64: 0}

    def add(self, t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.dtype, int, int]:
        """Queue ``t`` (host int64, any shape) to travel as ``dtype`` (int32 or int64)."""
        at = self._n[dtype]
        self._parts[dtype].append(t.reshape(-1))
        self._n[dtype] += t.numel()
        return dtype, at, at + t.numel()

    def ship(self, device: torch.device) -> None:
        """One host buffer, one copy; int32 pieces are cast once, together."""
        p32 = self._parts[_I32]
        if self._n[_I32] % 2:  # int32 pieces travel as int64 pairs
            p32.append(torch.zeros(1, dtype=_I64))
        k = (self._n[_I32] + 1) // 2
        h32 = torch.cat(p32).to(_I32) if p32 else torch.empty(0, dtype=_I32)
        host = torch.cat([h32.view(_I64), *self._parts[_I64]])
        dev = _to(host, device)
        self._h = {_I32: host[:k].view(_I32), _I64: host[k:]}
        self._d = {_I32: dev[:k].view(_I32), _I64: dev[k:]}

    def host(self, h: tuple[torch.dtype, int, int]) -> torch.Tensor:
        return self._h[h[0]][h[1]:h[2]]

    def dev(self, h: tuple[torch.dtype, int, int]) -> torch.Tensor:
        return self._d[h[0]][h[1]:h[2]]


@dataclass(frozen=True, eq=False)
class _ShapeTables:
    """Per-node facts of one `StepShape` as host int64 tables, built once per shape."""

    queries: torch.Tensor
    """[q_len, 2]: (node index, depth) of each query."""
    fixes: torch.Tensor
    """[f, 2]: (node, increment - 1) of each key node whose position is not the previous key's
    + 1 (tree nodes): positions are a running sum of increments."""
    last_fix: int
    """Sum of ``fixes[:, 1]``: the last key's position minus its slot index."""
    holes: torch.Tensor
    """[h, 2]: (query row, node) of each node the query does not see (mask batches)."""


@lru_cache(maxsize=4096)
def _shape_tables(s: StepShape) -> _ShapeTables:
    d = s.depths
    queries = torch.tensor([(i, d[i]) for i in range(s.query_from, s.nodes)], dtype=_I64)
    inc = [d[0] + 1] + [d[i] - d[i - 1] for i in range(1, s.kv_nodes)] if s.kv_nodes else []
    fixes = torch.tensor([(i, v - 1) for i, v in enumerate(inc) if v != 1],
                         dtype=_I64).reshape(-1, 2)
    sm = ReqForward(0, 0, 0, s.nodes, s.query_from, s.parents, s.block,
                    s.prefix_only).node_structure()
    if sm is None:  # a chain inside a masked batch: causal by node order
        sm = torch.ones(s.nodes, s.nodes, dtype=torch.bool).tril()[s.query_from:]
    holes = torch.nonzero(~sm).to(_I64).reshape(-1, 2)
    return _ShapeTables(queries, fixes, int(fixes[:, 1].sum()), holes)


class _Items:
    """A per-shape item table (a `_ShapeTables` field) laid out request by request: ``i`` and
    ``j`` are the items' two columns, ``at(col)`` puts a per-request column beside each item.
    With one shape they broadcast ([B, 1] against [n]); with several they are gathered ([T]);
    ``n`` counts the items either way."""

    def __init__(self, h: _Host, pick) -> None:
        ts = [pick(t) for t in h.tables]
        if h.of is None:
            self.n, self.b, t = ts[0].shape[0] * h.B, None, ts[0]
        else:
            sizes = torch.tensor([t.shape[0] for t in ts], dtype=_I64)
            per_req = sizes[h.of]
            self.b = torch.repeat_interleave(per_req)  # request of each item
            self.n = self.b.numel()
            first = torch.cumsum(sizes, 0) - sizes  # each shape's offset in the joined tables
            t = torch.cat(ts)[torch.arange(self.n) - (torch.cumsum(per_req, 0) - per_req)[self.b]
                              + first[h.of][self.b]]
        self.i, self.j = t[:, 0], t[:, 1]

    def at(self, col: int | torch.Tensor) -> int | torch.Tensor:
        if not isinstance(col, torch.Tensor):
            return col
        return col[:, None] if self.b is None else col[self.b]


class _Host:
    """A forward's per-request numbers as host tensors: one pass over the requests, shared by
    every layer group (they see the same requests; only window starts differ)."""

    def __init__(self, batch: ForwardBatch, need_mask: bool) -> None:
        reqs, table = batch.reqs, batch.req_to_token
        self.B = B = len(reqs)
        self.C = C = table.shape[1]
        rows = [r.row for r in reqs]
        if min(rows) < 0 or max(rows) >= table.shape[0]:
            bad = next(r for r in reqs if not 0 <= r.row < table.shape[0])
            raise IndexError(f"request {bad.rid!r}: row {bad.row} is outside req_to_token's "
                             f"{table.shape[0]} rows")
        buf = array("q", rows)  # an array fills a tensor at C speed; torch.tensor does not
        buf.extend([r.prefix_len for r in reqs])
        host = torch.frombuffer(buf, dtype=_I64)
        self.row_c, self.pre = host[:B] * C, host[B:]
        self.shapes = batch.step_shapes
        self.tables = [_shape_tables(s) for s in self.shapes]
        self.of = None  # shape index of each request, when there are several
        if len(self.shapes) > 1:
            index = {s: k for k, s in enumerate(self.shapes)}
            self.of = torch.tensor([index[r.step] for r in reqs], dtype=_I64)
        self.q_len = self._col([s.nodes - s.query_from for s in self.shapes])
        self.kvn = self._col([s.kv_nodes for s in self.shapes])
        self.fqd = self._col([s.first_query_depth for s in self.shapes])
        self.last_fix = self._col([t.last_fix for t in self.tables])
        self.kv_end = self.pre + self.kvn
        if int(self.kv_end.max()) > C:
            bad = next(r for r in reqs if r.kv_end > C)
            raise IndexError(f"request {bad.rid!r}: keys up to slot {bad.kv_end} but "
                             f"req_to_token holds {C} per row")
        self.max_q = max(s.nodes - s.query_from for s in self.shapes)
        self.total_q = B * self.q_len if self.of is None else int(self.q_len.sum())
        self.zeros = torch.zeros(B, dtype=_I64)
        self.queries = _Items(self, lambda t: t.queries)
        fixes = _Items(self, lambda t: t.fixes)
        self.fixes = fixes if fixes.n else None
        holes = _Items(self, lambda t: t.holes) if need_mask else None
        self.holes = holes if holes is not None and holes.n else None
        # Flat table indices fit int32 (almost always): the running sums are then int32, and
        # their position row is kv_pos as it is.
        self.idx_dtype = _I32 if table.numel() < 2**31 else _I64

    def _col(self, per_shape: list[int]) -> int | torch.Tensor:
        """A per-request column: a plain int when every request has one shape."""
        return per_shape[0] if self.of is None else torch.tensor(per_shape, dtype=_I64)[self.of]

    def starts(self, window: int | None) -> torch.Tensor:
        """[B] int64: each request's first key slot: ``first query position - W + 1``, never
        past its prefix (queries see the step's nodes from the prefix on)."""
        if window is None:
            return self.zeros
        return torch.minimum((self.pre + self.fqd - (window - 1)).clamp_(min=0), self.pre)


def _key_pieces(h: _Host, start: torch.Tensor, pack: _Pack) -> dict:
    """Host numbers of one start set (one or more layer groups): indptrs, and the increments
    whose running sum gives every key's flat table index (row 0) and position (row 1)."""
    kvl = h.kv_end - start
    kvptr = torch.zeros(h.B + 1, dtype=_I64)
    torch.cumsum(kvl, 0, out=kvptr[1:])
    n = int(kvptr[-1])
    first = torch.stack([h.row_c + start, start])  # [2, B]: first key's (flat index, position)
    ends = first + kvl
    if h.fixes is not None:
        ends[1] += h.last_fix
    steps = first - torch.cat([torch.ones(2, 1, dtype=_I64), ends[:, :-1]], 1)
    idx, vals = [kvptr[:-1], kvptr[:-1] + (n + 1)], [steps.reshape(-1)]
    if h.fixes is not None:  # tree nodes: a key node's position is prefix + depth
        f = h.fixes
        idx.append((f.at(kvptr[1:] - h.kvn + (n + 1)) + f.i).reshape(-1))
        vals.append((f.j + h.zeros[:, None] if f.b is None else f.j).reshape(-1))
    out = dict(n=n, kv_host=pack.add(kvptr, _I32), idx=pack.add(torch.cat(idx), _I64),
               vals=pack.add(torch.cat(vals), h.idx_dtype), mask=None)
    return out


def _mask_pieces(h: _Host, start: torch.Tensor, pack: _Pack) -> tuple:
    """(elements, indptr handle, hidden elements handle or None) of one start set's mask:
    request b's [q_len, kv_len] block is all visible but for the structure's holes."""
    kvl = h.kv_end - start
    mptr = torch.zeros(h.B + 1, dtype=_I64)
    torch.cumsum(h.q_len * kvl, 0, out=mptr[1:])
    holes = None
    if h.holes is not None:  # a hidden node's element: row start + prefix keys + node
        o = h.holes
        holes = pack.add(o.at(mptr[:-1] + kvl - h.kvn) + o.i * o.at(kvl) + o.j, _I64)
    return int(mptr[-1]), pack.add(mptr, _I32), holes


def _key_tables(p: dict, pack: _Pack, flat_table: torch.Tensor, dtype: torch.dtype):
    """(full-space key slots [n] int64, kv_pos [n] int32, mask, mask_indptr) on the device:
    one running sum gives both the flat table index and the position of every key."""
    n, device = p["n"], flat_table.device
    x = torch.ones(2 * (n + 1), dtype=dtype, device=device)
    x.index_add_(0, pack.dev(p["idx"]), pack.dev(p["vals"]))
    run = x.view(2, n + 1).cumsum_(1)
    slots = flat_table.index_select(0, run[0, :n])
    mask = mask_indptr = None
    if p["mask"] is not None:
        total, mptr, holes = p["mask"]
        mask = torch.ones(total, dtype=torch.bool, device=device)  # prefix keys: all visible
        if holes is not None:
            mask.index_fill_(0, pack.dev(holes), False)
        mask_indptr = pack.dev(mptr)
    return slots.long(), run[1, :n].to(_I32), mask, mask_indptr


def _plan_vector(batch: ForwardBatch, groups: dict[str, tuple[str, int | None]], source,
                 writes: bool, skip_translation: bool) -> dict[str, GroupPlan]:
    """Every group's tables, vectorized over requests. The per-request host numbers of all
    groups travel in one host→device copy; groups with the same window starts share one key
    list (e.g. an SWA window longer than every context); nothing is read back."""
    table, need_mask = batch.req_to_token, batch.needs_mask
    h, pack = _Host(batch, need_mask), _Pack()
    qo = torch.zeros(h.B + 1, dtype=_I64)
    torch.cumsum(h.q_len + h.zeros, 0, out=qo[1:])
    q = h.queries  # (node, depth) of each query
    qo_h, q_pos = pack.add(qo, _I32), pack.add(q.at(h.pre) + q.j, _I32)
    w_at = pack.add(q.at(h.row_c + h.pre) + q.i, _I64) if writes else None
    sets: list[tuple[torch.Tensor, dict]] = []  # distinct start sets, first seen first
    group_set = {}
    for key, (_, window) in groups.items():
        st = h.starts(window)
        k = next((i for i, (s, _) in enumerate(sets) if s is st or torch.equal(s, st)), None)
        if k is None:
            k = len(sets)
            sets.append((st, _key_pieces(h, st, pack)))
            if need_mask:
                sets[k][1]["mask"] = _mask_pieces(h, st, pack)
        group_set[key] = k
    pack.ship(table.device)
    flat = table.view(-1) if table.is_contiguous() else table.reshape(-1)
    built = [_key_tables(p, pack, flat, h.idx_dtype) for _, p in sets]
    w_full = flat.index_select(0, pack.dev(w_at)).long() if writes else None
    memo: dict[int, Locs] = {}  # one translation per full-slot tensor
    out = {}
    for key, (sub, window) in groups.items():
        p, (slots, kv_pos, mask, mask_indptr) = sets[group_set[key]][1], built[group_set[key]]
        kv, w = _space(key, sub, source, skip_translation, batch.full_id, slots, w_full, memo)
        t = AttnTables(pack.dev(qo_h), pack.dev(p["kv_host"]), kv, pack.dev(q_pos), kv_pos,
                       mask, mask_indptr, h.max_q, pack.host(qo_h), pack.host(p["kv_host"]))
        out[key] = GroupPlan(key, sub, window, t, None, w)
    return out, h.total_q


def _plan_cascade(key: str, sub_pool: str, window: int | None, batch: ForwardBatch, source,
                  writes: bool, skip_translation: bool) -> GroupPlan:
    """One group of a cascade tree forward, request by request (not vectorized yet)."""
    reqs = list(batch.reqs)
    table = batch.req_to_token
    device = table.device
    starts = [_start(r, window) for r in reqs]
    need_mask = batch.needs_mask
    slots, pre_len, kv_pos, q_pos, masks, w_slots = [], [], [], [], [], []
    for r, s in zip(reqs, starts):
        end = r.prefix_len + r.nodes
        slots.append(table[r.row, s:r.kv_end].long())
        pre_len.append(r.prefix_len - s)
        nodes_pos = r.node_positions()
        kv_pos.append(torch.cat([torch.arange(s, r.prefix_len),
                                 nodes_pos[:r.kv_end - r.prefix_len]]))
        q_pos.append(nodes_pos[r.query_from:])
        w_slots.append(table[r.row, r.prefix_len + r.query_from:end].long())
        if need_mask:
            structure = r.node_structure()
            if structure is None:  # a chain inside a tree batch: causal by slot order
                structure = torch.ones(r.nodes, r.nodes, dtype=torch.bool).tril()[r.query_from:]
            masks.append(torch.cat([torch.ones(r.q_len, r.prefix_len - s, dtype=torch.bool),
                                    structure], dim=1))
    kv, w = _space(key, sub_pool, source, skip_translation, batch.full_id, torch.cat(slots),
                   torch.cat(w_slots) if writes else None)
    qp = torch.cat(q_pos)
    lens = [t.numel() for t in slots]
    tables = _tables(kv, reqs, lens, kv_pos, qp, masks if need_mask else None, device)
    casc = _cascade(kv, reqs, lens, pre_len, kv_pos, qp, masks, device)
    return GroupPlan(key, sub_pool, window, tables, casc, w)


def _space(key: str, sub_pool: str, source, skip_translation: bool, full_id: str,
           slots: torch.Tensor, writes: torch.Tensor | None,
           memo: dict[int, Locs] | None = None) -> tuple[Locs, Locs | None]:
    """Full slots → the group's index space: translated once, here, for an SWA group.

    slots: [n] int64 full slots; writes: [total_q] int64 or None. ``memo`` (id of a full-slot
    tensor → its translation) lets groups that share a key list share its translation."""
    full_kv = Locs("full", full_id, slots)
    full_w = Locs("full", full_id, writes) if writes is not None else None
    if sub_pool != "swa" or skip_translation:
        return full_kv, full_w
    if source is None:
        raise SpaceError(f"layer group {key!r} reads an SWA sub-pool, but the resolver found "
                         "no KV source to translate full slots against")
    memo = {} if memo is None else memo

    def tr(locs: Locs) -> Locs:
        if id(locs.tensor) not in memo:
            memo[id(locs.tensor)] = source.translate(locs)
        return memo[id(locs.tensor)]
    return tr(full_kv), (tr(full_w) if full_w is not None else None)


def _cascade(kv: Locs, reqs, lens, pre_len, kv_pos, qp, masks, device):
    """Split each request's (already translated) key list into prefix and expand passes."""
    idx_pre, idx_exp, pos_pre, pos_exp, m_exp = [], [], [], [], []
    off = 0
    for r, n, p, kp, m in zip(reqs, lens, pre_len, kv_pos, masks):
        idx_pre.append(torch.arange(off, off + p))
        idx_exp.append(torch.arange(off + p, off + n))
        pos_pre.append(kp[:p])
        pos_exp.append(kp[p:])
        m_exp.append(m[:, p:])
        off += n
    pre = kv[torch.cat(idx_pre).to(kv.tensor.device)]
    exp = kv[torch.cat(idx_exp).to(kv.tensor.device)]
    prefix = _tables(pre, reqs, pre_len, pos_pre, qp, None, device)
    expand = _tables(exp, reqs, [n - p for n, p in zip(lens, pre_len)], pos_exp, qp, m_exp, device)
    return prefix, expand


def plan(batch: ForwardBatch, layers_mapping: Mapping[int, tuple[str, int]],
         windows: Mapping[int, int | None], source, *, cascade: bool = False,
         writes: bool = True, skip_spec_translation: bool = False) -> ForwardPlan:
    """Plan one forward.

    layers_mapping: the *active* pool's ``layer -> (sub_pool, local_id)`` (physical, after any
    frozen rebinding). windows: ``layer -> W or None`` (masking, a separate fact from the pool).
    source: the resolver's answer for this forward (a `KVSource` or None). cascade: build
    prefix/expand tables for tree forwards. writes: False for a runner that writes no KV
    (FROZEN_KV drafts). skip_spec_translation is the fault-injection switch that reproduces
    FA3 + EAGLE3 (sglang #24402): tree forwards keep SWA tables in full space. Only the harness
    sets it; the typed index spaces then refuse the tables.
    """
    keys: dict[str, tuple[str, int | None]] = {}
    layer_groups: dict[int, str] = {}
    for layer, (sub, _) in sorted(layers_mapping.items()):
        k = group_key(sub, windows[layer])
        keys[k] = (sub, windows[layer])
        layer_groups[layer] = k
    skip = skip_spec_translation and batch.has_tree
    if cascade and batch.has_tree:
        groups = {k: _plan_cascade(k, sub, w, batch, source, writes, skip)
                  for k, (sub, w) in keys.items()}
        total_q = batch.total_q
    else:
        groups, total_q = _plan_vector(batch, keys, source, writes, skip)
    return ForwardPlan(batch.mode, groups, layer_groups,
                       source.rule if source is not None else "none", total_q)
