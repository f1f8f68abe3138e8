"""A forward's results on their way to the host: the only place the generator reads the device.

`Readback.start` issues, on the forward's stream, the argmax of the rows the driver keeps, a
finite flag, and non-blocking copies of those (ids, rows, flag) into pinned host memory, then
records an event. Nothing waits there. `Readback.wait` waits on that event only (never the
stream: forwards launched after it keep running) and hands back host tensors.

With ``run.overlap=true`` the generator waits one forward late (after the next forward was
planned and launched) or where a scheduling decision needs host values; without, right after
the forward. Both modes take the same path, so their tokens are the same by construction.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["Readback", "HostResult", "pinned_ids"]


@dataclass(frozen=True)
class HostResult:
    """What came back. ids: [K] int64 argmax of each kept row; rows: [K, vocab] fp32 (only where
    asked for, else None); finite: the forward's logits were all finite."""

    ids: list[int]
    rows: torch.Tensor | None
    finite: bool


def _host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of device tensor ``t`` that is still in flight (pinned on CUDA)."""
    if t.device.type != "cuda":
        return t.detach().clone()  # CPU: the copy is the compute, in order
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


def pinned_ids(values: list[int], device: torch.device) -> torch.Tensor:
    """[len(values)] int64 on ``device`` without a blocking copy: the caching host allocator
    keeps the pinned source until the copy that reads it is done."""
    t = torch.tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class Readback:
    """One forward's results (``label``: the runner and mode, for messages). logits: [T, vocab] (any float dtype) on the device; keep: [K]
    int64 row indices on the device (None: every row); rows: copy the kept rows too (for the
    logits checks and host decisions), not only their argmax. ``ids_dev`` ([K] int64, device)
    is the argmax that later forwards read their input ids from, with no host round trip."""

    def __init__(self, label: str, logits: torch.Tensor, keep: torch.Tensor | None,
                 rows: bool, then: Callable[[HostResult], None]) -> None:
        self.label, self.then, self.done = label, then, False
        kept = logits if keep is None else logits.index_select(0, keep)
        kept = kept.float()
        self.ids_dev = kept.argmax(-1)
        finite = torch.isfinite(logits).all()
        self._ids, self._finite = _host(self.ids_dev), _host(finite)
        self._rows = _host(kept) if rows else None
        self._event = None
        if logits.device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()

    def wait(self) -> HostResult:
        """Wait for this forward's copies (its event only) and return the host values."""
        if self._event is not None:
            self._event.synchronize()
        self.done = True
        return HostResult(self._ids.tolist(), self._rows, bool(self._finite))
