"""Every key list of a forward in one Triton launch: slots, positions, translation, write slots.

`metadata.vector.key_tables` builds one start set's key list from torch ops (a running sum, a
gather, casts: seven device ops per set, plus a translation launch per SWA list and two ops for
the write slots). On a GPU each op costs a launch of host time (5–15 µs), which is most of a
decode forward's planning. Here one program per (request, key chunk, list) computes its keys
directly from the request's host numbers:

    key o of request b in a list starting at slot ``start``:
        flat index  row_c + start + o                  (the step's nodes follow the prefix)
        position    start + o            for a prefix key (o < pre - start)
                    pre + depth[node]    for node ``o - (pre - start)`` of the step
        slot        req_to_token.flat[flat index]        (full space)
        swa slot    mapping[slot], 0 outside it          (only lists an SWA group reads)

and writes them as int64 (the typed `Locs`), int32 (what FlashInfer and our kernels index with)
and the int32 positions. The last list axis is the write slots: ``flat[w_at]`` and their
translation. The per-request numbers travel in the planner's one host→device copy (`Pack`);
a directory in it says where each list's pieces and outputs are, so the launch takes a fixed
number of arguments whatever the number of lists. Nothing is read back.

The CPU path keeps `key_tables` (the interpreter is slow); tests run this kernel under
``TRITON_INTERPRET=1`` against it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from swafactory.guards import LIST_SHIFT, NO_MISS
from swafactory.kernels.triton_launch import launch

__all__ = ["BLOCK", "FusedJob", "FusedKeys", "KeyList", "available",
           "fused_key_job", "run_fused"]

BLOCK = 1024  # keys per program: the kernel is a gather, the block only amortises its setup
_I32, _I64 = torch.int32, torch.int64


def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernel() -> Any:
    # built once per process, at the first plan: triton.jit reads TRITON_INTERPRET as it
    # decorates (fixed from then on, as for every kernel of ours), so planning reads no
    # environment
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["map_len", "K64", "dir_at", "S", "rowc_at", "pre_at",
                                   "depoff_at", "dep_at", "w_at", "total_q", "wfull_at", "wtr_at",
                                   "err_at"])
    def build_keys(p64, p32, table, mapping, map_len, out64, out32, K64, dir_at, S, rowc_at,
                   pre_at, depoff_at, dep_at, w_at, total_q, wfull_at, wtr_at, err_at,
                   BLOCK: tl.constexpr):
        # p64 / p32: the shipped pack as int64 / int32 words; its int32 pieces come first, its
        # int64 pieces from word K64 on (every *_at of an int64 piece is relative to K64)
        b = tl.program_id(0)
        c = tl.program_id(1)
        s = tl.program_id(2)
        o = c * BLOCK + tl.arange(0, BLOCK)
        p64 += K64
        if s < S:
            d = p64 + dir_at + s * 8
            kvp = tl.load(d)
            base = tl.load(p32 + kvp + b)
            n = tl.load(p32 + kvp + b + 1) - base
            live = o < n
            st = tl.load(p64 + tl.load(d + 1) + b)
            pre = tl.load(p64 + pre_at + b)
            flat = tl.load(p64 + rowc_at + b) + st + o
            slot = tl.load(table + flat, mask=live, other=0).to(tl.int64)
            node = o - (pre - st)
            is_node = live & (node >= 0)
            dep = tl.load(p32 + dep_at + tl.load(p64 + depoff_at + b) + node, mask=is_node,
                          other=0)
            pos = tl.where(is_node, pre + dep, st + o)
            k = base + o
            if err_at >= 0:  # the guards' word: the first key with no slot (entry 0), by list
                # (the literals are guards.LIST_SHIFT and guards.NO_MISS: a jit reads no globals)
                code = tl.min(tl.where(live & (slot == 0), s.to(tl.int64) * 1099511627776
                                       + k.to(tl.int64), 4611686018427387904))
                if code < 4611686018427387904:
                    tl.atomic_min(p64 + err_at, code)
            tl.store(out64 + tl.load(d + 2) + k, slot, mask=live)
            tl.store(out32 + tl.load(d + 4) + k, slot.to(tl.int32), mask=live)
            tl.store(out32 + tl.load(d + 6) + k, pos.to(tl.int32), mask=live)
            tr64 = tl.load(d + 3)
            if tr64 >= 0:  # an SWA group reads this list: translate once, here
                inside = (slot >= 0) & (slot < map_len)
                sw = tl.load(mapping + slot, mask=live & inside, other=0)
                tl.store(out64 + tr64 + k, sw, mask=live)
                tl.store(out32 + tl.load(d + 5) + k, sw.to(tl.int32), mask=live)
        else:  # the write slots, spread over the (request, chunk) programs
            i = (b * tl.num_programs(1) + c) * BLOCK + tl.arange(0, BLOCK)
            live = i < total_q
            slot = tl.load(table + tl.load(p64 + w_at + i, mask=live, other=0), mask=live,
                           other=0).to(tl.int64)
            tl.store(out64 + wfull_at + i, slot, mask=live)
            if err_at >= 0:  # the first write row with no slot
                code = tl.min(tl.where(live & (slot == 0), i.to(tl.int64), 4611686018427387904))
                if code < 4611686018427387904:
                    tl.atomic_min(p64 + err_at + 1, code)
            if wtr_at >= 0:
                inside = (slot >= 0) & (slot < map_len)
                sw = tl.load(mapping + slot, mask=live & inside, other=0)
                tl.store(out64 + wtr_at + i, sw, mask=live)

    return build_keys


@dataclass(frozen=True)
class KeyList:
    """One list's outputs, views of the launch's two buffers: ``full64`` [n] int64 full slots,
    ``full32`` the same as int32, ``pos`` [n] int32 positions; where an SWA group reads the
    list, ``swa64`` / ``swa32`` its translation (else None)."""

    full64: torch.Tensor
    full32: torch.Tensor
    pos: torch.Tensor
    swa64: torch.Tensor | None
    swa32: torch.Tensor | None


@dataclass(frozen=True)
class FusedKeys:
    """A forward's fused outputs: one `KeyList` per start set, and the write slots ``w64``
    [total_q] int64 (full space) and ``wswa64`` (translated; None when no SWA group reads)."""

    lists: tuple[KeyList, ...]
    w64: torch.Tensor | None
    wswa64: torch.Tensor | None
    missing: torch.Tensor
    """[2] int64 on the device, the guards' word: the smallest code of a key whose full slot is
    0 (the dummy row: a position with no slot; ``list * LIST_SHIFT + key``), then of a write
    row whose slot is 0; `NO_MISS` where there is none. Written by the same launch."""


@dataclass(frozen=True)
class FusedJob:
    """What `run_fused` launches: the grid, the scalar arguments (pack offsets, the directory's
    place) and the output layout, split once into views: int64 buffer = per list full
    [, swa], then writes [, swa writes]; int32 buffer = per list full [, swa], pos."""

    translate: tuple[bool, ...]
    write: bool
    write_translate: bool
    grid: tuple[int, int, int]
    scalars: tuple[int, ...]
    """(directory, lists, row_c, pre, depth offsets, depths, write indices, total_q, full write
    out, swa write out, the guards' word): the kernel's arguments after ``K64``."""
    sizes64: tuple[int, ...]
    sizes32: tuple[int, ...]


assert (LIST_SHIFT, NO_MISS) == (1099511627776, 4611686018427387904)  # the kernel's literals
_NO_MISS_WORD = np.full(2, NO_MISS, dtype=np.int64)
_NO_MISS_WORD.flags.writeable = False


@functools.lru_cache(maxsize=256)
def _depth_table(shapes: tuple) -> tuple[np.ndarray, np.ndarray]:
    """(every shape's key-node depths, concatenated (and a trailing 0), each shape's offset in
    it), by the shapes' order in `HostBatch.of`: an engine steps through a handful of shapes,
    so this is built once per set of shapes, not per forward. Read-only arrays."""
    depths, off = [], []
    for sh in shapes:
        off.append(sum(len(x) for x in depths))
        depths.append(np.asarray(sh.depths[:sh.kv_nodes], dtype=np.int64))
    dep = np.concatenate(depths + [np.zeros(1, dtype=np.int64)])
    off_a = np.asarray(off, dtype=np.int64)
    dep.flags.writeable = off_a.flags.writeable = False  # shared by every forward of the shapes
    return dep, off_a


def fused_key_job(h, sets: list[dict], translate: list[bool], pack, w_at,
                  write_translate: bool) -> FusedJob:
    """Queue the kernel's host numbers in ``pack`` (before it ships): the per-request columns,
    each list's start, the step shapes' node depths, and the directory.

    h: the forward's `HostBatch`; sets: `key_pieces` of each list (``n``, ``kv_host``,
    ``start``); translate: per list, whether an SWA group reads it; w_at: the write slots' flat
    indices (a `Pack` handle) or None."""
    dep, off = _depth_table(h.shapes)
    depoff = h.zeros if h.of is None else off[h.of]
    rowc, pre = pack.add(h.row_c, _I64), pack.add(h.pre, _I64)
    depoff_h, dep_h = pack.add(depoff, _I64), pack.add(dep, _I32)
    sizes64: list[int] = []
    sizes32: list[int] = []
    dirs = []
    for s, p in enumerate(sets):  # each output's offset is the sum of the sizes before it
        n, tr = p["n"], translate[s]
        f64, t64 = sum(sizes64), (sum(sizes64) + n if tr else -1)
        sizes64 += [n, n] if tr else [n]
        f32, t32 = sum(sizes32), (sum(sizes32) + n if tr else -1)
        sizes32 += [n, n] if tr else [n]
        pos = sum(sizes32)
        sizes32.append(n)
        dirs.append([p["kv_host"][1], pack.add(p["start"], _I64)[1], f64, t64, f32, t32, pos, 0])
    total_q = h.total_q if w_at is not None else 0
    wfull = wtr = -1
    if w_at is not None:
        wfull = sum(sizes64)
        sizes64.append(total_q)
        if write_translate:
            wtr = sum(sizes64)
            sizes64.append(total_q)
    d = pack.add(np.asarray(dirs, dtype=np.int64).reshape(-1), _I64)
    err = pack.add(_NO_MISS_WORD, _I64)  # shipped with the rest: no fill launch
    # the grid from host numbers (numpy): the longest list a request has, nothing read back
    if any(p["start"] is h.zeros for p in sets):  # a list from slot 0 is the longest there is
        longest = h.kv_max
    else:
        longest = max((int(p["kvl"].max()) for p in sets), default=0)
    longest = max(longest, h.max_q, 1)
    grid = (h.B, -(-longest // BLOCK), len(sets) + (w_at is not None))
    scalars = (d[1], len(sets), rowc[1], pre[1], depoff_h[1], dep_h[1],
               w_at[1] if w_at is not None else 0, total_q, wfull, wtr, err[1])
    return FusedJob(tuple(translate), w_at is not None, write_translate, grid, scalars,
                    tuple(sizes64), tuple(sizes32))


def run_fused(job: FusedJob, pack, flat_table: torch.Tensor,
              mapping: torch.Tensor | None) -> FusedKeys:
    """Launch ``job`` (after ``pack`` shipped) and return its outputs as views.

    flat_table: ``req_to_token`` flattened, int32/int64; mapping: the full→SWA table [m] int64,
    or None when no list is translated."""
    device = flat_table.device
    n64, n32 = sum(job.sizes64), sum(job.sizes32)
    out64 = torch.empty(max(n64, 1), dtype=_I64, device=device)  # never a null pointer
    out32 = torch.empty(max(n32, 1), dtype=_I32, device=device)
    p64, p32, k = pack.words()
    mp = mapping if mapping is not None else flat_table
    if job.grid[0] and job.grid[1]:  # the compiled handle after the first launch (`launch`)
        launch(_kernel(), job.grid,
               (p64, p32, flat_table, mp, mp.numel() if mapping is not None else 0, out64, out32,
                k, *job.scalars), (BLOCK,), device.index or 0)
    # one op for every view (split_with_sizes: Tensor.split's Python wrapper costs twice as much);
    # the buffers are sliced only when empty (one element, never a null pointer)
    v64 = iter((out64 if n64 else out64[:0]).split_with_sizes(job.sizes64))
    v32 = iter((out32 if n32 else out32[:0]).split_with_sizes(job.sizes32))
    lists = []
    for tr in job.translate:
        full64, swa64 = next(v64), (next(v64) if tr else None)
        full32, swa32 = next(v32), (next(v32) if tr else None)
        lists.append(KeyList(full64, full32, next(v32), swa64, swa32))
    w64 = next(v64) if job.write else None
    wswa64 = next(v64) if job.write and job.write_translate else None
    return FusedKeys(tuple(lists), w64, wswa64, p64[k + job.scalars[-1]:k + job.scalars[-1] + 2])
