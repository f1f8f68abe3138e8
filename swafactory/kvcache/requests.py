"""Per-request slot bookkeeping: extend, decode, draft reject, window eviction, finish, leaks.

A request owns a row of `ReqToToken` (its full slot per position), ``kv_len`` allocated positions
and ``swa_evicted``, the frontier below which its SWA slots were freed (sglang
``ReqKvInfo(kv_allocated_len, swa_evicted_seqlen)``). Position p of a request lives in its page
``p // page_size`` at offset ``p % page_size``: a request starts on a fresh page and continues its
last page, so pages and positions line up, and a page is freed only when no kept position is in it.

The books read `ReqToToken.host` and the allocators' host books only: the device table is written
(host to device copies, which do not wait for queued kernels), never read back, so an engine whose
host runs a forward ahead is not stalled by its own slot allocation.

A book is found from its table (`books_of`): the guards name, on an error only, which request
holds a row, which finished and where a request's SWA frontier is (`backend.slot_guard`).
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from numbers import Integral
from typing import Hashable, Union

import torch

from swafactory.errors import CapacityError
from swafactory.fault_counts import FAULT_COUNTS
from swafactory.kvcache.allocator import SWAAllocator, TokenAllocator
from swafactory.kvcache.locs import Locs
from swafactory.kvcache.pool import ReqToToken, host_to_device

__all__ = ["RequestSlots", "ReqState", "books_of"]

Allocator = Union[TokenAllocator, SWAAllocator]
_BOOKS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id(table) → its book
_FINISHED_KEPT = 1024  # finished requests remembered, for the guards' messages


def books_of(table) -> RequestSlots | None:
    """The `RequestSlots` whose `ReqToToken` has ``table`` (the tensor a `ForwardBatch` holds),
    or None: the guards read it to say how a slot went missing (host books only)."""
    book = _BOOKS.get(id(table))
    return book if book is not None and book.req_to_token.table is table else None


@dataclass
class ReqState:
    """One request's share of the pools."""

    row: int
    """Its `ReqToToken` row."""
    kv_len: int = 0
    """Positions ``[0, kv_len)`` have a full slot (committed tokens plus pending draft tokens)."""
    swa_evicted: int = 0
    """SWA slots of positions ``[0, swa_evicted)`` are freed; always a multiple of page_size."""


class RequestSlots:
    """Allocates and frees a batch's slots request by request, over one allocator.

    ``allocator``: a `TokenAllocator` (unsplit pool) or `SWAAllocator`. ``req_to_token``: the
    table that records each request's full slots; its entries past ``kv_len`` stay 0.
    """

    def __init__(self, allocator: Allocator, req_to_token: ReqToToken) -> None:
        self.allocator, self.req_to_token = allocator, req_to_token
        self.page_size = allocator.page_size
        self.reqs: dict[Hashable, ReqState] = {}
        self.row_owners: list[Hashable | None] = [None] * req_to_token.max_requests
        """Row → the open request holding it (None: free)."""
        self.finished: dict[Hashable, int] = {}
        """The last finished requests (up to 1024) → the row each held, oldest first."""
        _BOOKS[id(req_to_token.table)] = self

    def open(self, rid: Hashable) -> ReqState:
        """Start request ``rid`` with no tokens; raises when ``req_to_token`` has no free row."""
        if rid in self.reqs:
            raise ValueError(f"request {rid!r} is already open")
        row = self.req_to_token.alloc()
        if row is None:
            raise RuntimeError(f"no free ReqToToken row for request {rid!r} "
                               f"({self.req_to_token.max_requests} requests at most)")
        self.reqs[rid] = state = ReqState(row)
        self.row_owners[row] = rid
        self.finished.pop(rid, None)
        return state

    def slots(self, rid: Hashable, start: int = 0, end: int | None = None) -> Locs:
        """Full slots of positions ``[start, end)`` (default: all allocated), ``[n]`` int64."""
        s = self._get(rid)
        end = s.kv_len if end is None else end
        return Locs("full", self.allocator.full_id,
                    self.req_to_token.table[s.row, start:end].long())

    def extend(self, rid: Hashable, n: int) -> Locs:
        """Allocate positions ``[kv_len, kv_len + n)``; their full slots, ``[n]`` int64.

        Raises `CapacityError` (nothing changed) when the pools are short."""
        return self.extend_batch([rid], [n])

    def decode(self, rids: list[Hashable]) -> Locs:
        """One new position per request, in ``rids`` order; ``[bs]`` full slots.

        Raises `CapacityError` (nothing changed) when the pools are short."""
        return self.extend_batch(rids, [1] * len(rids))

    def extend_batch(self, rids: list[Hashable], lens: list[int]) -> Locs:
        """Positions ``[kv_len, kv_len + n)`` for each (rid, n); request-major full slots.

        Raises `CapacityError` naming the short pool, what was asked and what was free, with
        nothing allocated, when the pools lack the pages (an engine retracts or waits then)."""
        states = [self._get(r) for r in rids]
        if len(set(rids)) != len(rids):
            raise ValueError("a request appears twice in one batch")
        lens = list(lens)
        if len(lens) != len(rids):
            raise ValueError(f"requests {rids!r} need one length each, got {len(lens)}: {lens!r}")
        for n, r in zip(lens, rids):
            if isinstance(n, bool) or not isinstance(n, Integral) or n < 0:
                raise ValueError(f"request {r!r}: cannot extend by {n!r} positions; n must be an "
                                 "int >= 0")
        lens = [int(n) for n in lens]
        for s, n, r in zip(states, lens, rids):
            if s.kv_len + n > self.req_to_token.max_context:
                raise ValueError(f"request {r!r}: {s.kv_len} + {n} tokens exceed max_context "
                                 f"{self.req_to_token.max_context}")
        # Every request's last slot in one gather from the host mirror (a request with none
        # reads its own slot 0, the dummy, which `alloc_extend` takes as "start a fresh page").
        rows = torch.tensor([s.row for s in states], dtype=torch.int64)
        cols = torch.tensor([max(s.kv_len - 1, 0) for s in states], dtype=torch.int64)
        has = torch.tensor([s.kv_len > 0 for s in states], dtype=torch.bool)
        last = torch.where(has, self.req_to_token.host[rows, cols].long(), 0)
        slots = self.allocator.alloc_extend_host(last, lens)
        if slots is None:
            raise self._short(rids, lens, self.allocator.pages_needed(last, lens))
        # One scatter for the whole batch: (row, position) of every new slot, request-major.
        n_new = torch.tensor(lens, dtype=torch.int64)
        at_row = torch.repeat_interleave(rows, n_new)
        first = torch.cumsum(n_new, 0) - n_new
        kv_len = cols + has.long()
        at_col = torch.arange(int(n_new.sum())) - torch.repeat_interleave(first - kv_len, n_new)
        dev = self.req_to_token.write(at_row, at_col, slots)
        want = self.allocator.device
        if dev.device.type != want.type or want.index not in (None, dev.device.index):
            dev = host_to_device(slots, want)  # a table on another device than the allocator
        for s, n in zip(states, lens):
            s.kv_len += n
        return Locs("full", self.allocator.full_id, dev)

    def _short(self, rids: list[Hashable], lens: list[int], pages: int) -> CapacityError:
        P = self.page_size
        free = self.allocator.free_by_space()
        short = [k for k, v in free.items() if v < pages * P] or list(free)
        who = f"request {rids[0]!r}" if len(rids) == 1 else f"requests {rids!r}"
        asked = (f"{sum(lens)} new slots" if P == 1 else
                 f"{sum(lens)} new positions, {pages} new pages of {P} slots ({pages * P} slots)")
        have = ", ".join(f"{k!r} has {v}" for k, v in free.items())
        return CapacityError(f"pool {' and '.join(map(repr, short))} is short: {who} asked for "
                             f"{asked}; {have} free")

    def truncate(self, rid: Hashable, new_len: int, *,
                 leak_rejected_draft_slots: bool = False,
                 premature_free_window: int | None = None) -> int:
        """Release positions ``[new_len, kv_len)`` (rejected draft tokens); returns pages freed.

        Pages entirely past ``new_len`` are freed, full and SWA together; the page holding
        position ``new_len - 1`` stays with the request and its later slots are reused by the
        next extend. ``leak_rejected_draft_slots`` is the fault-injection switch: only the full
        pages are freed, the SWA pages behind them stay allocated and still mapped (an engine
        that frees rejected drafts in the full allocator but never calls ``free_swa``).
        ``premature_free_window`` is the switch of vLLM #47728: first evict out of that window
        against the step's speculative length, as if every draft were accepted, then move the
        boundary back (SWA slots still in the window are freed).
        """
        s = self._get(rid)
        if premature_free_window and isinstance(self.allocator, SWAAllocator):
            self.evict_out_of_window(rid, s.kv_len, premature_free_window)  # FAULT
            # acted: the frontier passed where eviction at the kept length would stop
            if s.swa_evicted > max(0, new_len - premature_free_window + 1) // self.page_size \
                    * self.page_size:
                FAULT_COUNTS.acted("premature_free_on_reject")
        if not 0 <= new_len <= s.kv_len:
            raise ValueError(f"request {rid!r}: cannot truncate {s.kv_len} positions to {new_len}")
        if new_len < s.swa_evicted:
            raise ValueError(f"request {rid!r}: cannot truncate to {new_len}, below its SWA "
                             f"eviction frontier {s.swa_evicted}")
        P = self.page_size
        keep_pages = math.ceil(new_len / P)
        row = self.req_to_token.host[s.row]
        drop = row[keep_pages * P:s.kv_len:P].long() // P
        if leak_rejected_draft_slots and isinstance(self.allocator, SWAAllocator):
            self.allocator.full.free_pages(drop)  # FAULT: free_swa skipped
            FAULT_COUNTS.acted("leak_rejected_draft_slots", drop.numel())
        else:
            self.allocator.free_pages(drop)
        self.req_to_token.zero(s.row, new_len, s.kv_len)
        s.kv_len = new_len
        return drop.numel()

    def evict_out_of_window(self, rid: Hashable, seq_len: int, window: int,
                            interval: int = 1, *, paged_free_stale_mapping: bool = False) -> int:
        """Free the SWA slots no later query can see; returns the number of positions evicted.

        ``seq_len``: the first position a later query can have (the committed length). A query at
        ``q >= seq_len`` sees keys ``q-W+1 … q``, so positions ``< seq_len - W + 1`` are dead.
        The frontier is page-floored (whole SWA pages are freed), never moves back, and moves only
        when it would advance by at least ``interval`` positions (batching the frees, as sglang's
        ``SGLANG_SWA_EVICTION_INTERVAL``). Full slots stay until the request finishes.
        ``paged_free_stale_mapping`` is the fault switch of sglang #27779: the frontier is not
        floored, the pages of the evicted positions are freed whole, and only those positions'
        mapping entries are zeroed (`SWAAllocator.free_swa_pages`' ``stale_rows``).
        """
        if not isinstance(self.allocator, SWAAllocator):
            raise TypeError("window eviction needs an SWAAllocator (the pool is not split)")
        if window < 1 or interval < 1:
            raise ValueError(f"window and interval must be >= 1, got {window}, {interval}")
        s = self._get(rid)
        if seq_len > s.kv_len:
            raise ValueError(f"request {rid!r}: seq_len {seq_len} exceeds its {s.kv_len} "
                             "allocated positions")
        P = self.page_size
        frontier = max(0, seq_len - window + 1)
        if not paged_free_stale_mapping:
            frontier = frontier // P * P
        if frontier - s.swa_evicted < interval:
            return 0
        row = self.req_to_token.host[s.row]
        if paged_free_stale_mapping:  # FAULT: the pages of the positions, their entries only
            stale = row[s.swa_evicted:frontier].long()
            pages = torch.unique(stale // P)
            if frontier % P:  # acted: the frontier's page is freed, its later rows stay mapped
                FAULT_COUNTS.acted("paged_free_stale_mapping")
        else:
            stale, pages = None, row[s.swa_evicted:frontier:P].long() // P
        self.allocator.free_swa_pages(pages, stale_rows=stale)
        evicted, s.swa_evicted = frontier - s.swa_evicted, frontier
        return evicted

    def finish(self, rid: Hashable) -> None:
        """Free every page of ``rid`` (full, and SWA pages not yet evicted) and its row."""
        s = self._get(rid)
        P = self.page_size
        pages = self.req_to_token.host[s.row, 0:s.kv_len:P].long() // P
        self.allocator.free_pages(pages)
        self.req_to_token.free(s.row)
        del self.reqs[rid]
        self.row_owners[s.row] = None
        self.finished[rid] = s.row
        if len(self.finished) > _FINISHED_KEPT:
            del self.finished[next(iter(self.finished))]

    def held_pages(self) -> dict[str, torch.Tensor]:
        """Space id → ``[k]`` int64 page ids the open requests hold: the full pages of positions
        ``[0, kv_len)`` and, on a split pool, the SWA pages of ``[swa_evicted, kv_len)``; on
        the allocator's device (`held_pages_host`: the same on the host)."""
        return {k: host_to_device(v, self.allocator.device)
                for k, v in self.held_pages_host().items()}

    def held_pages_host(self) -> dict[str, torch.Tensor]:
        """`held_pages` computed from the host books, on the host."""
        P = self.page_size
        states = list(self.reqs.values())
        full = self._page_firsts(states, [0] * len(states))
        out = {self.allocator.full_id: full // P}
        if isinstance(self.allocator, SWAAllocator):
            kept = self._page_firsts(states, [s.swa_evicted for s in states])
            swa = self.allocator.full_to_swa_host[kept]
            out[self.allocator.swa.space_id] = swa[swa > 0] // P
        return out

    def _page_firsts(self, states: list[ReqState], starts: list[int]) -> torch.Tensor:
        """[k] int64 full slots at positions ``start, start + P, … < kv_len`` of each request
        (the first slot of each page it holds from ``start`` on): one gather for all of them,
        from the host mirror."""
        P, table = self.page_size, self.req_to_token.host
        st = torch.tensor(starts, dtype=torch.int64)
        n = (torch.tensor([s.kv_len for s in states], dtype=torch.int64) - st + P - 1) // P
        n = n.clamp_(min=0)  # pages per request
        total = int(n.sum())
        if not total:
            return torch.empty(0, dtype=torch.int64)
        rows = torch.repeat_interleave(torch.tensor([s.row for s in states]), n)
        k = torch.arange(total) - torch.repeat_interleave(torch.cumsum(n, 0) - n, n)
        cols = k * P + torch.repeat_interleave(st, n)
        return table[rows, cols].long()

    def leaks(self) -> dict[str, int]:
        """What the books hold that no open request accounts for (everything, once every
        request has finished); all zeros when they are clean.

        ``{space_id: slots}`` per allocator space (``target.full``, ``target.swa``), then
        ``req_to_token`` (rows) and ``free_and_mapped`` (slots both free and linked by the
        full→SWA mapping, see `SWAAllocator.free_and_mapped`).
        """
        live = [s.row for s in self.reqs.values()]
        return {**self.allocator.leaked(self.held_pages_host()),
                "req_to_token": self.req_to_token.leaked_rows(live),
                "free_and_mapped": self.allocator.free_and_mapped()}

    def _get(self, rid: Hashable) -> ReqState:
        try:
            return self.reqs[rid]
        except KeyError:
            raise KeyError(f"request {rid!r} is not open") from None
