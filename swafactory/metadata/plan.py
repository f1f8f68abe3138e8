"""`plan(batch, pool, source, windows) -> ForwardPlan`: all host work of a forward, done once.

For each layer group (a sub-pool and a window) it builds the kernel contract of
`swafactory.kernels`: CSR key lists in the group's typed index space, each key's and query's
position, the structure mask (trees, DFlash blocks), cascade tables, and write locations.
Full slots are translated to SWA slots here, once, *before* any split or reorder (DESIGN
invariant 1); SWA key lists are trimmed to start at ``first query position - W + 1`` (not at 0),
and their mask columns start there too (sglang #39160).

The per-request host work is done once per forward and shared by every group (`HostBatch`); all
host numbers reach the device in one copy (`Pack`), and each key list is one running sum over
increments (`key_tables`): a few device ops per group whatever the batch size, none read back.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
import torch

from swafactory.fault_counts import FAULT_COUNTS
from swafactory.kvcache.locs import Locs
from swafactory.metadata.batch import ForwardBatch, ForwardMode
from swafactory.metadata import keys_triton
from swafactory.metadata.layer_groups import group_key, groups_of
from swafactory.metadata.space import group_space
from swafactory.metadata.vector import (HostBatch, Pack, key_pieces, key_tables, mask_pieces,
                                        mask_tables, to_device)

__all__ = ["AttnTables", "GroupPlan", "MissingWord", "ForwardPlan", "PassCache", "plan", "group_key",
           "lists_past_window"]


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
    kv_indices_i32: torch.Tensor | None = None
    """[total_kv] int32: ``kv_indices``' rows as int32, when the planner wrote them (its fused
    GPU kernel does): kernels that index with int32 take them instead of casting."""
    natural: bool = False
    """Every request's keys are consecutive positions ending at its last query, its queries
    consecutive positions ending there too, and no mask (a plain chunk, extend, chain verify or
    chain draft; SWA lists trimmed to a page start included): a kernel's own causal rule with a
    window counted from ``kv_len - q_len + i`` is then exact. False when not known to hold
    (trees, blocks, prefix-only queries, cascade halves, graph capture shapes)."""

    @property
    def batch_size(self) -> int:
        return self.qo_indptr.numel() - 1

    @property
    def max_keys(self) -> int:
        """Most keys one request lists, from the host indptr (0 without one): nothing read back."""
        kv = self.kv_host
        return 0 if kv is None or kv.numel() < 2 else int((kv[1:] - kv[:-1]).max())

    @property
    def kv_rows(self) -> torch.Tensor:
        """[total_kv] the key rows a kernel indexes with: ``kv_indices_i32`` where the planner
        wrote them, else ``kv_indices``' int64 tensor."""
        return self.kv_indices_i32 if self.kv_indices_i32 is not None else self.kv_indices.tensor


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
    sink: int = 0
    """With a window: keys at positions below it stay visible too (``spec.draft_sink``); the
    lists then start at 0, and the kernel masks ``q - k < W or k < sink``."""

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
class MissingWord:
    """What the fused key-list launch found about slots (`keys_triton.FusedKeys.missing`).

    word: [2] int64 on the device (the first key, the first write row with no slot; see
    `guards.missing_check`); lists: per key list, (its host indptr [B+1] int32, its requests'
    first columns [B] int64, host): what names a missing key's request and position."""

    word: torch.Tensor
    lists: tuple[tuple[torch.Tensor, np.ndarray], ...]


@dataclass(frozen=True, eq=False)
class ForwardPlan:
    """A forward's plan: one GroupPlan per layer group, and which layer uses which."""

    mode: ForwardMode
    groups: Mapping[str, GroupPlan]
    layer_groups: Mapping[int, str]
    source_rule: str
    """Why the resolver chose its KV source ("none" when nothing is translated)."""
    total_q: int
    missing: MissingWord | None = None
    """The guards' missing-slot word, where the fused planner computed it (a GPU)."""

    def group(self, layer_id: int) -> GroupPlan:
        """The plan of ``layer_id``'s group."""
        try:
            return self.groups[self.layer_groups[layer_id]]
        except KeyError:
            raise KeyError(f"layer {layer_id} is not in this plan; layers: "
                           f"{sorted(self.layer_groups)}") from None


def _plan_vector(batch: ForwardBatch, groups: Mapping[str, tuple[str, int | None]], source,
                 writes: bool, skip_translation: bool, impl: str, page_size: int = 1,
                 flat_tree: bool = False, reads_full: bool = False, sink: int = 0
                 ) -> tuple[dict[str, GroupPlan], HostBatch, MissingWord | None]:
    """Every group's tables, vectorized over requests. The per-request host numbers of all
    groups travel in one host→device copy; groups with the same window starts share one key
    list (e.g. an SWA window longer than every context); nothing is read back. Returns the
    groups, the forward's host numbers and the fused launch's missing-slot word (None without
    it)."""
    table, need_mask = batch.req_to_token, batch.needs_mask
    h, pack = HostBatch(batch, need_mask, page_size, flat_tree), Pack()
    fused = impl == "triton" or (impl == "auto" and table.is_cuda and keys_triton.available())
    if h.of is None:  # one shape: every request has q_len queries
        qo = np.arange(0, (h.B + 1) * h.q_len, h.q_len, dtype=np.int64)
    else:
        qo = np.zeros(h.B + 1, dtype=np.int64)
        np.add.accumulate(h.q_len, out=qo[1:])
    q = h.queries  # (node, depth) of each query
    qo_h, q_pos = pack.add(qo, torch.int32), pack.add(q.at(h.pre) + q.j, torch.int32)
    w_at = pack.add(q.at(h.row_c + h.pre) + q.i, torch.int64) if writes else None
    sets: list[tuple[np.ndarray, dict]] = []  # distinct start sets, first seen first
    seen: dict[bytes, int] = {}  # a start set's bytes → its index ([B] int64: equal iff equal)
    group_set = {}
    for key, (_, window) in groups.items():
        st = h.starts(None if sink else window)  # a sink's keys lie before any window
        k = seen.setdefault(st.tobytes(), len(sets))
        if k == len(sets):
            sets.append((st, key_pieces(h, st, pack, running=not fused)))
            if need_mask:
                sets[k][1]["mask"] = mask_pieces(h, st, pack)
        group_set[key] = k
    swa = {k for k, (sub, _) in groups.items()
           if sub == "swa" and not (skip_translation or reads_full)}
    job = None
    if fused:  # translate where an SWA group reads a list (and its writes), in the same launch
        read = {group_set[k] for k in swa} if source is not None else ()
        tr = [i in read for i in range(len(sets))]
        job = keys_triton.fused_key_job(h, [p for _, p in sets], tr, pack, w_at, any(tr))
    pack.ship(table.device)
    flat = table.view(-1) if table.is_contiguous() else table.reshape(-1)
    computed: dict[int, torch.Tensor] = {}  # id of a full-slot tensor → its SWA slots
    fk = missing = None
    if job is not None:
        fk = keys_triton.run_fused(job, pack, flat, source.mapping.table if any(job.translate)
                                   else None)
        built = [(kl.full64, kl.pos, *mask_tables(p, pack, flat.device))
                 for kl, (_, p) in zip(fk.lists, sets)]
        w_full = fk.w64
        for kl in fk.lists:
            if kl.swa64 is not None:
                computed[id(kl.full64)] = kl.swa64
        if fk.wswa64 is not None:
            computed[id(w_full)] = fk.wswa64
    else:
        built = [key_tables(p, pack, flat, h.idx_dtype) for _, p in sets]
        w_full = flat.index_select(0, pack.dev(w_at)).long() if writes else None
    # each set's key indptr sliced once, shared by its groups (and the missing word)
    kv_host = [pack.host(p["kv_host"]) for _, p in sets]
    kv_dev = [pack.dev(p["kv_host"]) for _, p in sets]
    if fk is not None:
        missing = MissingWord(fk.missing, tuple((kv_host[i], p["start"])
                                                for i, (_, p) in enumerate(sets)))
    memo: dict[int, Locs] = {}  # one translation per full-slot tensor
    out = {}
    qo_dev, qo_host, q_pos_dev = pack.dev(qo_h), pack.host(qo_h), pack.dev(q_pos)  # shared
    for key, (sub, window) in groups.items():
        i = group_set[key]
        slots, kv_pos, mask, mask_indptr = built[i]
        kv, w = group_space(key, sub, source, skip_translation, batch.full_id, slots, w_full, memo,
                       computed, reads_full)
        i32 = None
        if fk is not None:  # the kernel wrote the list's int32 rows in the group's space too
            kl = fk.lists[i]
            i32 = kl.full32 if kv.space == "full" else kl.swa32
        t = AttnTables(qo_dev, kv_dev[i], kv, q_pos_dev, kv_pos, mask,
                       mask_indptr, h.max_q, qo_host, kv_host[i], i32,
                       natural=not need_mask)  # chains only: keys end at the last query
        out[key] = GroupPlan(key, sub, window, t, None, w, sink if window is not None else 0)
    return out, h, missing


def _cumsum0(x: torch.Tensor) -> torch.Tensor:
    """[n+1] int64 offsets of host lengths ``x`` [n]."""
    out = torch.zeros(x.numel() + 1, dtype=torch.int64)
    torch.cumsum(x, 0, out=out[1:])
    return out


def _split_cascade(g: GroupPlan, kv_nodes: torch.Tensor, page_size: int = 1) -> GroupPlan:
    """``g`` with its cascade: the (already translated) key list of each request split into a
    mask-free prefix pass (its committed keys) and an expand pass (the step's nodes, with their
    structure columns of the mask), vectorized like the main tables: the per-request numbers come
    from host lengths in one copy, and nothing is read back.

    kv_nodes: [B] int64 on the host, the step's nodes among each request's keys. With pages
    (page_size > 1) the expand pass starts on the page that holds the first node: its committed
    keys before the nodes are visible to every query (the mask's columns say so), and both
    passes start on a page (the key list does), as a kernel reading whole pages needs."""
    t = g.tables
    B = t.batch_size
    kv_host = t.kv_host.long()
    kvl = kv_host[1:] - kv_host[:-1]
    q_len = (t.qo_host[1:] - t.qo_host[:-1]).long()
    pre = kvl - kv_nodes
    if page_size > 1:
        pre = pre - pre % page_size
    exp = kvl - pre
    pre_ptr, exp_ptr, m_ptr = _cumsum0(pre), _cumsum0(exp), _cumsum0(q_len * exp)
    main_mptr = _cumsum0(q_len * kvl)
    host = torch.cat([pre, exp, q_len * exp, pre_ptr, exp_ptr, m_ptr, kv_host[:-1],
                      main_mptr[:-1], kvl])
    device = t.qo_indptr.device
    d = to_device(host, device)
    pre_d, exp_d, mexp_d = d[:B], d[B:2 * B], d[2 * B:3 * B]
    pre_ptr_d, exp_ptr_d, m_ptr_d = (d[3 * B + i * (B + 1):3 * B + (i + 1) * (B + 1)]
                                     for i in range(3))
    kv0_d, mm0_d, kvl_d = (d[6 * B + 3 + i * B:6 * B + 3 + (i + 1) * B] for i in range(3))
    ids = torch.arange(B, device=device)

    def each(lens: torch.Tensor, ptr: torch.Tensor, total: int):
        """(request, offset in it) of every element: ``total`` is host-known."""
        b = torch.repeat_interleave(ids, lens, output_size=total)
        return b, torch.arange(total, device=device) - ptr[b]

    b, o = each(pre_d, pre_ptr_d, int(pre_ptr[-1]))
    src_pre = kv0_d[b] + o
    b, o = each(exp_d, exp_ptr_d, int(exp_ptr[-1]))
    src_exp = kv0_d[b] + pre_d[b] + o
    b, o = each(mexp_d, m_ptr_d, int(m_ptr[-1]))
    i = torch.div(o, exp_d[b], rounding_mode="floor")
    src_m = mm0_d[b] + i * kvl_d[b] + pre_d[b] + (o - i * exp_d[b])
    i32 = torch.int32
    prefix = AttnTables(t.qo_indptr, pre_ptr_d.to(i32), t.kv_indices[src_pre], t.q_pos,
                        t.kv_pos[src_pre], None, None, t.max_q_len, t.qo_host, pre_ptr.to(i32))
    expand = AttnTables(t.qo_indptr, exp_ptr_d.to(i32), t.kv_indices[src_exp], t.q_pos,
                        t.kv_pos[src_exp], t.mask[src_m], m_ptr_d.to(i32), t.max_q_len,
                        t.qo_host, exp_ptr.to(i32))
    return replace(g, cascade=(prefix, expand))


def lists_past_window(groups: Mapping[str, GroupPlan], narrower: int = 0) -> bool:
    """Whether a windowed group lists, for some request, more than ``window - narrower`` keys
    (from the host indptr, nothing read back): its last query then sees a key a window of that
    width excludes, so planning without the window (or one ``narrower`` too wide) changes a
    read. Fault accounting only (`swafactory.fault_counts`)."""
    return any(g.window is not None and g.tables.max_keys > g.window - narrower
               for g in groups.values())


def _flat_bound_cuts(batch: ForwardBatch, groups: Mapping[str, GroupPlan]) -> bool:
    """tree_mask_not_rebased's accounting: some node sits deeper in slot order than in the tree
    and its flat window bound (prefix + slot - W + 1) is past key 0, so it loses in-window keys."""
    ws = [g.window for g in groups.values() if g.window is not None]
    if not ws:
        return False
    W = min(ws)
    return any(r.prefix_len + i - W + 1 > 0 for r in batch.reqs
               for i, d in enumerate(r.depths) if d < i)


def plan(batch: ForwardBatch, layers_mapping: Mapping[int, tuple[str, int]],
         windows: Mapping[int, int | None], source, *, cascade: bool = False,
         writes: bool = True, skip_spec_translation: bool = False,
         impl: str = "auto", page_size: int = 1,
         plan_without_window: bool = False, tree_mask_not_rebased: bool = False,
         untranslated: bool = False, reads_untranslated: bool = False,
         sink: int = 0) -> ForwardPlan:
    """Plan one forward.

    layers_mapping: the *active* pool's ``layer -> (sub_pool, local_id)`` (physical, after any
    frozen rebinding). windows: ``layer -> W or None`` (masking, a separate fact from the pool).
    source: the resolver's answer for this forward (a `KVSource` or None). cascade: build
    prefix/expand tables for tree forwards. writes: False for a runner that writes no KV
    (FROZEN_KV drafts). skip_spec_translation is the fault-injection switch that reproduces
    FA3 + EAGLE3 (sglang #24402): tree forwards read SWA groups' key lists (prefix and draft
    tables) in full space, while their writes stay translated (sglang's pool translates its
    own writes). Only the faults set it; the typed index spaces then refuse the tables. impl: how the key lists are built:
    ``torch`` (a running sum and a gather per list), ``triton`` (every list, its translation
    and the write slots in one launch: `keys_triton`), ``auto`` (triton on CUDA tables).
    page_size: the pool's; key lists (and cascade halves) then start on a page start (SWA
    window starts are floored to one), so a kernel can read the pool's own pages.
    plan_without_window: the fault switch of sglang #31501: windowed groups keep their trimmed
    key lists but are planned with no window, so no kernel masks it. tree_mask_not_rebased:
    the switch of sglang #39160: lists are trimmed by depth as always, but tree nodes' positions
    (and so the window bound) come from their flat slot index. untranslated: the switch of
    sglang #26957: every SWA group keeps full-space tables in every mode (a runner that decided
    its pool is not split), so full slots index the smaller SWA buffer. reads_untranslated: the
    switch of sglang #27737: SWA groups write at their translated slots but read full-space key
    lists (a read path that missed the runner's SWA-backed pool). sink: a draft window's sink
    (``spec.draft_sink``): windowed groups list keys from position 0 and say the sink.
    """
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(f"impl must be 'auto', 'torch' or 'triton', got {impl!r}")
    keys, layer_groups = groups_of(layers_mapping, windows)
    tree_reads = skip_spec_translation and batch.has_tree  # its writes stay translated
    groups, h, missing = _plan_vector(batch, keys, source, writes, untranslated, impl, page_size,
                                      tree_mask_not_rebased and batch.has_tree,
                                      reads_untranslated or tree_reads, sink)
    if cascade and batch.has_tree:  # split after translation (DESIGN invariant 1)
        kv_nodes = torch.from_numpy(np.asarray(h.kvn + h.zeros))
        groups = {k: _split_cascade(g, kv_nodes, page_size) for k, g in groups.items()}
    if tree_reads and not untranslated and any(g.sub_pool == "swa" for g in groups.values()):
        FAULT_COUNTS.acted("skip_spec_translation")  # an SWA group read full-space tables
    if tree_mask_not_rebased and batch.has_tree and _flat_bound_cuts(batch, groups):
        FAULT_COUNTS.acted("tree_mask_not_rebased")
    if plan_without_window:  # FAULT: the window is dropped from the plan, the trim stays
        if lists_past_window(groups):
            FAULT_COUNTS.acted("plan_without_window")
        groups = {k: replace(g, window=None) for k, g in groups.items()}
    return ForwardPlan(batch.mode, groups, layer_groups,
                       source.rule if source is not None else "none", h.total_q, missing)
