"""The backend registry: one line per backend, key → module that declares its CAPABILITIES.

A backend module must import no GPU package at module level, so the table and every capability
load on a machine without them. Adding a backend touches three places: its module, one line here,
and `conf/backend/<key>.yaml`.
"""
from __future__ import annotations

import importlib
from functools import cache

from swafactory.config.backend_keys import use_backend_keys
from swafactory.registry.capabilities import Capabilities

__all__ = ["BACKENDS", "register_backend", "list_backends", "get_capabilities", "backend_module",
           "has_adapter"]

BACKENDS: dict[str, str] = {
    "torch": "swafactory.kernels.torch_ref",
    "triton": "swafactory.kernels.triton",
    "flashinfer": "swafactory.kernels.flashinfer",
    "flash_attn": "swafactory.kernels.flash_attn",
    "flex": "swafactory.kernels.flex",
    "trtllm_mha": "swafactory.kernels.trtllm_mha",
}


def register_backend(name: str, module: str) -> None:
    """Add an out-of-tree backend. ``module`` must define ``CAPABILITIES``; duplicates are refused."""
    if name in BACKENDS or name == "auto":
        raise ValueError(f"backend {name!r} is already registered (to {BACKENDS.get(name, 'auto')})")
    BACKENDS[name] = module
    get_capabilities.cache_clear()
    has_adapter.cache_clear()


def list_backends() -> tuple[str, ...]:
    """Registered backend keys, in table order (`auto` is not one: it picks among these)."""
    return tuple(BACKENDS)


def backend_module(name: str):  # noqa: ANN201 - a module object
    """Import a backend's module (GPU-package-free at import time by contract)."""
    if name not in BACKENDS:
        raise KeyError(f"unknown backend {name!r}; registered: {', '.join(BACKENDS)}")
    return importlib.import_module(BACKENDS[name])


use_backend_keys(list_backends)  # the schema's `backend.name` check reads this table's keys


@cache
def get_capabilities(name: str) -> Capabilities:
    """The declared capabilities of a registered backend."""
    caps = backend_module(name).CAPABILITIES
    if caps.name != name:
        raise ValueError(f"{BACKENDS[name]}.CAPABILITIES.name is {caps.name!r}, registered as {name!r}")
    return caps


@cache
def has_adapter(name: str) -> bool:
    """Whether the backend's module defines an `Adapter` (a kernel swafactory can call), as
    opposed to declaring capabilities only."""
    return hasattr(backend_module(name), "Adapter")
