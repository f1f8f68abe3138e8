"""The attention-sink epilogue in one kernel: ``o · σ(lse − sink)`` per (row, head).

A kernel library that returns (o, lse) without reading sinks (FlashInfer's FA2/FA3 paths on
SM90) is made sink-exact after the fact (`torch_ref.apply_sinks` says why it is exact). In torch
that epilogue is seven small kernels per layer; at decode batch sizes, under a CUDA graph, those
launches cost more than the attention of an SWA layer. This is one launch, in place.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from swafactory.kernels.triton_launch import launch

__all__ = ["sink_epilogue", "sink_output"]

_ROWS = 16  # (row, head) pairs per program


@functools.cache
def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    # integers unspecialized: `triton_launch.launch` keys compiled handles on types, not values
    @triton.jit(do_not_specialize=["n_rows", "H"])
    def sink_scale(o_ptr, lse_ptr, sink_ptr, n_rows, H, lse_scale,
                   D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        live = r < n_rows
        lse = tl.load(lse_ptr + r, mask=live, other=0.0) * lse_scale
        sink = tl.load(sink_ptr + r % H, mask=live, other=0.0)
        w = 1.0 / (1.0 + tl.exp(sink - lse))  # σ(lse − sink); lse = −inf (no key) gives 0
        d = tl.arange(0, BLOCK_D)
        m = live[:, None] & (d[None, :] < D)
        ptr = o_ptr + r.to(tl.int64)[:, None] * D + d[None, :]
        o = tl.load(ptr, mask=m, other=0.0).to(tl.float32)
        tl.store(ptr, (o * w[:, None]).to(o_ptr.dtype.element_ty), mask=m)

    return sink_scale


def sink_epilogue(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, *,
                  lse_scale: float = 1.0, compiled: bool = False) -> torch.Tensor:
    """Scale ``o`` in place by ``σ(lse · lse_scale − sink)`` and return it.

    o: [n, H, D] contiguous, bf16/fp16/fp32 on CUDA; lse: [n, H] fp32 contiguous (its log base is
    undone by ``lse_scale``: ln 2 for FlashInfer's base-2 LSE); sinks: [H] fp32.
    compiled: launch through the compiled handle after the first launch (`triton_launch`), as
    the adapters' per-layer path does; by default Triton's ordinary ``kernel[grid](…)``.
    """
    n, h, d = o.shape
    if not o.is_contiguous() or not lse.is_contiguous() or lse.shape != (n, h):
        raise ValueError(f"sink_epilogue needs contiguous o [n, H, D] and lse [n, H]; got "
                         f"{list(o.shape)} / {list(lse.shape)}")
    rows = n * h
    if rows:
        grid = (-(-rows // _ROWS),)
        args = (o, lse, sinks.float().contiguous(), rows, h, lse_scale)
        cx = (d, 1 << (d - 1).bit_length(), _ROWS)  # D, BLOCK_D, ROWS
        if compiled:
            launch(_kernel(), grid, args, cx, o.device.index or 0)
        else:
            _kernel()[grid](*args, *cx)
    return o


def sink_output(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, *,
                lse_scale: float = 1.0) -> torch.Tensor:
    """The sink-exact output alone (no LSE wanted): ``sink_epilogue`` (one launch, in place,
    through its compiled handle) on CUDA where Triton imports, else `torch_ref.apply_sinks`
    (seven small ops).

    o: [n, H, D]; lse: [n, H] fp32, any strides (made contiguous for the kernel), its log base
    undone by ``lse_scale``; sinks: [H].
    """
    if o.is_cuda and o.is_contiguous() and _has_triton():
        return sink_epilogue(o, lse.contiguous(), sinks, lse_scale=lse_scale, compiled=True)
    from swafactory.kernels.torch_ref import apply_sinks

    return apply_sinks(o, lse * lse_scale if lse_scale != 1.0 else lse, sinks)[0]
