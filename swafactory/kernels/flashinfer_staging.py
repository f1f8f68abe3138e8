"""FlashInfer's pinned plan staging, owned per in-flight forward.

A FlashInfer ``plan`` (and its scheduler call alone, `flashinfer_replan`) writes the plan into
the wrapper's pinned int workspace on the host, then enqueues an asynchronous copy of it to the
wrapper's device int workspace, with no event. The copy reads its pinned source when it runs,
not when it is enqueued. A host that runs ahead (an overlap scheduler plans forward N+1 while N
runs) re-plans the same wrapper before that copy has run, and forward N's kernels then read
N+1's plan: wrong outputs, or an illegal memory access when the batches differ (measured on the
H200: `tests/backends/run_ahead.py`, and mini-sglang #103, vLLM #40756 for the same class).

`StagingRing` owns the pinned staging instead of the wrappers: before each plan, the wrapper is
pointed at a staging buffer whose last copy has run (its CUDA event has completed); after the
plan, the buffer's event is recorded on the current stream, behind the copy the plan enqueued.
A buffer is reused only once its event has completed (``query()``: no host sync); when every
buffer is still in flight the ring grows, up to ``max_buffers``, and only then waits on the
oldest (the host is that many plans ahead). The device int workspace stays the wrapper's: the
copies into it and the kernels that read it are ordered on the stream.

Each buffer owns one CUDA event, made with it and re-recorded by every plan that uses it: a plan
creates no event (the ring holds at most ``max_buffers`` of them).
"""
from __future__ import annotations

from collections import deque

import torch

__all__ = ["StagingRing", "MAX_BUFFERS"]

MAX_BUFFERS = 16
"""Staging buffers at most (of FlashInfer's 8 MB each): a forward plans one wrapper per layer
group and pass, so 16 lets the host run several forwards ahead before it waits."""


class StagingRing:
    """Pinned staging buffers for FlashInfer plans, each guarded by the event of its last copy.

    Off CUDA (the CPU fakes) it hands the wrapper's own buffer back and records nothing.
    """

    def __init__(self, max_buffers: int = MAX_BUFFERS) -> None:
        if max_buffers < 1:
            raise ValueError(f"StagingRing needs max_buffers >= 1, got {max_buffers}")
        self.max_buffers = max_buffers
        # (buffer, its own event, recorded behind the buffer's last copy)
        self._ring: deque[tuple[torch.Tensor, torch.cuda.Event]] = deque()
        self.waits = 0
        """Plans that waited for a staging buffer's copy (the host was too far ahead)."""
        self.grown = 0
        """Buffers allocated: at most ``max_buffers``, unless plans that raised between `begin`
        and `end` took buffers out of the ring for good."""
        self.events = 0
        """CUDA events made: one per buffer, never one per plan."""
        self._open: tuple[torch.Tensor, torch.cuda.Event] | None = None  # between begin and end

    def _take(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """(a staging buffer of ``like``'s size whose last copy has run, its event)."""
        n = like.numel()
        for _ in range(len(self._ring)):
            buf, ev = self._ring[0]
            self._ring.rotate(-1)
            if buf.numel() >= n and ev.query():  # (an event never recorded has completed)
                self._ring.pop()  # the buffer just rotated to the end
                return buf, ev
        if self.grown < self.max_buffers or not self._ring:  # (empty: plans that raised)
            self.grown += 1
            self.events += 1
            # torch creates the CUDA event itself lazily, at its first record
            return torch.empty(n, dtype=like.dtype, pin_memory=True), torch.cuda.Event()
        buf, ev = self._ring.popleft()  # every buffer in flight: wait for the oldest copy
        self.waits += 1
        ev.synchronize()
        if buf.numel() < n:  # its copy has run: a larger buffer takes over its event
            buf = torch.empty(n, dtype=like.dtype, pin_memory=True)
        return buf, ev

    def begin(self, wrapper, device: torch.device) -> None:
        """Before a plan of ``wrapper``: its pinned int workspace becomes a staging buffer whose
        last copy has run. Pair with `end` once the plan has returned."""
        old = getattr(wrapper, "_pin_memory_int_workspace_buffer", None)
        if device.type != "cuda" or not isinstance(old, torch.Tensor):
            self._open = None
            return
        self._open = self._take(old)
        wrapper._pin_memory_int_workspace_buffer = self._open[0]

    def end(self, device: torch.device) -> None:
        """After the plan: the buffer's own event, re-recorded behind the copy the plan
        enqueued."""
        taken, self._open = self._open, None
        if taken is not None:
            taken[1].record(torch.cuda.current_stream(device))
            self._ring.append(taken)
