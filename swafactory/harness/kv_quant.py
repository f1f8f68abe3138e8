"""The harness's side of fp8 KV: the scales it gives a pool, and the oracle's own rounding.

A run with ``backend.kv_dtype=fp8_e4m3`` checks every layer twice: exactly, against attention
over what the pool should hold (each written value divided by the layer's scale, rounded to
e4m3 and multiplied back), and, as a reported figure, against attention over the values the
model wrote (how much fp8 costs against bf16).

The scales are powers of two and differ by layer, as a calibrated checkpoint's would (one
scale for every layer would let a kernel that drops the scales pass): a power of two keeps the
dequantized value exact in bf16, so the oracle's history holds it without rounding again.
"""
from __future__ import annotations

import torch

__all__ = ["harness_scales", "set_harness_scales", "fp8_roundtrip"]


def harness_scales(layer: int) -> tuple[float, float]:
    """``(k_scale, v_scale)`` of local layer ``layer``: 1/8, 1/16 or 1/32 for K and 1/16 or
    1/32 for V (standard normal draws stay far inside e4m3's ±448 after the division)."""
    return 2.0 ** -(3 + layer % 3), 2.0 ** -(4 + layer % 2)


def set_harness_scales(pool) -> None:
    """Give each layer of ``pool``'s fp8 sub-pools its harness scales (other pools: unchanged)."""
    for sub in pool.sub_pools:
        if sub.dtype == torch.float8_e4m3fn:
            for local in range(sub.num_layers):
                sub.set_scales(local, *harness_scales(local))


def fp8_roundtrip(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """What an fp8 pool returns for ``x`` stored with ``scale``: ``x / scale`` rounded to
    ``dtype`` (nearest even, saturated at its largest finite value), times ``scale``, in x's
    dtype. Written here, apart from the pool's own quantization, so that the oracle does not
    share the code it checks."""
    top = torch.finfo(dtype).max
    return ((x.float() / scale).clamp(-top, top).to(dtype).float() * scale).to(x.dtype)
