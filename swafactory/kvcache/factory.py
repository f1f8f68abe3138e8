"""Builds a config's target pool and allocator, wired: mapping registered, sub-pools attached."""
from __future__ import annotations

from collections.abc import Collection

import torch

from swafactory.config.schema import SwaFactoryConfig
from swafactory.kvcache.allocator import SWAAllocator, TokenAllocator
from swafactory.kvcache.pool import HybridSWAPool, KVPool, layers_mapping_for
from swafactory.kvcache.quant import query_dtype

__all__ = ["build_pools", "torch_dtype", "compute_dtype"]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp8_e4m3": torch.float8_e4m3fn}


def torch_dtype(kv_dtype: str) -> torch.dtype:
    """The torch dtype of a ``backend.kv_dtype`` key."""
    try:
        return _DTYPES[kv_dtype]
    except KeyError:
        raise ValueError(f"unknown kv_dtype {kv_dtype!r}; known: {', '.join(_DTYPES)}") from None


def compute_dtype(kv_dtype: str) -> torch.dtype:
    """The queries' (and the model's) dtype beside a ``backend.kv_dtype`` key: bf16 for fp8."""
    return query_dtype(torch_dtype(kv_dtype))


def build_pools(cfg: SwaFactoryConfig, size_full: int, size_swa: int,
                device: torch.device | str = "cpu", check_mode: bool = False, *,
                layers: Collection[int] | None = None
                ) -> tuple[HybridSWAPool, TokenAllocator | SWAAllocator]:
    """The target's pool and allocator.

    Split models (sliding layers and ``hybrid_pool``) get an `SWAAllocator` over ``size_full``
    full and ``size_swa`` SWA slots; the full sub-pool has buffers only if some layer is full
    (an all-SWA model's full space is virtual). Unsplit models get one full pool holding every
    layer and a `TokenAllocator`; ``size_swa`` is ignored. Sizes are slots, multiples of
    ``backend.page_size`` (see `size_from_budget`). ``layers``: the model layers whose K/V
    get rows (None: every layer); the others keep their place in the mapping with no rows, so
    a run that attends a few layers takes their memory only (`KVPool` ``held``).
    """
    m, P = cfg.model, cfg.backend.page_size
    dtype = torch_dtype(cfg.backend.kv_dtype)
    lmap = layers_mapping_for(m)
    if layers is not None and not set(layers) <= set(lmap):
        raise ValueError(f"build_pools: layers {sorted(set(layers) - set(lmap))} are not layers "
                         f"of {m.name} (0..{m.num_layers - 1})")
    held = {sub: None if layers is None else [lmap[i][1] for i in layers if lmap[i][0] == sub]
            for sub in ("full", "swa")}
    if not (m.swa_layers and m.hybrid_pool):
        geo = m.full or m.swa
        assert geo is not None  # the schema requires a geometry for every layer group
        full = KVPool(size_full, P, m.num_layers, geo.num_kv_heads, geo.head_dim, dtype, device,
                      pool_id="target.full", space="full", check_mode=check_mode,
                      held=held["full"])
        alloc = TokenAllocator(size_full, P, device, space_id="target.full",
                               check_mode=check_mode)
        alloc.attach(full)
        pool = HybridSWAPool(full, None, lmap, name="target")
        pool.model = m.name  # the model it was built for: a backend of another one names both
        return pool, alloc
    assert m.swa is not None
    swa = KVPool(size_swa, P, len(m.swa_layers), m.swa.num_kv_heads, m.swa.head_dim, dtype,
                 device, pool_id="target.swa", space="swa", check_mode=check_mode,
                 held=held["swa"])
    full_pool = None
    if m.full_layers:
        assert m.full is not None
        full_pool = KVPool(size_full, P, len(m.full_layers), m.full.num_kv_heads,
                           m.full.head_dim, dtype, device, pool_id="target.full", space="full",
                           check_mode=check_mode, held=held["full"])
    swa_alloc = SWAAllocator(size_full, size_swa, P, device, full_id="target.full",
                             swa_id="target.swa", check_mode=check_mode)
    pool = HybridSWAPool(full_pool, swa, lmap, name="target")
    pool.model = m.name  # the model it was built for: a backend of another one names both
    pool.register_mapping(swa_alloc.mapping)
    for sub in pool.sub_pools:
        swa_alloc.attach(sub)
    return pool, swa_alloc
