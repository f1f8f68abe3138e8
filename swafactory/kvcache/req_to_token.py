"""`ReqToToken`: each request row's full slot per position, on the device with a host mirror."""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

__all__ = ["ReqToToken", "host_to_device"]


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor ``t`` on ``device`` without waiting for the device's queue: on CUDA pinned and
    copied asynchronously (the caching host allocator keeps the pinned source until the copy has
    read it); on the CPU ``t`` itself."""
    if device.type != "cuda":
        return t.to(device)
    if t.numel() == 0:  # nothing to copy (nor to pin)
        return torch.empty(t.shape, dtype=t.dtype, device=device)
    return t.pin_memory().to(device, non_blocking=True)


class ReqToToken:
    """Request row → full slot of each position: ``table`` ``[max_requests, max_context]``.

    Entries of unused rows and positions are 0 (the dummy slot). ``dtype`` int64 (default) or
    int32, as kernels that build page tables from it want. ``host`` is a CPU mirror, equal entry
    for entry: the books read it, and write both through `write` and `zero`, so no bookkeeping
    reads the device table back (a read would wait for the device's queue).
    """

    def __init__(self, max_requests: int, max_context: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.int64) -> None:
        if max_requests < 1 or max_context < 1:
            raise ValueError(f"ReqToToken needs max_requests, max_context >= 1, got "
                             f"{max_requests}, {max_context}")
        if dtype not in (torch.int32, torch.int64):
            raise ValueError(f"ReqToToken dtype must be int32 or int64, got {dtype}")
        self.max_requests, self.max_context = max_requests, max_context
        self.table = torch.zeros(max_requests, max_context, dtype=dtype, device=device)
        # lazily zeroed pages: rows never written cost no host memory
        self.host = torch.from_numpy(np.zeros((max_requests, max_context),
                                              dtype=np.int64 if dtype == torch.int64
                                              else np.int32))
        self._free_rows = list(range(max_requests - 1, -1, -1))

    def write(self, rows: torch.Tensor, cols: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """``table[rows[i], cols[i]] = slots[i]`` on both sides; all three ``[n]`` int64 on the
        host. Returns ``slots`` on the table's device, int64 (they travel with the indices, in
        one copy)."""
        self.host[rows, cols] = slots.to(self.host.dtype)
        both = host_to_device(torch.stack([rows, cols, slots]), self.table.device)
        self.table[both[0], both[1]] = both[2].to(self.table.dtype)
        return both[2]

    def zero(self, row: int, start: int, end: int) -> None:
        """Entries ``[start, end)`` of ``row`` back to 0 on both sides."""
        self.host[row, start:end] = 0
        self.table[row, start:end].zero_()

    def available_size(self) -> int:
        return len(self._free_rows)

    def leaked_rows(self, live_rows: Iterable[int] = ()) -> int:
        """Rows taken but not among ``live_rows`` (the rows of requests still open; none once
        every request has finished, when every row must be released). 0 = no leak."""
        taken = set(range(self.max_requests)).difference(self._free_rows)
        return len(taken.difference(live_rows))

    def alloc(self) -> int | None:
        """A free row, or None when every row is taken."""
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        """Release ``row`` and zero its entries."""
        if not 0 <= row < self.max_requests or row in self._free_rows:
            raise ValueError(f"row {row} is not an allocated ReqToToken row")
        self.table[row].zero_()
        self.host[row].zero_()
        self._free_rows.append(row)
