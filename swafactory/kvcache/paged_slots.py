"""The slot-level operations both allocators share (`allocator.TokenAllocator`,
`allocator.SWAAllocator`), on top of their page-level ``alloc_pages_host`` / ``free_pages``:
slots from pages, and sglang's extend and decode allocation (a request's new tokens continue its
last page, then take whole new pages). The books are host tensors (see `allocator`)."""
from __future__ import annotations

import math

import numpy as np
import torch

from swafactory.kvcache.pool import host_to_device

__all__ = ["PagedSlots", "page_rows", "host_ids"]

_HOST = torch.device("cpu")


def host_ids(t: torch.Tensor) -> torch.Tensor:
    """``[n]`` int64 on the host (a caller's device tensor is read back here, once)."""
    return t.reshape(-1).to(_HOST, torch.int64)


def page_rows(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """Every slot of ``pages`` (``[n]`` int64 page ids) → ``[n * page_size]`` int64 slot ids."""
    if page_size == 1:
        return pages
    offs = torch.arange(page_size, device=pages.device, dtype=pages.dtype)
    return (pages[:, None] * page_size + offs).reshape(-1)


class PagedSlots:
    """Slot-level operations shared by both allocators, built on ``alloc_pages_host`` and
    ``free_pages``: slots are planned on the host and copied to the device, never read back."""

    page_size: int
    device: torch.device

    def available_pages(self) -> int:
        raise NotImplementedError

    def alloc_pages_host(self, n: int) -> torch.Tensor | None:
        """``n`` page ids (``[n]`` int64, on the host) or None when fewer are free."""
        raise NotImplementedError

    def alloc_pages(self, n: int) -> torch.Tensor | None:
        """``n`` page ids (``[n]`` int64 on the allocator's device) or None when fewer are free."""
        pages = self.alloc_pages_host(n)
        return None if pages is None else host_to_device(pages, self.device)

    def free_pages(self, pages: torch.Tensor) -> None:
        raise NotImplementedError

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` slots (``[n]`` int64), page_size 1 only; None when the pool is short."""
        if self.page_size != 1:
            raise ValueError(f"alloc(n) needs page_size 1 (got {self.page_size}); use "
                             "alloc_extend, which continues each request's last page")
        return self.alloc_pages(n)

    def free(self, slots: torch.Tensor) -> None:
        """Free the pages holding ``slots`` (``[n]`` int64 full slots; 0 entries are ignored).

        With page_size > 1 a whole page is freed even if only one of its slots is given.
        """
        slots = host_ids(slots)
        self.free_pages(torch.unique(slots[slots > 0] // self.page_size))

    def _extend_plan(self, last_loc: torch.Tensor, extend_lens: torch.Tensor | list[int]
                     ) -> tuple[list[int], list[int], list[int], list[int]]:
        """Per request: last slot, new tokens, slots taken from its last page, new pages."""
        P = self.page_size
        lasts = [int(x) for x in last_loc.reshape(-1).tolist()]
        lens = [int(x) for x in (extend_lens.tolist() if torch.is_tensor(extend_lens)
                                 else extend_lens)]
        if len(lasts) != len(lens) or any(n < 0 for n in lens):
            raise ValueError(f"last_loc and extend_lens must pair up with lens >= 0, got "
                             f"{len(lasts)} and {lens}")
        # Slots left in each request's last page, then whole new pages for the rest.
        take = [min(P - 1 - last % P, n) if last > 0 else 0 for last, n in zip(lasts, lens)]
        need = [math.ceil((n - t) / P) for n, t in zip(lens, take)]
        return lasts, lens, take, need

    def pages_needed(self, last_loc: torch.Tensor, extend_lens: torch.Tensor | list[int]) -> int:
        """New pages `alloc_extend` would take for the same arguments."""
        return sum(self._extend_plan(last_loc, extend_lens)[3])

    def alloc_extend(self, last_loc: torch.Tensor, extend_lens: torch.Tensor | list[int]
                     ) -> torch.Tensor | None:
        """New slots for a batch of requests, each continuing its own last page.

        ``last_loc``: ``[bs]`` int64, the full slot of each request's last token (``<= 0``: the
        request has none, start a fresh page). ``extend_lens``: ``[bs]`` new tokens per request.
        Returns ``[sum(extend_lens)]`` int64 slots on the allocator's device, request-major; or
        None (nothing allocated) when the pool lacks the pages. A ``last_loc`` on the device is
        read back; `alloc_extend_host` with host arguments reads nothing back.
        """
        slots = self.alloc_extend_host(last_loc, extend_lens)
        return None if slots is None else host_to_device(slots, self.device)

    def alloc_extend_host(self, last_loc: torch.Tensor, extend_lens: torch.Tensor | list[int]
                          ) -> torch.Tensor | None:
        """`alloc_extend` with the slots on the host: ``[sum(extend_lens)]`` int64, or None."""
        P = self.page_size
        lasts, lens, take, need = self._extend_plan(last_loc, extend_lens)
        total = sum(need)
        if total > self.available_pages():
            return None
        pages = (self.alloc_pages_host(total) if total else torch.zeros(1, dtype=torch.int64))
        assert pages is not None  # admission checked above
        # Token j of request i: slot last+1+j while it fits the last page (j < take), else slot
        # u % P of the request's new page u // P (u = j - take); one vector op for the batch.
        n, t, k = (np.asarray(v, dtype=np.int64) for v in (lens, take, need))
        last = np.asarray(lasts, dtype=np.int64)
        req = np.repeat(np.arange(n.size), n)
        j = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
        u = j - t[req]
        cursor = np.cumsum(k) - k
        page = pages.numpy()[np.where(u < 0, 0, cursor[req] + np.maximum(u, 0) // P)]
        return torch.from_numpy(np.where(u < 0, last[req] + 1 + j, page * P + u % P))

    def alloc_decode(self, last_loc: torch.Tensor) -> torch.Tensor | None:
        """One slot per request after ``last_loc`` (``[bs]`` int64); ``[bs]`` int64 or None."""
        return self.alloc_extend(last_loc, [1] * last_loc.numel())
