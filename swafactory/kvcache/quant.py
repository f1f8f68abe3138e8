"""KV stored as fp8 (``backend.kv_dtype=fp8_e4m3``): how a pool quantizes what it stores.

A pool's fp8 buffers hold ``x / scale`` rounded to e4m3 (round to nearest even, saturated at
±448), with one ``k_scale`` and one ``v_scale`` per layer (the pool holds them beside its
buffers; a checkpoint's calibrated scales, or 1.0). Reading dequantizes: ``x ≈ stored · scale``;
kernels fold ``k_scale`` into the softmax scale and ``v_scale`` into the output.

Stores and poisoning go through byte views: CPU torch has no ``index_copy_`` / ``index_fill_``
for float8 dtypes, and a byte copy is what the GPU does anyway.
"""
from __future__ import annotations

import torch

__all__ = ["FP8_DTYPES", "is_fp8", "query_dtype", "quantize", "store_rows", "poison_rows"]

FP8_DTYPES = frozenset({torch.float8_e4m3fn})
"""KV storage dtypes that carry per-layer scales."""

_NAN_BYTE = 0x7F  # e4m3fn: S.1111.111 is its only NaN (it has no infinities)


def is_fp8(dtype: torch.dtype) -> bool:
    """True for a KV dtype stored with scales."""
    return dtype in FP8_DTYPES


def query_dtype(kv_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the queries (and of the model's compute) beside KV stored as ``kv_dtype``:
    the KV dtype itself, bf16 for fp8 KV (as sglang and vLLM run fp8 caches)."""
    return torch.bfloat16 if is_fp8(kv_dtype) else kv_dtype


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (any float dtype) as ``dtype``: divided by ``scale`` and saturated to its range when
    ``dtype`` is fp8 (torch's float→fp8 cast gives NaN past the range on some versions), else a
    plain cast."""
    if not is_fp8(dtype):
        return x if x.dtype == dtype else x.to(dtype)
    top = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-top, top).to(dtype)


def store_rows(buf: torch.Tensor, rows: torch.Tensor, x: torch.Tensor, scale: float = 1.0) -> None:
    """``buf[rows] = x`` as the pool stores it. buf: [R, H, D]; rows: [n] int64 on buf's device;
    x: [n, H, D], any float dtype (quantized with ``scale`` when buf is fp8). One kernel."""
    if is_fp8(buf.dtype):
        q = quantize(x, scale, buf.dtype)
        buf.view(torch.uint8).index_copy_(0, rows, q.view(torch.uint8))
    else:
        buf.index_copy_(0, rows, x if x.dtype == buf.dtype else x.to(buf.dtype))


def poison_rows(buf: torch.Tensor, rows: torch.Tensor) -> None:
    """Fill ``buf[rows]`` with NaN (a check-mode pool's freed rows). rows: [n] int64."""
    if is_fp8(buf.dtype):
        buf.view(torch.uint8).index_fill_(0, rows, _NAN_BYTE)
    else:
        buf.index_fill_(0, rows, float("nan"))
