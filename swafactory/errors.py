"""The errors swafactory raises. The library raises; only ``__main__`` maps them to exit codes."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Reason", "SwaFactoryError", "ConfigError", "FieldError", "SpaceError", "CapacityError", "EXIT_OK", "EXIT_CONFORMANCE",
           "EXIT_CONFIG", "EXIT_INERT"]

EXIT_OK = 0
EXIT_CONFORMANCE = 1
EXIT_CONFIG = 2
EXIT_INERT = 3
"""A run that passed while its injected fault never acted: it proves nothing (status `inert`)."""


@dataclass(frozen=True)
class Reason:
    """One reason a configuration cannot run.

    ``part`` is the config group it belongs to (``model``, ``spec``, ``backend``, ``workload``,
    ``device``); ``field`` is the dotted override path a user can retype on the command line.
    """

    part: str
    field: str
    message: str
    fix: str | None = None
    rule: str = "schema"
    """Short name of the rule that produced it (for snapshots and the support matrix)."""

    def __str__(self) -> str:
        text = f"- `{self.field}`: {self.message}"
        if not self.fix:
            return text
        return f"{text}{'' if text.endswith(('.', '?')) else '.'} Fix: {self.fix}"


class SwaFactoryError(Exception):
    """Base class of every error swafactory raises on purpose."""


class ConfigError(SwaFactoryError, ValueError):
    """A configuration swafactory refuses, with every reason at once.

    ``reasons`` lists them all; ``alternatives`` names backends that would work on this device;
    ``suggestion`` is overrides to type after the user's own. Both have passed `check` (on the
    same device) together with those overrides before they are given.
    """

    def __init__(self, reasons: Iterable[Reason], *, combination: str | None = None,
                 alternatives: Sequence[str] = (), suggestion: str | None = None,
                 headline: str | None = None) -> None:
        self.reasons: tuple[Reason, ...] = tuple(reasons)
        self.combination = combination
        self.alternatives: tuple[str, ...] = tuple(alternatives)
        self.suggestion = suggestion
        self.headline = headline
        super().__init__(self._render())

    def _render(self) -> str:
        head = self.headline or (f"swafactory cannot build {self.combination}:" if self.combination
                                 else "invalid swafactory configuration:")
        lines = [head]
        parts: dict[str, list[Reason]] = {}
        for r in self.reasons:
            parts.setdefault(r.part, []).append(r)
        for part, rs in parts.items():
            lines.append(f"  {part}:")
            lines.extend(f"    {r}" for r in rs)
        if self.combination is not None:
            if self.alternatives:
                lines.append(f"Backends that would work on this device: {', '.join(self.alternatives)}")
            else:
                lines.append("No registered backend can serve this combination on this device"
                             + (" as configured." if self.suggestion else "."))
        if self.suggestion:
            lines.append(f"Try: {self.suggestion}")
        return "\n".join(lines)


class FieldError(ValueError):
    """A schema validator's error that belongs to one field (reported at its dotted path)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(message)


class CapacityError(SwaFactoryError, ValueError):
    """A pool is too small for what addresses it or for the workload (DESIGN invariant 6)."""


class SpaceError(SwaFactoryError, TypeError):
    """A table of KV locations was used against a pool of another index space (DESIGN invariant 1)."""
