"""Draft-worker pools: own full-indexed pool, FROZEN_KV read-only view, DFlash split pool.

A draft shares the target's allocator, so it is addressed with the target's *full* slots
(DESIGN invariant 6): an own pool must hold at least the target's full capacity (sglang #17630),
and a split DFlash pool that shares the target's mapping needs at least its SWA capacity.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from swafactory.kvcache.allocator import SWAAllocator, TokenAllocator
from swafactory.kvcache.pool import CapacityError, HybridSWAPool, KVPool, layers_mapping_for

__all__ = ["own_draft_pool", "frozen_draft_view", "split_draft_pool", "build_draft_pool",
           "draft_layer_types"]

Allocator = TokenAllocator | SWAAllocator


def _page_floor(n: float, page_size: int) -> int:
    return int(n) // page_size * page_size


def _check_headroom(headroom: float, unsafe_undersized: bool) -> None:
    if headroom <= 0:
        raise ValueError(f"headroom must be > 0, got {headroom}")
    if headroom < 1 and not unsafe_undersized:
        raise CapacityError(f"headroom {headroom} < 1 under-sizes a pool addressed by the "
                            "target's slots (sglang #17630); only fault injection may ask for it, "
                            "with unsafe_undersized=True")


def own_draft_pool(target_full_size: int, page_size: int, num_layers: int, num_kv_heads: int,
                   head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu", *,
                   full_id: str = "target.full", headroom: float = 1.0,
                   unsafe_undersized: bool = False, check_mode: bool = False) -> HybridSWAPool:
    """A non-split draft pool indexed by the target's full slots (EAGLE, EAGLE3, NextN, …).

    Its size is ``page_floor(target_full_size * headroom)``. ``headroom < 1`` under-sizes it
    (sglang #17630: full slots overflow the draft pool) and raises `CapacityError` unless
    ``unsafe_undersized`` (the fault-injection switch ``no_draft_headroom``).
    """
    _check_headroom(headroom, unsafe_undersized)
    size = max(page_size, _page_floor(target_full_size * headroom, page_size))
    pool = KVPool(size, page_size, num_layers, num_kv_heads, head_dim, dtype, device,
                  pool_id="draft.full", space="full", indexed_by=full_id, check_mode=check_mode)
    return HybridSWAPool(pool, None, {j: ("full", j) for j in range(num_layers)}, name="draft")


def frozen_draft_view(target: HybridSWAPool, binding: Sequence[int]) -> HybridSWAPool:
    """A read-only view of ``target``: draft layer j reads target layer ``binding[j]``.

    The binding must pick layers of the same type as the draft layers (see
    ``swafactory.resolve.layout.frozen_draft_binding``). Buffers and mapping are the target's, so the
    view's locations are the target's; writes are refused (FROZEN_KV drafts write no KV).
    """
    mapping = {}
    for j, t in enumerate(binding):
        if t not in target.layers_mapping:
            raise ValueError(f"draft layer {j} is bound to target layer {t}, which the target "
                             f"pool {target.name!r} does not have")
        mapping[j] = target.layers_mapping[t]
    view = HybridSWAPool(target.full, target.swa, mapping, name=f"{target.name}.frozen_view",
                         read_only=True)
    if target.mapping is not None:
        view.register_mapping(target.mapping)
    return view


def split_draft_pool(target: HybridSWAPool, layer_types: Sequence[str], dtype: torch.dtype,
                     device: torch.device | str = "cpu", *, headroom: float = 1.0,
                     unsafe_undersized: bool = False, check_mode: bool = False,
                     swa_rows: int | None = None) -> HybridSWAPool:
    """A split draft pool (DFlash ``draft_pool_split``) sharing ``target``'s full→SWA mapping.

    ``layer_types``: the draft's ``sliding_attention``/``full_attention`` per layer; each group
    takes the target's geometry of that type. Both sub-pools get ``headroom`` × the target's
    capacity, which must be ≥ the target's (full slots and the shared mapping's SWA slots both
    address it); ``headroom < 1`` needs ``unsafe_undersized`` (fault injection).
    ``swa_rows``: the SWA sub-pool's slots instead (at least its share; sglang's draft runner
    holds one slot per target token, which fault injection reproduces).
    """
    _check_headroom(headroom, unsafe_undersized)
    if target.swa is None or target.mapping is None:
        raise ValueError(f"a split draft pool shares the target's mapping, but the target pool "
                         f"{target.name!r} is not split or has no mapping registered")
    model = _Types(tuple(layer_types))
    lmap = layers_mapping_for(model)
    subs: dict[str, KVPool | None] = {"full": None, "swa": None}
    for sub, twin in (("full", target.full), ("swa", target.swa)):
        n = sum(1 for s, _ in lmap.values() if s == sub)
        if not n:
            continue
        if twin is None:
            raise ValueError(f"draft has {sub} layers but the target pool {target.name!r} has no "
                             f"{sub} sub-pool to take their geometry and index space from")
        size = max(twin.page_size, _page_floor(twin.size * headroom, twin.page_size))
        if sub == "swa" and swa_rows is not None:
            size = max(size, _page_floor(swa_rows, twin.page_size))
        subs[sub] = KVPool(size, twin.page_size, n, twin.num_kv_heads, twin.head_dim, dtype,
                           device, pool_id=f"draft.{sub}", space=twin.space,
                           indexed_by=twin.indexed_by, check_mode=check_mode)
    pool = HybridSWAPool(subs["full"], subs["swa"], lmap, name="draft")
    if pool.swa is not None:
        pool.register_mapping(target.mapping, check_capacity=not unsafe_undersized)
    return pool


class _Types:
    """The two ModelSpec fields `layers_mapping_for` reads, for a draft's layer list."""

    hybrid_pool = True

    def __init__(self, layer_types: tuple[str, ...]) -> None:
        self.layer_types = layer_types


def draft_layer_types(cfg: object) -> list[str]:
    """The layer types of an own draft pool that `build_draft_pool` builds: the target's last
    ``draft_num_layers`` types for DFlash's ``draft_pool_split`` on a split target (sliding
    layers and ``hybrid_pool``, as `factory.build_pools` splits it), full attention otherwise.
    A window-retained draft (``draft_kv_retention=window``) on a split target is all sliding:
    its K/V sits on the target's SWA slots. A draft model built for the pool takes these types."""
    spec, m = cfg.spec, cfg.model  # type: ignore[attr-defined]
    k = spec.draft_num_layers
    split = bool(m.swa_layers) and m.hybrid_pool
    if split and getattr(spec, "draft_kv_retention", "full") == "window":
        return ["sliding_attention"] * k
    if getattr(spec, "draft_pool_split", False) and split:
        return list(m.layer_types[-k:])
    return ["full_attention"] * k


def build_draft_pool(cfg: object, target: HybridSWAPool, allocator: Allocator, *,
                     device: torch.device | str = "cpu", check_mode: bool = False,
                     headroom: float = 1.0, unsafe_undersized: bool = False,
                     binding: Sequence[int] | None = None,
                     swa_rows: int | None = None) -> HybridSWAPool | None:
    """The draft pool a `SwaFactoryConfig` asks for, attached to ``allocator``; or None.

    - ``draft_kv: none``: None;
    - ``draft_kv: target_pool`` (FROZEN_KV): `frozen_draft_view` with ``binding``, the target
      layer each draft layer reads (the caller's ``layout.frozen_draft_binding(cfg)``: a layout
      decision, passed in so storage imports nothing above it);
    - DFlash with ``draft_pool_split``, or any own-pool draft with ``draft_kv_retention=window``,
      on a split target: `split_draft_pool` of `draft_layer_types` (the target's last
      ``draft_num_layers`` layer types; all sliding for a window-retained draft);
    - any other ``own_pool``: `own_draft_pool` of ``draft_num_layers`` layers with the target's
      full geometry (SWA geometry for an all-SWA target), sized to the allocator's full space.

    Own pools are attached to the allocator, so check mode poisons their freed rows too.
    ``headroom < 1`` with ``unsafe_undersized`` (fault injection) skips the capacity checks;
    ``swa_rows``: a split pool's SWA slots (`split_draft_pool`).
    """
    from swafactory.kvcache.factory import torch_dtype

    spec, model, backend = cfg.spec, cfg.model, cfg.backend  # type: ignore[attr-defined]
    dtype = torch_dtype(backend.kv_dtype)
    if spec.draft_kv == "none":
        return None
    if spec.draft_kv == "target_pool":
        if binding is None:
            raise ValueError("draft_kv=target_pool: pass binding=layout.frozen_draft_binding(cfg), "
                             "the target layer each draft layer reads")
        return frozen_draft_view(target, binding)
    if "sliding_attention" in draft_layer_types(cfg) and target.is_split:
        pool = split_draft_pool(target, draft_layer_types(cfg), dtype, device,
                                headroom=headroom, unsafe_undersized=unsafe_undersized,
                                check_mode=check_mode, swa_rows=swa_rows)
    else:
        geo = model.full or model.swa
        pool = own_draft_pool(allocator.full_size, backend.page_size, spec.draft_num_layers,
                              geo.num_kv_heads, geo.head_dim, dtype, device,
                              full_id=allocator.full_id, headroom=headroom,
                              unsafe_undersized=unsafe_undersized, check_mode=check_mode)
    for sub in pool.sub_pools:
        allocator.attach(sub, check_capacity=not unsafe_undersized)
    return pool
