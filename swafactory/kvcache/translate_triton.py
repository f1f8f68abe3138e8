"""Triton kernel of the full→SWA translation: ``out = mapping[idx] // page_size`` in one pass.

triton is imported on first use only (the package works without it). On CPU tensors the kernel
runs under ``TRITON_INTERPRET=1``; the interpreter is chosen when the kernel is defined, so the
kernel is built once per interpreter setting.
"""
from __future__ import annotations

import functools
import os
from typing import Any

import torch

__all__ = ["translate_triton", "BLOCK"]

BLOCK = 256  # ids per program; a gather is memory-bound, so the block only amortises launch cost


_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""Read once, at import (as Triton itself reads it): planning reads no environment."""


@functools.cache
def _kernel(interpret: bool) -> Any:
    del interpret  # part of the cache key: triton.jit reads TRITON_INTERPRET when decorating
    import triton
    import triton.language as tl

    @triton.jit
    def _translate(idx_ptr, map_ptr, out_ptr, n, map_len, PAGE_SIZE: tl.constexpr,
                   BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = offs < n
        idx = tl.load(idx_ptr + offs, mask=live, other=0).to(tl.int64)
        inside = (idx >= 0) & (idx < map_len)  # outside the mapping → dummy slot 0, never a fault
        val = tl.load(map_ptr + idx, mask=live & inside, other=0)
        if PAGE_SIZE > 1:
            val = val // PAGE_SIZE  # translate the slot first, then reduce to a page id
        tl.store(out_ptr + offs, val.to(out_ptr.dtype.element_ty), mask=live)

    return _translate


def translate_triton(idx: torch.Tensor, table: torch.Tensor, page_size: int,
                     dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``table[idx] // page_size`` with ids outside ``table`` mapped to 0.

    ``idx``: full-space slot ids, any shape, int32/int64. ``table``: the full→SWA mapping,
    shape ``[size_full + page_size + 1]``, int64, on ``idx``'s device. Returns ``idx``'s shape in
    ``dtype`` (int32 or int64).
    """
    import triton

    if table.device != idx.device:
        raise ValueError(f"mapping on {table.device} but ids on {idx.device}")
    if dtype not in (torch.int32, torch.int64):
        raise ValueError(f"dtype must be int32 or int64, got {dtype}")
    flat = idx.reshape(-1).contiguous()
    out = torch.empty(flat.shape, dtype=dtype, device=idx.device)
    n = flat.numel()
    if n:
        kernel = _kernel(_INTERPRET)
        kernel[(triton.cdiv(n, BLOCK),)](flat, table.contiguous(), out, n, table.numel(),
                                         PAGE_SIZE=page_size, BLOCK=BLOCK)
    return out.reshape(idx.shape)
