"""How many times each injected fault acted: changed a write, a plan, a mapping or a free.

A fault switched on where the workload gives it nothing to change (no batch shrinks inside a
graph bucket, no request passes its window, …) leaves the run green without proving anything.
Each fault branch in the shared parts calls `FAULT_COUNTS.acted(name)` only when it changed the
outcome; the drivers (harness and run=generate) clear the counts before a run and read them after it
(`swafactory.outputs.inert`): a run whose fault never acted is ``inert``, not ok.

One process-wide counter: the fault branches sit deep in storage and planning code that must
not import the drivers, and a run is one process (a tensor-parallel rank is its own).
Incrementing a `Counter` is host work only; nothing here reads a device tensor.
"""
from __future__ import annotations

from collections import Counter

__all__ = ["FaultCounts", "FAULT_COUNTS"]


class FaultCounts(Counter):
    """Fault name → times it acted in this process since the last `clear()`."""

    def acted(self, name: str, times: int = 1) -> None:
        """Record that fault ``name`` changed something ``times`` times (0: nothing, not kept)."""
        if times > 0:
            self[name] += times

    def of(self, names) -> dict[str, int]:
        """``{name: times}`` for each of ``names`` (0 for one that never acted)."""
        return {n: self[n] for n in names}


FAULT_COUNTS = FaultCounts()
"""The process's counts: fault branches add to it, the harness clears and reads it per run."""
