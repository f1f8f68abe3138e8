"""Typed index spaces: KV locations carry their space, and only `translate` makes SWA ones.

Every slot the scheduler hands out is an index into the *full* index space (``req_to_token``,
write locations). SWA-layer K/V live at ``full_to_swa[full_slot]``. A `Locs` says which space its
integers index (``full`` or ``swa``), which pool owns that space (``pool_id``), and whether the
integers are slots or page ids (``page_size``). Pools refuse a `Locs` of another space
(DESIGN invariant 1).

``Locs(space="swa", ...)`` cannot be built by hand: `translate` is the only producer of SWA-space
locations, and it refuses page ids, so slot ids are always translated *before* ``// page_size``
(invariant 3)::

    swa_slots = translate(full_slots, allocator, pool)        # Locs(space="swa")
    swa_pages = swa_slots.pages(page_size)                    # mapping[slot] // page_size
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from swafactory.errors import SpaceError

__all__ = ["Space", "Locs", "SlotMapping", "translate", "gather_torch"]

Space = Literal["full", "swa"]

# Private proof of origin: `Locs.__post_init__` accepts space="swa" only with this object.
_TRANSLATED = object()
_INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True, eq=False)
class Locs:
    """A tensor of KV locations in one typed index space.

    ``tensor``: any shape (``[n]`` write locations, ``[bs, max_len]`` tables), dtype int32 or
    int64, on the pool's device. Value 0 is the dummy slot (page) of every sub-pool.
    ``pool_id`` names the pool that owns the index space (e.g. ``target.full``, ``target.swa``);
    pools indexed by the same slots (an own-pool draft) accept it too.
    ``page_size`` is 1 for slot ids, P for page ids (slot // P).
    """

    space: Space
    pool_id: str
    tensor: torch.Tensor
    page_size: int = 1
    _origin: object = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.space not in ("full", "swa"):
            raise SpaceError(f"Locs space must be 'full' or 'swa', got {self.space!r}")
        if self.tensor.dtype not in _INDEX_DTYPES:
            raise SpaceError(f"Locs tensor must be int32 or int64, got {self.tensor.dtype}")
        if self.page_size < 1:
            raise SpaceError(f"Locs page_size must be >= 1, got {self.page_size}")
        if self.space == "swa" and self._origin is not _TRANSLATED:
            raise SpaceError("swa-space Locs are produced only by swafactory.kvcache.translate "
                             "(from full-space slots and the allocator's full→SWA mapping)")

    def __len__(self) -> int:
        return self.tensor.numel()

    @property
    def is_pages(self) -> bool:
        """True when the integers are page ids (slot // page_size) rather than slot ids."""
        return self.page_size > 1

    def pages(self, page_size: int) -> Locs:
        """Page ids ``slot // page_size`` in the same space (translate first, then divide)."""
        if self.is_pages:
            raise SpaceError(f"these Locs are already page ids (page_size={self.page_size})")
        return self._derive(self.tensor // page_size, page_size)

    def to(self, device: torch.device | str | None = None,
           dtype: torch.dtype | None = None) -> Locs:
        """Same space and pool, tensor moved or cast (int32 page tables for FA3-style kernels)."""
        return self._derive(self.tensor.to(device=device, dtype=dtype), self.page_size)

    def __getitem__(self, index: object) -> Locs:
        """Slice or gather the tensor; the space is kept (a reorder does not change the space)."""
        return self._derive(self.tensor[index], self.page_size)

    @classmethod
    def _made(cls, space: Space, pool_id: str, tensor: torch.Tensor, page_size: int = 1,
              origin: object = None) -> Locs:
        """`Locs(...)` without `__post_init__`'s call (a planner makes several per forward): the
        cheap checks inline, anything unusual through the constructor, which raises as always.
        SWA space still needs the proof of origin, which only this module has."""
        if ((space != "full" and origin is not _TRANSLATED) or page_size < 1
                or tensor.dtype not in _INDEX_DTYPES):
            return cls(space, pool_id, tensor, page_size, origin)  # raises (or is unusual)
        loc = object.__new__(cls)
        loc.__dict__.update(space=space, pool_id=pool_id, tensor=tensor, page_size=page_size,
                            _origin=origin)  # a frozen dataclass's fields live in its __dict__
        return loc

    def _derive(self, tensor: torch.Tensor, page_size: int) -> Locs:
        return Locs(self.space, self.pool_id, tensor, page_size, self._origin)

    @classmethod
    def dummy(cls, space: Space, pool_id: str, n: int, device: torch.device | str) -> Locs:
        """``[n]`` int64 locations all at slot 0, the dummy slot of every space (what a CUDA
        graph's padding rows read and write)."""
        return cls(space, pool_id, torch.zeros(n, dtype=torch.int64, device=device),
                   _origin=_TRANSLATED)

    def copy_into(self, buffer: torch.Tensor, *, pad: bool = True) -> Locs:
        """These ``[n]`` slot ids copied into ``buffer[:n]`` (the rest set to the dummy slot 0,
        unless ``pad`` is False), as Locs of the same space over ``buffer``: a CUDA graph's
        static write slots, refilled in place. buffer: ``[m ≥ n]`` int64 on the same device."""
        n = len(self)
        if buffer.dim() != 1 or buffer.numel() < n or buffer.dtype != torch.int64:
            raise ValueError(f"copy_into needs an int64 [m >= {n}] buffer, got "
                             f"{buffer.dtype} {list(buffer.shape)}")
        buffer[:n].copy_(self.tensor.reshape(-1), non_blocking=True)
        if n < buffer.numel() and pad:
            buffer[n:].zero_()
        return self._derive(buffer, self.page_size)


@dataclass(frozen=True, eq=False)
class SlotMapping:
    """The allocator's full→SWA slot table, with the identities of both index spaces.

    ``table``: shape ``[size_full + page_size + 1]``, dtype int64; ``table[full_slot]`` is the
    SWA slot, 0 = absent (never mapped, evicted or freed). The allocator mutates it in place, so
    a `SlotMapping` always shows the live state.
    """

    full_id: str
    swa_id: str
    table: torch.Tensor
    swa_size: int
    """Allocatable SWA slots; SWA values lie in ``[0, swa_size + page_size)``."""
    page_size: int


class _HasMapping(Protocol):
    @property
    def mapping(self) -> SlotMapping | None: ...


class _SwaTarget(Protocol):
    """A KVPool of space ``swa``, or a HybridSWAPool (its SWA sub-pool is used)."""

    @property
    def pool_id(self) -> str: ...


def _mapping_of(source: SlotMapping | _HasMapping) -> SlotMapping:
    mapping = source if isinstance(source, SlotMapping) else source.mapping
    if mapping is None:
        raise SpaceError(f"{type(source).__name__} has no full→SWA mapping (its pool is not split)")
    return mapping


def _swa_index_space(pool: _SwaTarget) -> str:
    sub = getattr(pool, "swa", pool)  # HybridSWAPool → its SWA sub-pool
    if sub is None or getattr(sub, "space", None) != "swa":
        raise SpaceError(f"pool {pool.pool_id!r} has no SWA sub-pool to translate into")
    return sub.indexed_by


def translate(locs: Locs, mapping: SlotMapping | _HasMapping, pool: _SwaTarget, *,
              impl: Literal["auto", "torch", "triton"] = "auto",
              dtype: torch.dtype = torch.int64, values: torch.Tensor | None = None) -> Locs:
    """Full-space slots → SWA-space slots of ``pool``: ``mapping.table[locs.tensor]``.

    ``locs``: full-space slot ids, any shape, int32/int64. ``mapping``: a `SlotMapping` or
    anything with a ``.mapping`` (the SWA allocator, a split pool). ``pool``: the SWA sub-pool
    (or the HybridSWAPool) whose buffers will be read with the result.
    Returns SWA slot ids, same shape, ``dtype`` (int64 scatter index by default). An id outside
    the mapping translates to 0 (the dummy slot), in both implementations, so a kernel never
    faults; in check mode the dummy slot holds NaN, which makes such a read visible.
    ``impl="auto"`` uses the Triton kernel on CUDA tensors when triton imports, else torch.
    ``values``: ``mapping.table[locs.tensor]`` as already gathered by a kernel that fuses the
    gather with its own work (the planner's key lists), same shape, int32/int64: the spaces are
    checked as for any translation and the values wrapped, not gathered again.
    """
    m, swa_id = _check(locs, mapping, pool)
    if values is not None:
        if values.shape != locs.tensor.shape:
            raise ValueError(f"values of shape {list(values.shape)} cannot be the translation "
                             f"of locations of shape {list(locs.tensor.shape)}")
        return Locs._made("swa", swa_id, values, 1, _TRANSLATED)
    return Locs._made("swa", swa_id, _gather(locs.tensor, m.table, 1, impl, dtype), 1, _TRANSLATED)


def _check(locs: Locs, mapping: SlotMapping | _HasMapping,
           pool: _SwaTarget) -> tuple[SlotMapping, str]:
    m = _mapping_of(mapping)
    if locs.space != "full":
        raise SpaceError(f"translate takes full-space locations, got space {locs.space!r} "
                         f"of {locs.pool_id!r}")
    if locs.is_pages:
        raise SpaceError("translate takes slot ids, not page ids: translate the slots first, "
                         "then divide by page_size")
    if locs.pool_id != m.full_id:
        raise SpaceError(f"locations of {locs.pool_id!r} cannot be translated with the mapping "
                         f"of {m.full_id!r}")
    swa_id = _swa_index_space(pool)
    if swa_id != m.swa_id:
        raise SpaceError(f"the mapping points into {m.swa_id!r}, but the pool to read is "
                         f"indexed by {swa_id!r}")
    return m, swa_id


def _gather(idx: torch.Tensor, table: torch.Tensor, page_size: int,
            impl: Literal["auto", "torch", "triton"], dtype: torch.dtype) -> torch.Tensor:
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(f"impl must be 'auto', 'torch' or 'triton', got {impl!r}")
    if impl == "triton" or (impl == "auto" and idx.is_cuda and _triton_available()):
        from swafactory.kvcache.translate_triton import translate_triton
        return translate_triton(idx, table, page_size, dtype)
    return gather_torch(idx, table, page_size, dtype)


def gather_torch(idx: torch.Tensor, table: torch.Tensor, page_size: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """Reference gather: ``table[idx] // page_size``, ids outside ``table`` → 0.

    idx: any shape, int32/int64; table: ``[n]`` int64. On a GPU four ops and no read-back: an id
    is in range exactly when clamping leaves it unchanged. On the host one min/max pass first:
    when every id is in range (always, for a planner's slots) the gather is all there is."""
    if idx.device.type == "cpu" and idx.numel() and table.numel():
        lo, hi = torch.aminmax(idx)
        if lo >= 0 and hi < table.numel():
            vals = table.index_select(0, idx.reshape(-1)).view(idx.shape)
            return (vals // page_size if page_size > 1 else vals).to(dtype)
    safe = idx.clamp(0, max(table.numel() - 1, 0))
    vals = table.index_select(0, safe.reshape(-1)).view(idx.shape)
    vals = vals.masked_fill_(safe != idx, 0)
    return (vals // page_size if page_size > 1 else vals).to(dtype)


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
