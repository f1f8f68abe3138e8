"""KV-cache parts: pools, allocators, typed index spaces and translation, draft pools, sizing.

`sizing` and `shares` (`size_pools`: pool sizes for N requests × context × chunk) import
without torch (the CLI's plan uses them); everything else is loaded on first
access, so ``import swafactory.kvcache`` stays light.
"""
from __future__ import annotations

import importlib
from typing import Any

from swafactory.errors import CapacityError
from swafactory.kvcache.shares import PoolSizes, size_pools
from swafactory.kvcache.sizing import (BudgetSizing, GroupBytes, PoolSizing, build_pools,
                                       full_tokens_per_request, pool_sizing, size_from_budget,
                                       step_nodes, swa_tokens_per_request)

_LAZY = {
    "Locs": "locs", "SlotMapping": "locs", "translate": "locs",
    "KVPool": "pool", "HybridSWAPool": "pool", "ReqToToken": "pool",
    "layers_mapping_for": "pool",
    "TokenAllocator": "allocator", "SWAAllocator": "allocator",
    "RequestSlots": "requests", "ReqState": "requests",
    "own_draft_pool": "draft", "frozen_draft_view": "draft", "split_draft_pool": "draft",
    "build_draft_pool": "draft", "torch_dtype": "factory", "move_kv": "move",
}

__all__ = ["CapacityError", "BudgetSizing", "GroupBytes", "PoolSizing", "build_pools",
           "pool_sizing", "size_from_budget", "swa_tokens_per_request", "full_tokens_per_request",
           "step_nodes", "PoolSizes", "size_pools", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"swafactory.kvcache.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'swafactory.kvcache' has no attribute {name!r}")
