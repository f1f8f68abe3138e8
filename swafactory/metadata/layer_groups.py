"""Which layers share a plan: a layer group is a sub-pool and a window (`group_key`), and a
runner's grouping is built once per layers mapping, not per forward (`groups_of`)."""
from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from types import MappingProxyType

__all__ = ["group_key", "groups_of"]


def group_key(sub_pool: str, window: int | None) -> str:
    """Layers share a plan only when they share a sub-pool *and* a window: ``swa/w1024``,
    ``full``, ``full/w16`` (a window applied as a mask on an unsplit pool). Tables are trimmed and
    masked by the window, so two windows never share one set."""
    return sub_pool if window is None else f"{sub_pool}/w{window}"


@lru_cache(maxsize=64)
def _layer_groups(mapping: tuple, windows: tuple) -> tuple[Mapping, Mapping[int, str]]:
    """(group key → (sub-pool, window), layer → group key) of a pool's layers: the same for
    every forward of a runner, so built once (a model has dozens of layers)."""
    wins = dict(windows)
    keys: dict[str, tuple[str, int | None]] = {}
    layer_groups: dict[int, str] = {}
    for layer, (sub, _) in sorted(mapping):
        k = group_key(sub, wins[layer])
        keys[k] = (sub, wins[layer])
        layer_groups[layer] = k
    return MappingProxyType(keys), MappingProxyType(layer_groups)  # shared: read-only


_GROUPS: dict[int, tuple] = {}
"""id of a layers mapping → (it, a copy of it, a copy of the windows, `_layer_groups`' answer)."""


def groups_of(layers_mapping: Mapping, windows: Mapping) -> tuple[Mapping, Mapping[int, str]]:
    """`_layer_groups` of a runner's mappings without building its key each forward (a tuple of
    every layer's items, hashed): the last answer for this mapping object while both mappings
    still compare equal to what it was built from."""
    e = _GROUPS.get(id(layers_mapping))
    if e is not None and e[0] is layers_mapping and e[1] == layers_mapping and e[2] == windows:
        return e[3]
    out = _layer_groups(tuple(layers_mapping.items()),
                        tuple((j, windows[j]) for j in layers_mapping))
    if len(_GROUPS) >= 64:  # bounded: a process has a few runners
        _GROUPS.clear()
    _GROUPS[id(layers_mapping)] = (layers_mapping, dict(layers_mapping), dict(windows), out)
    return out
