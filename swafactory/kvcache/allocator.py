"""Slot allocators: `TokenAllocator` (one index space) and `SWAAllocator` (full + SWA, lock-step).

Both hand out whole pages internally (page_size 1 → a page is a slot) and slot ids externally.
Page 0 is the dummy page and is never handed out. `SWAAllocator` owns the full→SWA mapping and
allocates an SWA page for every full page, keeping the in-page offset, so
``full_slot % page == swa_slot % page`` and ``mapping[full_page*P + o] = swa_page*P + o``.
Mapping entries are set and zeroed a whole page at a time. The slot-level operations both share
(extend and decode allocation, slots from pages) are `paged_slots.PagedSlots`.

All-SWA models (every layer slides): the full index space is *virtual*: a `TokenAllocator` with no
buffers behind it. sglang's PureSWA allocator instead uses the SWA slots as full slots with an
identity mapping; then an evicted slot, reused by another request, still translates to itself, so
a stale read aliases live data instead of reading the dummy. The virtual space keeps "absent = 0"
for every model at one int64 per full slot, and works with any page size.

The books live on the host: free lists, owned flags and a mirror of the mapping are CPU tensors,
and the device mapping is written from them, never read back. A host that plans forward N+1
while N runs is then not stalled by its own allocation (each read back would wait for the
device's queue).
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from swafactory.kvcache.locs import SlotMapping
from swafactory.kvcache.paged_slots import PagedSlots, host_ids, page_rows
from swafactory.kvcache.pool import CapacityError, KVPool, host_to_device

__all__ = ["TokenAllocator", "SWAAllocator", "page_rows", "pool_use"]

class TokenAllocator(PagedSlots):
    """A free list of pages over one index space of ``size`` slots (``size % page_size == 0``).

    ``space_id`` names the index space (the pool_id of its owner, e.g. ``target.full``). Pools
    attached with `attach` are poisoned on every free in check mode.
    """

    def __init__(self, size: int, page_size: int, device: torch.device | str = "cpu", *,
                 space_id: str = "target.full", check_mode: bool = False) -> None:
        if size < page_size or size % page_size:
            raise ValueError(f"allocator {space_id!r}: size {size} must be a positive multiple "
                             f"of page_size {page_size}")
        self.size, self.page_size, self.space_id = size, page_size, space_id
        self.device = torch.device(device)
        self.check_mode = check_mode
        self.num_pages = size // page_size
        self.pools: list[KVPool] = []
        # Host books: owned flag per page (page 0 is the dummy, never owned; catches double
        # frees) and the free list. Only pages and rows to clear or poison go to the device.
        self._owned = torch.zeros(self.num_pages + 1, dtype=torch.bool)
        self._free = torch.arange(1, self.num_pages + 1, dtype=torch.int64)

    @property
    def full_id(self) -> str:
        return self.space_id

    @property
    def full_size(self) -> int:
        """Slots of the full index space."""
        return self.size

    @property
    def mapping(self) -> SlotMapping | None:
        """No full→SWA mapping: one index space."""
        return None

    def attach(self, pool: KVPool, *, check_capacity: bool = True) -> None:
        """Register a pool addressed by this allocator's slots, to poison on free."""
        if pool.indexed_by != self.space_id:
            raise ValueError(f"pool {pool.pool_id!r} is indexed by {pool.indexed_by!r}, not by "
                             f"{self.space_id!r}")
        if pool.page_size != self.page_size:
            raise ValueError(f"pool {pool.pool_id!r} has page_size {pool.page_size}, the "
                             f"allocator {self.page_size}")
        if check_capacity and pool.size < self.size:
            raise CapacityError(f"pool {pool.pool_id!r} holds {pool.size} slots but is addressed "
                                f"by {self.space_id!r}, which hands out {self.size}")
        self.pools.append(pool)

    def available_pages(self) -> int:
        return self._free.numel()

    def shuffle(self, generator: torch.Generator) -> None:
        """Permute the free list, so later pages come in random order (tests, the harness)."""
        perm = torch.randperm(self._free.numel(), generator=generator)
        self._free = self._free[perm]

    def available_size(self) -> int:
        """Free slots."""
        return self._free.numel() * self.page_size

    def used_size(self) -> int:
        """Slots in owned pages."""
        return self.size - self.available_size()

    def owned_pages(self) -> torch.Tensor:
        """Page ids currently handed out, ``[k]`` int64 on the allocator's device (for checks
        and reports)."""
        return host_to_device(torch.nonzero(self._owned).reshape(-1), self.device)

    def free_by_space(self) -> dict[str, int]:
        """Free slots per index space (``{space_id: n}``), for error messages."""
        return {self.space_id: self.available_size()}

    def leaked(self, held: Mapping[str, torch.Tensor] | None = None) -> dict[str, int]:
        """``{space_id: slots}`` off the free list that no live request accounts for.

        ``held``: space id → ``[k]`` int64 page ids live requests still hold (`RequestSlots.
        held_pages`); none once every request has finished, when the allocator must be back to
        its whole capacity. 0 = no leak.
        """
        pages = (held or {}).get(self.space_id)
        kept = 0
        if pages is not None and pages.numel():
            pages = torch.unique(host_ids(pages))
            pages = pages[(pages >= 1) & (pages <= self.num_pages)]
            kept = int(self._owned[pages].sum())
        return {self.space_id: (self.num_pages - self._free.numel() - kept) * self.page_size}

    def free_and_mapped(self) -> int:
        """One index space has no full→SWA mapping: nothing can be free yet mapped."""
        return 0

    def alloc_pages_host(self, n: int) -> torch.Tensor | None:
        """``n`` page ids (``[n]`` int64, on the host) or None when fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self._free.numel():
            return None
        pages, self._free = self._free[:n], self._free[n:]
        self._owned[pages] = True
        if self.check_mode and self.page_size > 1 and n:  # whole-page loads read the tail
            self._each_pool("clear", pages)
        return pages

    def _each_pool(self, what: str, pages: torch.Tensor) -> None:
        """`KVPool.clear` or `KVPool.poison` the rows of host ``pages`` in every attached pool
        (the rows copied to each device once)."""
        rows, on = page_rows(pages, self.page_size), {}
        for pool in self.pools:
            if pool.device not in on:
                on[pool.device] = host_to_device(rows, pool.device)
            getattr(pool, what)(on[pool.device])

    def free_pages(self, pages: torch.Tensor) -> None:
        """Return ``pages`` (``[n]`` int64 page ids, each owned, no repeats) to the free list.

        Host ``pages`` are checked on the host; pages on the device are read back first."""
        pages = host_ids(pages)
        if pages.numel() == 0:
            return
        srt = pages.sort().values
        owned = self._owned[pages.clamp(0, self.num_pages)]
        twice = bool((srt[1:] == srt[:-1]).any())
        stray = bool(((pages < 1) | (pages > self.num_pages) | ~owned).any())
        if twice:
            raise ValueError(f"{self.space_id!r}: the same page is freed twice in one call")
        if stray:
            raise ValueError(f"{self.space_id!r}: freeing pages that are not allocated "
                             "(double free, the dummy page, or out of range)")
        self._owned[pages] = False
        self._free = torch.cat([self._free, pages])
        for pool in self.pools:  # a backend that planned before this free checks its slots again
            pool.freed += 1
        if self.check_mode:
            self._each_pool("poison", pages)


class SWAAllocator(PagedSlots):
    """Full and SWA slots in lock-step, and the full→SWA mapping that links them.

    ``mapping.table``: int64 ``[size_full + page_size + 1]``, 0 = absent. sglang stores -1 in the
    last entry so that an eager ``mapping[-1]`` for "no last token" yields -1; here "no last
    token" is decided on the host before any lookup, so the extra entry is kept (same length, for
    kernels that clamp to ``numel - 1``) but holds 0 like every other absent entry, and a clamped
    lookup lands on the dummy slot instead of a negative index.
    """

    def __init__(self, size_full: int, size_swa: int, page_size: int,
                 device: torch.device | str = "cpu", *, full_id: str = "target.full",
                 swa_id: str = "target.swa", check_mode: bool = False) -> None:
        self.page_size = page_size
        self.device = torch.device(device)
        self.check_mode = check_mode
        self.full = TokenAllocator(size_full, page_size, device, space_id=full_id,
                                   check_mode=check_mode)
        self.swa = TokenAllocator(size_swa, page_size, device, space_id=swa_id,
                                  check_mode=check_mode)
        table = torch.zeros(size_full + page_size + 1, dtype=torch.int64, device=self.device)
        self._mapping = SlotMapping(full_id, swa_id, table, size_swa, page_size)
        # The books' copy of the mapping: the device table (which the planner reads) is written
        # from it, never read back. Lazily zeroed pages: untouched entries cost no memory.
        self._map_host = torch.from_numpy(np.zeros(table.numel(), dtype=np.int64))

    @property
    def full_id(self) -> str:
        return self.full.space_id

    @property
    def full_size(self) -> int:
        """Slots of the full index space (virtual for an all-SWA model)."""
        return self.full.size

    @property
    def mapping(self) -> SlotMapping:
        """The live full→SWA mapping (mutated in place by every alloc and free)."""
        return self._mapping

    @property
    def full_to_swa(self) -> torch.Tensor:
        """``[size_full + page_size + 1]`` int64 on the allocator's device; 0 = absent."""
        return self._mapping.table

    @property
    def full_to_swa_host(self) -> torch.Tensor:
        """The host mirror of `full_to_swa` (equal to it entry for entry; the books read this)."""
        return self._map_host

    @property
    def size(self) -> int:
        """Tokens both spaces can hold at once."""
        return min(self.full.size, self.swa.size)

    def attach(self, pool: KVPool, *, check_capacity: bool = True) -> None:
        """Register a full- or SWA-space pool to poison on free (by its ``space``)."""
        (self.full if pool.space == "full" else self.swa).attach(
            pool, check_capacity=check_capacity)

    def available_pages(self) -> int:
        return min(self.full.available_pages(), self.swa.available_pages())

    def free_by_space(self) -> dict[str, int]:
        """Free slots per index space (``{full_id: n, swa_id: m}``), for error messages."""
        return {**self.full.free_by_space(), **self.swa.free_by_space()}

    def leaked(self, held: Mapping[str, torch.Tensor] | None = None) -> dict[str, int]:
        """`TokenAllocator.leaked` of the full and the SWA space."""
        return {**self.full.leaked(held), **self.swa.leaked(held)}

    def free_and_mapped(self) -> int:
        """Slots that are free yet linked by the full→SWA mapping; 0 when the books are clean.

        Counts free full slots whose mapping entry is non-zero (a free that skipped `free_swa`),
        plus free SWA slots that some full slot still maps to (a mapping left pointing at freed
        KV, which a later reader would see as live).
        """
        P, table = self.page_size, self._map_host
        full_owned = self.full._owned.repeat_interleave(P)  # per full slot, the dummy page's too
        n = full_owned.numel()
        stale_full = int(((table[:n] != 0) & ~full_owned).sum()) + int((table[n:] != 0).sum())
        targets = table[table > 0]
        pages = targets // P
        in_range = pages <= self.swa.num_pages
        freed = torch.ones_like(in_range)
        freed[in_range] = ~self.swa._owned[pages[in_range]]
        return stale_full + torch.unique(targets[freed]).numel()

    def shuffle(self, generator: torch.Generator) -> None:
        """Permute both free lists independently (random full and SWA page orders)."""
        self.full.shuffle(generator)
        self.swa.shuffle(generator)

    def available_size(self) -> int:
        """Tokens that can still be allocated: the smaller of the two free lists."""
        return self.available_pages() * self.page_size

    def alloc_pages_host(self, n: int) -> torch.Tensor | None:
        """``n`` full pages (on the host), each with an SWA page mapped slot by slot; None if
        either is short."""
        if n > self.available_pages():
            return None
        full_pages = self.full.alloc_pages_host(n)
        swa_pages = self.swa.alloc_pages_host(n)
        assert full_pages is not None and swa_pages is not None  # admission checked above
        rows = page_rows(full_pages, self.page_size)
        vals = page_rows(swa_pages, self.page_size)
        self._map_host[rows] = vals
        if rows.numel():  # rows and values travel in one copy
            both = host_to_device(torch.stack([rows, vals]), self.device)
            self.full_to_swa[both[0]] = both[1]
        return full_pages

    def free_pages(self, pages: torch.Tensor) -> None:
        """Free full ``pages`` and whatever SWA pages they still map to."""
        self.free_swa_pages(pages)
        self.full.free_pages(pages)

    def free_swa_pages(self, pages: torch.Tensor, *,
                       stale_rows: torch.Tensor | None = None) -> None:
        """Free the SWA pages behind full ``pages`` (``[n]`` int64) and zero their mapping.

        Pages already evicted (mapping 0) are skipped; the full pages stay allocated.
        stale_rows: the fault switch of sglang #27779: only these full slots' mapping entries
        are zeroed, so the rest of each freed page stays mapped to a free SWA page.
        """
        pages = host_ids(pages)
        if pages.numel() == 0:
            return
        first = self._map_host[pages * self.page_size]
        live = first > 0
        self.swa.free_pages(first[live] // self.page_size)
        rows = (page_rows(pages, self.page_size) if stale_rows is None
                else host_ids(stale_rows))  # FAULT
        self._map_host[rows] = 0
        if rows.numel():
            self.full_to_swa.index_fill_(0, host_to_device(rows, self.device), 0)

    def free_swa(self, slots: torch.Tensor) -> None:
        """Free the SWA pages behind the full ``slots`` (``[n]`` int64); whole pages when P > 1."""
        slots = host_ids(slots)
        self.free_swa_pages(torch.unique(slots[slots > 0] // self.page_size))


def pool_use(alloc, space: str) -> float:
    """Used / total slots of one space (``swa`` or ``full``) of an allocator (an `SWAAllocator`
    has ``.full`` and ``.swa``; a `TokenAllocator` is one space)."""
    sub = getattr(alloc, space, alloc)
    return sub.used_size() / sub.size
