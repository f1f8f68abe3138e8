"""FlashInfer's host-planned inputs, built from the planner's tables without a read-back.

* `page_table`: a pass's key lists as FlashInfer's page table of the pool's own pages (page ids,
  last-page lengths), the lists starting on page starts as the planner makes them;
* `custom_mask` / `packed_custom_mask`: the visibility ``structure & (q_pos - kv_pos < W)`` in
  FlashInfer's per-request row-major layout, packed 8 to a byte.

Only host indptrs are read on the host; everything else is built on the tables' device.

Masks travel packed (`packed_custom_mask`): FlashInfer 0.6.18 packs a bool ``custom_mask`` with
``segment_packbits``, which reads the packed size back from the device (a host sync in every
masked plan). Its kernel reads request b's bits from byte ``mask_indptr[b]``, but for a mask given
packed its plan sets ``mask_indptr`` to the *bit* offsets ``sum q_len·kv_len``. So eagerly each
request's bytes are placed at that offset (``layout="bit_offsets"``: as many bytes as mask
elements, the gaps unused); a graph's buffers are packed densely and the adapter rewrites the
``mask_indptr`` buffer it owns with the byte offsets after each plan. Both are host-known: nothing
is read back. Verified on 0.6.18 only: a FlashInfer whose plan hands packed masks byte offsets
would misplace the eager layout's bits, and `tests/backends/test_gpu_vs_oracle.py -k flashinfer`
(every masked mode against the oracle) is the check to run before moving past 0.6.x.
"""
from __future__ import annotations

import torch

from swafactory.metadata.vector import to_device

__all__ = ["page_table", "custom_mask", "packed_custom_mask"]


def page_table(kv_host: torch.Tensor, rows: torch.Tensor,
               page: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pass's key lists as FlashInfer's page table of the pool's own pages.

    kv_host: [B+1] int32 host offsets into ``rows``; rows: [n] int32 slot rows on the device, each
    request's starting on a page start and running through its pages' slots in order (the
    planner's and the allocator's rule). Returns (page indptr [B+1] int32 on the host, page ids
    [pages] int32 on the device: every ``page``-th row // page, last page lengths [B] int32 on the
    host; an empty list has 0 pages and length ``page``, so FlashInfer counts 0 keys). Host
    arithmetic and one gather: nothing is read back."""
    kv_len = (kv_host[1:] - kv_host[:-1]).long()
    pages = (kv_len + page - 1) // page
    ptr = torch.zeros(kv_len.numel() + 1, dtype=torch.int64)
    torch.cumsum(pages, 0, out=ptr[1:])
    b = torch.repeat_interleave(torch.arange(kv_len.numel()), pages)
    first = kv_host[:-1].long()[b] + (torch.arange(int(ptr[-1])) - ptr[b]) * page
    ids = rows[to_device(first, rows.device)] // page
    return ptr.to(torch.int32), ids.to(torch.int32), (kv_len - (pages - 1) * page).to(torch.int32)


def custom_mask(tables, window: int | None) -> torch.Tensor:
    """The visibility mask FlashInfer's custom-mask prefill needs, flattened per request.

    tables: `metadata.AttnTables`. Returns bool ``[sum_b q_len_b * kv_len_b]`` on the tables'
    device, request b's ``[q_len_b, kv_len_b]`` block row-major (FlashInfer's mask layout, and the
    planner's structure mask's): ``structure & (q_pos - kv_pos < W)``; with no structure mask,
    causal by position. Built on the device in one vectorized pass: element e of block b is
    (i, j) = divmod(e - start_b, kv_len_b); only the host indptrs are read on the host.
    """
    B, sizes, kv_lens, starts, heads = _blocks(tables)
    dev, total = tables.qo_indptr.device, int(sizes.sum())
    sizes_d, starts_d, kvl_d, qo_d, kv_d = _ship([sizes, starts, kv_lens, *heads], dev)
    b = torch.repeat_interleave(torch.arange(B, device=dev), sizes_d, output_size=total)
    o = torch.arange(total, device=dev) - starts_d[b]
    return _visible(tables, window, starts_d[b], o, kvl_d[b], qo_d[b], kv_d[b])


def _blocks(tables):
    """Host facts of each request's ``[q_len, kv_len]`` mask block, from the planner's host
    indptrs (nothing read back): (B, sizes, kv_lens, first elements, (first query, first key))."""
    qo_h, kv_h = tables.qo_host, tables.kv_host
    q_lens, kv_lens = (qo_h[1:] - qo_h[:-1]).long(), (kv_h[1:] - kv_h[:-1]).long()
    sizes = q_lens * kv_lens
    return (q_lens.numel(), sizes, kv_lens, torch.cumsum(sizes, 0) - sizes,
            (qo_h[:-1].long(), kv_h[:-1].long()))


def _ship(cols: list[torch.Tensor], dev: torch.device) -> tuple[torch.Tensor, ...]:
    """Equal-length host int64 columns on ``dev`` in one asynchronous copy."""
    return to_device(torch.cat(cols), dev).view(len(cols), -1).unbind(0)


def _visible(tables, window: int | None, at, e, kvl, qo0, kv0) -> torch.Tensor:
    """Visibility of element ``e`` (row-major) of a request's block whose first element is
    ``at`` in the structure mask, with ``kvl`` keys per row, its first query ``qo0`` and first key
    ``kv0``: ``structure & (q_pos - kv_pos < W)``, or causal by position without a structure mask.
    Every argument but ``tables`` and ``window`` is a device tensor; they broadcast together."""
    i = torch.div(e, kvl, rounding_mode="floor")
    qp = tables.q_pos.long()[qo0 + i]
    kp = tables.kv_pos.long()[kv0 + e - i * kvl]
    vis = tables.mask.bool()[at + e] if tables.mask is not None else qp >= kp
    if window is not None:
        vis = vis & (qp - kp < window)
    return vis


def packed_custom_mask(tables, window: int | None,
                       layout: str = "bit_offsets") -> tuple[torch.Tensor, torch.Tensor]:
    """`custom_mask` packed 8 elements to a byte (bit e % 8 of byte e // 8, little-endian, as
    FlashInfer reads it), built on the device without a read-back.

    Request b's block (``q_len_b * kv_len_b`` elements, row-major) starts at byte ``off[b]``:
    ``layout="bit_offsets"``: ``off[b] = sum_{c<b} q_len_c * kv_len_c`` (what FlashInfer 0.6.18's
    plan hands its kernel for a packed mask; the buffer has one byte per element, the bytes past a
    block's ``ceil(n_b / 8)`` unused and zero); ``"dense"``: blocks back to back,
    ``off[b] = sum_{c<b} ceil(q_len_c * kv_len_c / 8)``.

    Returns (bytes: uint8 ``[off[B]]`` on the tables' device, off: int32 ``[B+1]`` on the host).
    """
    if layout not in ("bit_offsets", "dense"):
        raise ValueError(f"layout must be 'bit_offsets' or 'dense', got {layout!r}")
    B, sizes, kv_lens, starts, heads = _blocks(tables)
    nbytes = (sizes + 7) // 8
    bstart = torch.cumsum(nbytes, 0) - nbytes  # each block's first useful byte, back to back
    off_h = torch.zeros(B + 1, dtype=torch.int32)  # host: its last entry sizes the buffer
    off_h[1:] = torch.cumsum(sizes if layout == "bit_offsets" else nbytes, 0)
    dev, n = tables.qo_indptr.device, int(nbytes.sum())
    nb_d, bs_d, st_d, size_d, kvl_d, qo_d, kv_d = _ship(
        [nbytes, bstart, starts, sizes, kv_lens, *heads], dev)
    off_d = st_d if layout == "bit_offsets" else bs_d  # each block's first byte in the output
    out = torch.zeros(int(off_h[-1]), dtype=torch.uint8, device=dev)
    if n == 0:
        return out, off_h
    b = torch.repeat_interleave(torch.arange(B, device=dev), nb_d, output_size=n)  # per byte
    ob = torch.arange(n, device=dev) - bs_d[b]
    e = ob[:, None] * 8 + torch.arange(8, device=dev)  # [n, 8] element in its block
    valid = e < size_d[b][:, None]
    e = torch.minimum(e, (size_d[b] - 1)[:, None])  # past the block: any element, masked below
    vis = _visible(tables, window, st_d[b][:, None], e, kvl_d[b][:, None], qo_d[b][:, None],
                   kv_d[b][:, None])
    bits = (vis & valid).to(torch.uint8) << torch.arange(8, dtype=torch.uint8, device=dev)
    out[off_d[b] + ob] = bits.sum(1, dtype=torch.uint8)
    return out, off_h
