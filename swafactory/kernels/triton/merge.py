"""LSE merges of partial attention states, in Triton.

Two uses, one rule (o = Σ e^{lse_i}·o_i / (Σ e^{lse_i} + e^{sink}), lse = log of that denominator):

* ``combine_splits`` — stage 2 of split-KV: S partial states of one query/head, written by the
  decode or extend kernel, reduced into the final output (sinks join the denominator here).
* ``merge_attention_states`` — cascade: a prefix pass and an expand pass over disjoint keys,
  each without sinks, merged once with the sinks.

A partial with lse = -inf is empty (its o is 0); a NaN lse or o propagates (stale reads show).
triton is imported on first use; kernels are built once per interpreter setting because
``triton.jit`` reads ``TRITON_INTERPRET`` when it decorates.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from swafactory.kernels.cuda import kernel_env

__all__ = ["merge_attention_states", "combine_splits", "plan_splits", "interpreting", "sm_count",
           "compute_dtype"]


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``): the running
    adapter's snapshot (`kernels.cuda.kernel_env`, read once when its backend was built), else
    the environment now (a kernel called directly)."""
    return kernel_env().interpret


def compute_dtype(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> Any:
    """The Triton dtype a kernel's tiles are multiplied in: the KV dtype (q is cast to it), or
    q's for a one-byte (fp8) KV, whose tiles are dequantized to it in registers."""
    import triton.language as tl

    dt = q_dtype if kv_dtype.is_floating_point and kv_dtype.itemsize == 1 else kv_dtype
    return {torch.float32: tl.float32, torch.float16: tl.float16,
            torch.bfloat16: tl.bfloat16}[dt]


@functools.cache
def _sm_count(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
    return 4  # interpreter: a few splits keep the stage-2 path exercised without slowing tests


def sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device`` (4 off a GPU), cached."""
    return _sm_count(str(device))


def plan_splits(programs: int, total_kv: int, batch: int, block_n: int, device: torch.device) -> int:
    """How many KV splits per (request, head group) fill the device, from static sizes only.

    programs: stage-1 programs without splitting; total_kv / batch: the average key count. No
    device sync, so the choice is stable under CUDA-graph capture for a fixed shape.
    """
    target = 4 * _sm_count(str(device))
    # rounded down: programs × splits past one wave of ``target`` starts a second wave of equal
    # programs (H200, GPT-OSS full layer at bs 8, 64 programs: 9 splits 0.107 ms, 8 0.055)
    want = max(1, target // max(programs, 1))
    avg = total_kv // max(batch, 1)
    most = max(1, -(-avg // (2 * block_n)))  # at least two key tiles per split
    return int(max(1, min(want, most, 64)))


@functools.cache
def _kernels(interpret: bool) -> Any:
    del interpret  # cache key only
    import triton
    import triton.language as tl

    @triton.jit
    def combine(po_ptr, plse_ptr, sinks_ptr, o_ptr, lse_ptr, stride_ot, stride_oh, H,
                S, D: tl.constexpr, HAS_SINKS: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1)
        d = tl.arange(0, D)
        base = (t.to(tl.int64) * H + h) * S
        m = tl.full((), float("-inf"), tl.float32)
        den = tl.zeros((), tl.float32)
        acc = tl.zeros((D,), tl.float32)
        for s in range(S):
            ls = tl.load(plse_ptr + base + s)
            os_ = tl.load(po_ptr + (base + s) * D + d)
            m_new = tl.maximum(m, ls)
            ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            w_old = tl.exp(m - ref)
            w = tl.exp(ls - ref)
            acc = acc * w_old + os_ * w
            den = den * w_old + w
            m = m_new
        if HAS_SINKS:
            sk = tl.load(sinks_ptr + h).to(tl.float32)
            m_new = tl.maximum(m, sk)
            ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            w_old = tl.exp(m - ref)
            acc = acc * w_old
            den = den * w_old + tl.exp(sk - ref)
            m = m_new
        ref = tl.where(m == float("-inf"), 0.0, m)
        live = den != 0  # NaN stays NaN: a visible stale read must show
        o = tl.where(live, acc / tl.where(live, den, 1.0), 0.0)
        tl.store(o_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + d,
                 o.to(o_ptr.dtype.element_ty))
        tl.store(lse_ptr + t.to(tl.int64) * H + h,
                 tl.where(live, ref + tl.log(tl.where(live, den, 1.0)), float("-inf")))

    @triton.jit
    def merge_two(o1_ptr, l1_ptr, o2_ptr, l2_ptr, sinks_ptr, o_ptr, lse_ptr,
                  s1t, s1h, s2t, s2h, sot, soh, H, D: tl.constexpr, HAS_SINKS: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        d = tl.arange(0, D)
        l1 = tl.load(l1_ptr + t * H + h)
        l2 = tl.load(l2_ptr + t * H + h)
        m = tl.maximum(l1, l2)
        if HAS_SINKS:
            sk = tl.load(sinks_ptr + h).to(tl.float32)
            m = tl.maximum(m, sk)
        ref = tl.where(m == float("-inf"), 0.0, m)
        w1 = tl.exp(l1 - ref)
        w2 = tl.exp(l2 - ref)
        den = w1 + w2
        if HAS_SINKS:
            den += tl.exp(sk - ref)
        o1 = tl.load(o1_ptr + t * s1t + h * s1h + d).to(tl.float32)
        o2 = tl.load(o2_ptr + t * s2t + h * s2h + d).to(tl.float32)
        live = den != 0  # NaN stays NaN: a visible stale read must show
        o = tl.where(live, (w1 * o1 + w2 * o2) / tl.where(live, den, 1.0), 0.0)
        tl.store(o_ptr + t * sot + h * soh + d, o.to(o_ptr.dtype.element_ty))
        tl.store(lse_ptr + t * H + h, tl.where(live, ref + tl.log(tl.where(live, den, 1.0)),
                                               float("-inf")))

    return combine, merge_two


def combine_splits(po: torch.Tensor, plse: torch.Tensor, sinks: torch.Tensor | None,
                   o: torch.Tensor, lse: torch.Tensor) -> None:
    """Reduce split partials into ``o``/``lse`` in place.

    po: [total_q, H, S, D] fp32 (each split normalised, 0 where empty); plse: [total_q, H, S]
    fp32 (-inf where empty); sinks: [H] fp32 or None; o: [total_q, H, D] (last dim contiguous),
    lse: [total_q, H] fp32 contiguous.
    """
    total_q, h, s, d = po.shape
    if total_q == 0:
        return
    combine, _ = _kernels(interpreting())
    dummy = plse if sinks is None else sinks
    combine[(total_q, h)](po, plse, dummy, o, lse, o.stride(0), o.stride(1), h,
                          s, D=d, HAS_SINKS=sinks is not None)


def merge_attention_states(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor,
                           lse2: torch.Tensor, sinks: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial states over disjoint keys (cascade prefix + expand), sinks applied once.

    o1, o2: [N, H, D] fp32/fp16/bf16 (power-of-two D, last dim contiguous); lse1, lse2: [N, H]
    fp32, natural log, -inf = saw nothing; sinks: [H] fp32 or None. Returns (o [N, H, D] in o1's
    dtype, lse [N, H] fp32).
    """
    n, h, d = o1.shape
    if o2.shape != o1.shape or lse1.shape != (n, h) or lse2.shape != (n, h):
        raise ValueError(f"states disagree: {tuple(o1.shape)}/{tuple(lse1.shape)} vs "
                         f"{tuple(o2.shape)}/{tuple(lse2.shape)}")
    if d & (d - 1):
        raise ValueError(f"head_dim {d} is not a power of two")
    o1 = o1 if o1.stride(2) == 1 else o1.contiguous()
    o2 = o2 if o2.stride(2) == 1 else o2.contiguous()
    lse1, lse2 = lse1.float().contiguous(), lse2.float().contiguous()
    o = torch.empty_like(o1)
    lse = torch.empty(n, h, dtype=torch.float32, device=o1.device)
    if n:
        _, merge_two = _kernels(interpreting())
        sk = sinks.float().contiguous() if sinks is not None else lse1
        merge_two[(n, h)](o1, lse1, o2, lse2, sk, o, lse, o1.stride(0), o1.stride(1),
                          o2.stride(0), o2.stride(1), o.stride(0), o.stride(1), h,
                          D=d, HAS_SINKS=sinks is not None)
    return o, lse

