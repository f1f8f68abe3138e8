"""The set of backend keys the schema accepts, handed down by the registry.

`registry.table` owns the key → module table; at import it hands this module the function that
lists its keys (`use_backend_keys`), so the config layer checks `backend.name` and
`backend.groups.*` without importing anything above it.
"""
from __future__ import annotations

from collections.abc import Callable
from difflib import get_close_matches

__all__ = ["known_backend", "use_backend_keys"]

_backend_keys: Callable[[], tuple[str, ...]] = tuple
"""The registered backend keys, handed down by `registry.table` when it loads (the registry
owns the set; the config layer imports nothing above it). ``swafactory`` loads the registry
before any config can be validated."""


def use_backend_keys(keys: Callable[[], tuple[str, ...]]) -> None:
    """Where `known_backend` reads the registered keys (`registry.table.list_backends`)."""
    global _backend_keys
    _backend_keys = keys


def known_backend(name: str, auto: bool) -> str:
    """``name`` if it is a registered backend key (or ``auto`` where ``auto``), else a
    ValueError the schema reports at its field: the value, every key, the closest ones."""
    known = (*(("auto",) if auto else ()), *_backend_keys())
    if name not in known:
        close = get_close_matches(name, known, n=2)
        guess = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise ValueError(f"unknown backend {name!r}; registered: {', '.join(known)}{guess}")
    return name
