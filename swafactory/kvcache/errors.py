"""KV-cache errors (torch-free, so sizing can raise them without importing torch)."""
from __future__ import annotations

from swafactory.errors import SwaFactoryError

__all__ = ["CapacityError"]


class CapacityError(SwaFactoryError, ValueError):
    """A pool is too small for what addresses it or for the workload (DESIGN invariant 6)."""
