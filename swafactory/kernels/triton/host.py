"""The host side that the Triton decode and extend launches share: the checks both stage-1 kernels
need, their outputs and split partials, their common launch arguments and the closing merge.

Only host code lives here; the kernels' bodies stay in ``decode.py`` and ``extend.py``, and the
device steps they share in ``online.py``.
"""
from __future__ import annotations

from typing import Any

import torch

from swafactory.kernels.triton.merge import combine_splits, compute_dtype

__all__ = ["check_rows", "outputs", "partials", "sinks_arg", "strides", "scalars", "flags",
           "finish"]


def check_rows(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor) -> torch.Tensor:
    """q with a contiguous last dim, after the head_dim and pool-row checks both kernels need
    (a tile's D is a power-of-two arange; rows are addressed by two strides only)."""
    d = q.shape[2]
    if d < 16 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two ≥ 16, got {d}")
    if q.stride(2) != 1:
        q = q.contiguous()
    if k_buf.stride(2) != 1 or v_buf.stride(2) != 1:
        raise ValueError("k_buf/v_buf need a contiguous last dim (pool rows are [Hkv, D])")
    return q


def outputs(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(o like q [total_q, Hq, D], lse [total_q, Hq] fp32), to be filled by the launch."""
    return torch.empty_like(q), torch.empty(q.shape[0], q.shape[1], dtype=torch.float32,
                                            device=q.device)


def partials(q: torch.Tensor, splits: int, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(po [total_q, Hq, splits, D], plse [total_q, Hq, splits]) fp32 for stage 2; with one split
    the kernel writes the output itself and both are ``lse`` (a placeholder pointer)."""
    if splits <= 1:
        return lse, lse
    total_q, hq, d = q.shape
    return (torch.empty(total_q, hq, splits, d, dtype=torch.float32, device=q.device),
            torch.empty(total_q, hq, splits, dtype=torch.float32, device=q.device))


def sinks_arg(sinks: torch.Tensor | None, lse: torch.Tensor) -> torch.Tensor:
    """The kernels' sinks pointer: fp32 sinks, or ``lse`` as a placeholder (HAS_SINKS False)."""
    return sinks.float().contiguous() if sinks is not None else lse


def strides(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
            o: torch.Tensor) -> tuple[int, ...]:
    """The (token, head) strides of q, the K and V pools and o, in the kernels' argument order."""
    return (q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0),
            v_buf.stride(1), o.stride(0), o.stride(1))


def scalars(scale: float, k_scale: float, softcap: float | None,
            window: int | None) -> tuple[float, float, int]:
    """(scale, softcap, window) as the kernels take them: k_scale joins the softmax scale, and an
    absent softcap or window is a placeholder its HAS_ flag turns off."""
    return float(scale) * k_scale, float(softcap or 1.0), int(window or 1)


def flags(q: torch.Tensor, k_buf: torch.Tensor, window: int | None, softcap: float | None,
          sinks: torch.Tensor | None) -> dict[str, Any]:
    """The compile-time options both kernels take alike (fp32 q: dots in IEEE precision, not
    TF32; tiles multiplied in ``compute_dtype``)."""
    return dict(HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None,
                HAS_SINKS=sinks is not None,
                PRECISION="ieee" if q.dtype == torch.float32 else None,
                CDT=compute_dtype(q.dtype, k_buf.dtype))


def finish(o: torch.Tensor, lse: torch.Tensor, po: torch.Tensor, plse: torch.Tensor,
           splits: int, sinks: torch.Tensor | None,
           v_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) after stage 2 merges the splits (and adds the sink) and v_scale is applied."""
    if splits > 1:
        combine_splits(po, plse, sinks.float().contiguous() if sinks is not None else None, o, lse)
    if v_scale != 1.0:  # o is linear in V; the sink and the splits' merge only weigh it
        o.mul_(v_scale)
    return o, lse
