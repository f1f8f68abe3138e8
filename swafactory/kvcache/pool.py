"""KV buffers: one `KVPool` per index space, a `HybridSWAPool` that routes layers (`ReqToToken`,
the request → slot table, is `kvcache.req_to_token`'s, re-exported here).

A layer's K/V live where ``layers_mapping[layer_id] -> (sub_pool, local_id)`` says (DESIGN
invariant 3); whether a layer *has a window* is a separate, masking-only fact. Each sub-pool has
its own KV heads, head_dim and dtype (Gemma 4). Row 0 of every sub-pool (page 0) is the dummy slot:
never allocated, the target of padded writes and of absent (0) mapping entries (invariant 5).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Literal

import torch

from swafactory.errors import SpaceError
from swafactory.errors import CapacityError
from swafactory.guards import DeviceCheck
from swafactory.kvcache.locs import Locs, SlotMapping, Space
from swafactory.kvcache.quant import poison_rows, store_rows
from swafactory.kvcache.req_to_token import ReqToToken, host_to_device

__all__ = ["KVPool", "HybridSWAPool", "ReqToToken", "CapacityError", "SubPool",
           "layers_mapping_for", "host_to_device"]

SubPool = Literal["full", "swa"]


class KVPool:
    """Per-layer K and V buffers of ``size + page_size`` rows: ``[rows, num_kv_heads, head_dim]``.

    ``pool_id`` names this pool (``target.full``, ``target.swa``, ``draft.full``); ``space`` is
    the index space its rows are addressed in; ``indexed_by`` is the pool_id of the space's owner
    (itself by default; an own-pool draft is indexed by ``target.full``). In ``check_mode`` every
    row starts as NaN (nothing written yet) and `poison` refills freed rows with NaN, so a stale,
    absent or untranslated read shows up as NaN. With pages > 1 a page handed out is cleared to
    zero (`clear`): a request owns whole pages, and a kernel that loads whole pages (flash-attn-4's
    TMA path) reads the unwritten rows of a request's last page, masked, where 0 · NaN is NaN.
    """

    def __init__(self, size: int, page_size: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu", *,
                 pool_id: str = "target.full", space: Space = "full",
                 indexed_by: str | None = None, check_mode: bool = False,
                 held: Iterable[int] | None = None) -> None:
        for name, v in (("size", size), ("page_size", page_size), ("num_layers", num_layers),
                        ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"KVPool {pool_id!r}: {name} must be a positive int, got {v!r}")
        if size % page_size:
            raise ValueError(f"KVPool {pool_id!r}: size {size} is not a multiple of "
                             f"page_size {page_size}")
        if space not in ("full", "swa"):
            raise ValueError(f"KVPool {pool_id!r}: space must be 'full' or 'swa', got {space!r}")
        if check_mode and not dtype.is_floating_point:
            raise ValueError(f"KVPool {pool_id!r}: check mode poisons with NaN, which {dtype} "
                             "cannot hold")
        self.size, self.page_size, self.num_layers = size, page_size, num_layers
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.device = torch.device(device)
        self.pool_id, self.space = pool_id, space
        self.indexed_by = indexed_by or pool_id
        self.check_mode = check_mode
        self.rows = size + page_size  # page 0 is the dummy page
        fill = float("nan") if check_mode else 0.0
        # ``held``: the local layers given rows (None: all); the others get 0 rows, so a run that
        # attends a few layers takes their memory only, and a read or write of another raises
        self.held = tuple(range(num_layers) if held is None else sorted(set(held)))
        if self.held and not 0 <= self.held[0] <= self.held[-1] < num_layers:
            raise ValueError(f"KVPool {pool_id!r}: held layers {self.held} outside "
                             f"0..{num_layers - 1}")
        shape = lambda i: (self.rows if i in self.held else 0, num_kv_heads, head_dim)  # noqa: E731
        self.k_bufs = [torch.full(shape(i), fill, dtype=dtype, device=self.device)
                       for i in range(num_layers)]
        self.v_bufs = [torch.full(shape(i), fill, dtype=dtype, device=self.device)
                       for i in range(num_layers)]
        # per local layer: an fp8 pool stores x / scale (`swafactory.kvcache.quant`); host
        # floats, so a kernel takes them as arguments without a device read
        self.k_scales = [1.0] * num_layers
        self.v_scales = [1.0] * num_layers
        self.scales_version = 0  # bumped by set_scales: a backend's cached layer kwargs follow
        self.freed = 0  # frees of its rows (its allocator counts): older plans are re-checked

    def set_scales(self, local: int, k_scale: float, v_scale: float) -> None:
        """Local layer ``local``'s K and V scales (a checkpoint's calibrated ones); set them before
        the layer's first write: stored rows keep the scale they were written with."""
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not (isinstance(s, (int, float)) and math.isfinite(s) and s > 0):
                raise ValueError(f"KVPool {self.pool_id!r} layer {local}: {name} must be a "
                                 f"positive finite float, got {s!r}")
        self.k_scales[local], self.v_scales[local] = float(k_scale), float(v_scale)
        self.scales_version += 1

    @property
    def bytes(self) -> int:
        """K + V bytes of all layers at this size (held or not)."""
        return 2 * self.num_layers * self.rows * self.num_kv_heads * self.head_dim * \
            self.k_bufs[0].element_size()

    @property
    def held_bytes(self) -> int:
        """K + V bytes of the layers given rows: the memory this pool takes."""
        return self.bytes * len(self.held) // self.num_layers

    def clear(self, rows: torch.Tensor) -> None:
        """Fill ``rows`` ([n] int64) with zeros in every layer: pages just handed out (a no-op
        unless ``check_mode``, where they would still hold NaN)."""
        if not self.check_mode or rows.numel() == 0:
            return
        rows = rows.to(self.device, torch.int64)
        for buf in (b for i in self.held for b in (self.k_bufs[i], self.v_bufs[i])):
            (buf.view(torch.uint8) if buf.element_size() == 1 else buf).index_fill_(0, rows, 0)

    def poison(self, rows: torch.Tensor) -> None:
        """Fill ``rows`` (shape ``[n]``, int64, this pool's row ids) with NaN in every layer.

        A no-op unless ``check_mode``; allocators call it for every row they free.
        """
        if not self.check_mode or rows.numel() == 0:
            return
        rows = rows.to(self.device, torch.int64)
        for i in self.held:  # index_fill_: `k[rows] = nan` would send the scalar to the GPU,
            poison_rows(self.k_bufs[i], rows)  # a sync per layer
            poison_rows(self.v_bufs[i], rows)

    def accepts(self, locs: Locs) -> bool:
        """True when ``locs`` are slot ids in this pool's index space."""
        return (locs.space == self.space and locs.pool_id == self.indexed_by
                and not locs.is_pages)

    def __repr__(self) -> str:
        return (f"KVPool({self.pool_id!r}, space={self.space}, size={self.size}, "
                f"page_size={self.page_size}, layers={self.num_layers}, "
                f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype={self.dtype})")


def layers_mapping_for(model: object) -> dict[int, tuple[SubPool, int]]:
    """``layer_id -> (sub_pool, local_id)`` from a ModelSpec's layer types and ``hybrid_pool``.

    Sliding layers go to the ``swa`` sub-pool when the model splits its pool, every other layer
    (and every layer of an unsplit model) to ``full``; local ids count within each sub-pool.
    """
    split = bool(model.hybrid_pool)  # type: ignore[attr-defined]
    counts = {"full": 0, "swa": 0}
    out: dict[int, tuple[SubPool, int]] = {}
    for i, kind in enumerate(model.layer_types):  # type: ignore[attr-defined]
        sub: SubPool = "swa" if split and kind == "sliding_attention" else "full"
        out[i] = (sub, counts[sub])
        counts[sub] += 1
    return out


class HybridSWAPool:
    """A full and/or an SWA sub-pool, with ``layers_mapping`` deciding which one holds a layer.

    Either sub-pool may be None: an all-SWA model has an SWA sub-pool alone; an unsplit model
    (``hybrid_pool: false``, or no sliding layers) has a full one alone. ``read_only`` views
    (FROZEN_KV drafts) refuse writes. The allocator's full→SWA mapping is registered with
    `register_mapping` and read live through `mapping`.
    """

    def __init__(self, full: KVPool | None, swa: KVPool | None,
                 layers_mapping: Mapping[int, tuple[SubPool, int]], *, name: str = "target",
                 read_only: bool = False) -> None:
        if full is None and swa is None:
            raise ValueError(f"HybridSWAPool {name!r} needs a full or an SWA sub-pool")
        if full is not None and full.space != "full":
            raise SpaceError(f"HybridSWAPool {name!r}: the full sub-pool {full.pool_id!r} has "
                             f"space {full.space!r}")
        if swa is not None and swa.space != "swa":
            raise SpaceError(f"HybridSWAPool {name!r}: the SWA sub-pool {swa.pool_id!r} has "
                             f"space {swa.space!r}")
        subs = {"full": full, "swa": swa}
        for layer_id, (sub, local) in layers_mapping.items():
            pool = subs.get(sub)
            if pool is None:
                raise ValueError(f"HybridSWAPool {name!r}: layer {layer_id} maps to sub-pool "
                                 f"{sub!r}, which this pool does not have")
            if not 0 <= local < pool.num_layers:
                raise ValueError(f"HybridSWAPool {name!r}: layer {layer_id} maps to local layer "
                                 f"{local} of {pool.pool_id!r}, which has {pool.num_layers}")
        self.full, self.swa, self.name, self.read_only = full, swa, name, read_only
        self.layers_mapping: Mapping[int, tuple[SubPool, int]] = MappingProxyType(
            dict(layers_mapping))
        self._mapping: SlotMapping | None = None
        # sub-pool id → the last location tensor found in bounds, and its version: every layer
        # of a group writes the same planned locations, and on a GPU each check is a sync
        self._in_bounds: dict[str, tuple[torch.Tensor, int]] = {}

    @property
    def pool_id(self) -> str:
        return self.name

    @property
    def is_split(self) -> bool:
        """True when some layers live in an SWA-index-space sub-pool (reads need translation)."""
        return self.swa is not None

    @property
    def mapping(self) -> SlotMapping | None:
        """The registered full→SWA mapping (live: the allocator mutates it in place)."""
        return self._mapping

    @property
    def sub_pools(self) -> tuple[KVPool, ...]:
        return tuple(p for p in (self.full, self.swa) if p is not None)

    def register_mapping(self, mapping: SlotMapping, *, check_capacity: bool = True) -> None:
        """Bind the full→SWA mapping this pool's SWA sub-pool is addressed with.

        ``check_capacity=False`` binds an under-sized sub-pool (fault injection only)."""
        if self.swa is None:
            raise SpaceError(f"pool {self.name!r} has no SWA sub-pool to map into")
        if mapping.swa_id != self.swa.indexed_by:
            raise SpaceError(f"mapping into {mapping.swa_id!r} cannot address {self.name!r}'s SWA "
                             f"sub-pool, indexed by {self.swa.indexed_by!r}")
        if check_capacity and mapping.swa_size > self.swa.size:
            raise CapacityError(f"pool {self.name!r}: SWA sub-pool holds {self.swa.size} slots but "
                                f"the mapping hands out up to {mapping.swa_size}; it must be ≥ the "
                                "target's SWA size")
        self._mapping = mapping

    def sub_pool(self, layer_id: int) -> KVPool:
        """The sub-pool holding ``layer_id``'s K/V."""
        try:
            sub, _ = self.layers_mapping[layer_id]
        except KeyError:
            raise KeyError(f"pool {self.name!r} has no layer {layer_id}; layers: "
                           f"{sorted(self.layers_mapping)}") from None
        pool = self.full if sub == "full" else self.swa
        assert pool is not None  # checked in __init__
        return pool

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor, KVPool]:
        """``(k_buf, v_buf, sub_pool)``; buffers ``[rows, kv_heads, head_dim]``, rows in the
        sub-pool's index space."""
        pool = self.sub_pool(layer_id)
        local = self.layers_mapping[layer_id][1]
        return pool.k_bufs[local], pool.v_bufs[local], pool

    @property
    def scales_version(self) -> int:
        """Changes whenever a sub-pool's scales do."""
        return sum(p.scales_version for p in self.sub_pools)

    def kv_scales(self, layer_id: int) -> tuple[float, float]:
        """``(k_scale, v_scale)`` of ``layer_id`` (1.0 unless set; only fp8 pools use them)."""
        pool = self.sub_pool(layer_id)
        local = self.layers_mapping[layer_id][1]
        return pool.k_scales[local], pool.v_scales[local]

    def set_kv_scales(self, layer_id: int, k_scale: float, v_scale: float) -> None:
        """Set ``layer_id``'s K and V scales in the sub-pool that holds it (`KVPool.set_scales`)."""
        self.sub_pool(layer_id).set_scales(self.layers_mapping[layer_id][1], k_scale, v_scale)

    def check(self, layer_id: int, locs: Locs) -> DeviceCheck | None:
        """The checks of a checked `write`, without writing: an engine that writes inside a CUDA
        graph checks each replay's slots here, outside it. The typed space (metadata) raises
        now; the bounds (check mode only) come back as a `guards.DeviceCheck` computed on the
        device (None: nothing to check), for the caller to read where reading is free
        (`AttentionBackend`: at once on CPU, at `raise_pending` on CUDA)."""
        pool = self._space_checked(layer_id, locs)
        if pool.check_mode and len(locs):
            return self._bounds(layer_id, locs.tensor, pool)
        return None

    def _space_checked(self, layer_id: int, locs: Locs) -> KVPool:
        pool = self.sub_pool(layer_id)
        if not pool.accepts(locs):
            unit = f", page ids of size {locs.page_size}" if locs.is_pages else ""
            raise SpaceError(
                f"layer {layer_id} of pool {self.name!r} lives in sub-pool {pool.pool_id!r}: "
                f"expected {pool.space}-space slots of {pool.indexed_by!r}, got {locs.space}-space "
                f"locations of {locs.pool_id!r}{unit}"
                + (" (translate full slots with swafactory.kvcache.translate first)"
                   if pool.space == "swa" and locs.space == "full" else ""))
        return pool

    def _checked(self, layer_id: int, locs: Locs) -> tuple[torch.Tensor, torch.Tensor, KVPool]:
        """`check`, its bounds read at once (`write` and `read` called directly)."""
        k_buf, v_buf, pool = self.get_kv(layer_id)
        bounds = self.check(layer_id, locs)
        err = None if bounds is None else bounds.error()
        if err is not None:
            self._in_bounds.pop(pool.pool_id, None)
            raise err
        return k_buf, v_buf, pool

    def _bounds(self, layer_id: int, t: torch.Tensor, pool: KVPool) -> DeviceCheck | None:
        """Min and max of ``t`` on the device, against ``pool.rows``; None when ``t`` was checked
        for an earlier layer and is unchanged since (a graph's buffers change in place)."""
        seen = self._in_bounds.get(pool.pool_id)
        if seen is not None and seen[0] is t and seen[1] == t._version:
            return None
        self._in_bounds[pool.pool_id] = (t, t._version)
        rows, pid = pool.rows, pool.pool_id

        def explain(word: list[int]) -> CapacityError | None:
            lo, hi = word
            if 0 <= lo and hi < rows:
                return None
            return CapacityError(f"layer {layer_id}: locations outside {pid!r}'s {rows} rows "
                                 f"(min {lo}, max {hi})")
        return DeviceCheck(torch.stack(torch.aminmax(t.reshape(-1))).long(), explain)

    def write(self, layer_id: int, locs: Locs, k: torch.Tensor, v: torch.Tensor, *,
              checked: bool = True) -> None:
        """Store K/V of ``len(locs)`` tokens. ``locs``: ``[n]`` slots in the layer's sub-pool
        space; ``k``, ``v``: ``[n, kv_heads, head_dim]``, cast to the sub-pool's dtype (an fp8
        sub-pool quantizes with the layer's scales).
        ``checked=False`` skips the typed-space and bounds checks (stores at whatever rows
        ``locs`` holds), as an engine that embedded only the kernels would."""
        if self.read_only:
            raise SpaceError(f"pool {self.name!r} is a read-only view; layer {layer_id} "
                             "cannot be written")
        k_buf, v_buf, pool = (self._checked(layer_id, locs) if checked
                              else self.get_kv(layer_id))
        idx = locs.tensor.reshape(-1).long()
        want = (idx.numel(), pool.num_kv_heads, pool.head_dim)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise ValueError(f"layer {layer_id}: k/v must be {list(want)}, got "
                             f"{list(k.shape)} / {list(v.shape)}")
        local = self.layers_mapping[layer_id][1]
        idx = idx.to(k_buf.device)
        store_rows(k_buf, idx, k, pool.k_scales[local])
        store_rows(v_buf, idx, v, pool.v_scales[local])
        if pool.check_mode:  # padded tokens write the dummy page; keep it poisoned
            k_buf[:pool.page_size] = float("nan")
            v_buf[:pool.page_size] = float("nan")

    def read(self, layer_id: int, locs: Locs) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather K/V at ``locs`` (any shape ``S``); returns two ``[*S, kv_heads, head_dim]``."""
        k_buf, v_buf, _ = self._checked(layer_id, locs)
        idx = locs.tensor.long()
        return k_buf[idx], v_buf[idx]

    def __repr__(self) -> str:
        return (f"HybridSWAPool({self.name!r}, full={self.full!r}, swa={self.swa!r}, "
                f"read_only={self.read_only})")
