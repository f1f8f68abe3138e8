"""When a plain progress line is due, for both drivers' logs (the conformance job's `LogProgress`
and the generator's `GenProgress`): on the first step, when a tenth of the estimated steps has
passed since the last line, after ``every_s`` seconds, or when the last request finishes."""
from __future__ import annotations

__all__ = ["LineClock"]


class LineClock:
    """The throttle of one run's progress lines (plain text: logs, CI, terminals alike)."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        self.last_step: int | None = None
        self._at = 0.0

    @property
    def first(self) -> bool:
        """No line printed yet."""
        return self.last_step is None

    def due(self, step: int, est_steps: int, elapsed_s: float, finished: bool) -> bool:
        """True when a line is due now (and then counted as printed)."""
        tenth = max(1, -(-est_steps // 10))
        if not (self.last_step is None or step - self.last_step >= tenth
                or elapsed_s - self._at >= self.every_s or finished):
            return False
        self.last_step, self._at = step, elapsed_s
        return True
