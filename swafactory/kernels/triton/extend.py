"""Paged extend / verify: several queries per request, causal or custom structure, window by position.

It serves prefill with a cached prefix, chain and tree verify, draft extend and DFlash blocks.
All of them are one rule: allowed = structure & (q_pos - kv_pos < W). The structure is either
causal by position (``mask`` None) or a per-request bool block.

One program per (request, KV head, query tile, split). Its tile rows are (query, head) pairs:
row r is query ``r // GROUP`` and head ``r % GROUP`` of the KV head. So the GQA heads and the
tile's queries (the 8 tokens of a verify step) share every K/V row load. Keys no row can see
are loaded under a mask (no bytes, no NaN), and a tile nobody sees is skipped
(with a window, or in a long causal prefill, where skipping pays for the branch). A key that some
rows see and others do not is loaded. Its probability is exactly 0 for the rows that cannot
see it, but 0·NaN would still poison them. So non-finite V values are zeroed before the
product, and only the rows that really see one are set to NaN (stale reads still show).
Splits and the sink are reduced by ``merge.combine_splits``; one split writes the result itself.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from swafactory.kernels.triton.merge import combine_splits, interpreting, plan_splits
from swafactory.kernels.torch_ref import check_contract

__all__ = ["extend_attention", "extend_config"]


def extend_config(head_dim: int, group: int) -> tuple[int, int, int]:
    """(BLOCK_M rows = queries × group heads, BLOCK_N keys, num_warps) per head_dim."""
    gp = 1 << (group - 1).bit_length()
    block_m = max(16, gp, 32 if head_dim >= 512 else 64)
    if head_dim >= 512:
        return block_m, 32, 8
    if head_dim >= 256:
        return block_m, 32, 8
    return block_m, 64, 4


@functools.cache
def _kernel(interpret: bool) -> Any:
    del interpret  # cache key only: triton.jit reads TRITON_INTERPRET when decorating
    import triton
    import triton.language as tl

    @triton.jit
    def extend_stage1(q_ptr, k_ptr, v_ptr, qo_indptr, kv_indptr, kv_indices, q_pos, kv_pos,
                      mask_ptr, mask_indptr, sinks_ptr, o_ptr, lse_ptr, po_ptr, plse_ptr,
                      stride_qt, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh,
                      stride_ot, stride_oh, Hq, QT, scale, softcap, window,
                      GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      D: tl.constexpr, SPLITS: tl.constexpr, HAS_MASK: tl.constexpr,
                      HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                      HAS_SINKS: tl.constexpr, PRECISION: tl.constexpr,
                      SKIP_EMPTY: tl.constexpr):
        BLOCK_Q: tl.constexpr = BLOCK_M // GROUP
        b = tl.program_id(0)
        kh = tl.program_id(1) // QT
        qt = tl.program_id(1) % QT
        sp = tl.program_id(2)
        q0 = tl.load(qo_indptr + b)
        nq = tl.load(qo_indptr + b + 1) - q0
        kv0 = tl.load(kv_indptr + b)
        n = tl.load(kv_indptr + b + 1) - kv0
        r = tl.arange(0, BLOCK_M)
        ql = qt * BLOCK_Q + r // GROUP           # query index inside the request
        heads = kh * GROUP + r % GROUP
        rvalid = (r < BLOCK_Q * GROUP) & (ql < nq)
        chunk = tl.cdiv(tl.cdiv(n, SPLITS), BLOCK_N) * BLOCK_N
        lo = sp * chunk
        hi = tl.minimum(lo + chunk, n)
        hi = tl.where(qt * BLOCK_Q < nq, hi, lo)  # a tile past the request's queries does nothing
        d = tl.arange(0, D)
        qrow = (q0 + ql).to(tl.int64)
        q = tl.load(q_ptr + qrow[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=rvalid[:, None], other=0.0).to(k_ptr.dtype.element_ty)
        qp = tl.load(q_pos + qrow, mask=rvalid, other=0)
        mrow = ql.to(tl.int64) * n
        if HAS_MASK:
            mrow += tl.load(mask_indptr + b).to(tl.int64)
        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        den = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        poisoned = tl.zeros((BLOCK_M,), tl.int32)
        for start in range(lo, hi, BLOCK_N):
            offs = start + tl.arange(0, BLOCK_N)
            inr = offs < hi
            kp = tl.load(kv_pos + kv0 + offs, mask=inr, other=0)
            both = rvalid[:, None] & inr[None, :]
            if HAS_MASK:
                vis = tl.load(mask_ptr + mrow[:, None] + offs[None, :], mask=both, other=0) != 0
                vis = vis & both
            else:
                vis = both & (kp[None, :] <= qp[:, None])
            if HAS_WINDOW:
                vis = vis & (qp[:, None] - kp[None, :] < window)
            kvis = tl.max(vis.to(tl.int32), axis=0) > 0          # some row sees the key
            if SKIP_EMPTY:  # a runtime branch stops Triton pipelining the loads: only where it pays
                go = tl.max(kvis.to(tl.int32), axis=0) > 0
            else:
                go = True
            if go:
                rows = tl.load(kv_indices + kv0 + offs, mask=kvis, other=0).to(tl.int64)
                k = tl.load(k_ptr + rows[:, None] * stride_kr + kh * stride_kh + d[None, :],
                            mask=kvis[:, None], other=0.0)
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
                if HAS_SOFTCAP:  # cap·tanh(s/cap), tanh written with exp (portable to the interpreter)
                    s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
                s = tl.where(vis, s, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, axis=1))
                ref = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp(m - ref)
                p = tl.exp(s - ref[:, None])
                v = tl.load(v_ptr + rows[:, None] * stride_vr + kh * stride_vh + d[None, :],
                            mask=kvis[:, None], other=0.0)
                bad = (v * 0.0) != 0.0                              # NaN or ±inf
                vbad = tl.max(bad.to(tl.int32), axis=1)             # [BLOCK_N]
                poisoned = tl.maximum(poisoned, tl.max(tl.where(vis, vbad[None, :], 0), axis=1))
                v = tl.where(bad, 0.0, v)
                den = den * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
                m = m_new
        if SPLITS == 1:
            if HAS_SINKS:
                sk = tl.load(sinks_ptr + heads, mask=rvalid, other=float("-inf")).to(tl.float32)
                m_new = tl.maximum(m, sk)
                ref = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp(m - ref)
                acc = acc * alpha[:, None]
                den = den * alpha + tl.exp(sk - ref)
                m = m_new
        ref = tl.where(m == float("-inf"), 0.0, m)
        ok = den != 0  # NaN stays NaN: a visible stale read must show
        o = tl.where(ok[:, None], acc / tl.where(ok, den, 1.0)[:, None], 0.0)
        o = tl.where(poisoned[:, None] > 0, float("nan"), o)
        lse = tl.where(ok, ref + tl.log(tl.where(ok, den, 1.0)), float("-inf"))
        if SPLITS == 1:
            tl.store(o_ptr + qrow[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                     o.to(o_ptr.dtype.element_ty), mask=rvalid[:, None])
            tl.store(lse_ptr + qrow * Hq + heads, lse, mask=rvalid)
        else:
            part = (qrow * Hq + heads) * SPLITS + sp
            tl.store(po_ptr + part[:, None] * D + d[None, :], o, mask=rvalid[:, None])
            tl.store(plse_ptr + part, lse, mask=rvalid)

    return extend_stage1


def extend_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                     qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                     q_pos: torch.Tensor, kv_pos: torch.Tensor, *, mask: torch.Tensor | None = None,
                     mask_indptr: torch.Tensor | None = None, window: int | None = None,
                     scale: float, softcap: float | None = None, sinks: torch.Tensor | None = None,
                     max_q_len: int | None = None, num_splits: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged extend/verify under the kernel contract (``kernels/torch_ref.py``); returns (o, lse).

    q: [total_q, Hq, D]; k_buf, v_buf: [rows, Hkv, D] in q's dtype, last dim contiguous;
    qo_indptr, kv_indptr: [B+1] int32; kv_indices: [total_kv] int32/int64; q_pos: [total_q]
    int32; kv_pos: [total_kv] int32; mask: flat bool/uint8 with mask_indptr [B+1] int32 (elements),
    or None for causal; sinks: [Hq] fp32. ``max_q_len`` (host int) sizes the grid; without it the
    longest request is read from qo_indptr, which syncs a GPU (pass it under CUDA-graph capture).
    ``num_splits`` overrides the KV split count (tests); by default it is planned from static sizes.
    """
    nb, group = check_contract(q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, q_pos, kv_pos,
                               mask, mask_indptr, sinks)
    total_q, hq, d = q.shape
    hkv = k_buf.shape[1]
    if d < 16 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two ≥ 16, got {d}")
    if q.stride(2) != 1:
        q = q.contiguous()
    if k_buf.stride(2) != 1 or v_buf.stride(2) != 1:
        raise ValueError("k_buf/v_buf need a contiguous last dim (pool rows are [Hkv, D])")
    o = torch.empty_like(q)
    lse = torch.empty(total_q, hq, dtype=torch.float32, device=q.device)
    if nb == 0 or total_q == 0:
        return o, lse
    if max_q_len is None:
        max_q_len = int((qo_indptr[1:] - qo_indptr[:-1]).max())
    block_m, block_n, warps = extend_config(d, group)
    qt = -(-max_q_len // (block_m // group))
    splits = num_splits or plan_splits(nb * hkv * qt, kv_indices.numel(), nb, block_n, q.device)
    po = plse = lse  # unused when one split writes the output itself
    if splits > 1:
        po = torch.empty(total_q, hq, splits, d, dtype=torch.float32, device=q.device)
        plse = torch.empty(total_q, hq, splits, dtype=torch.float32, device=q.device)
    if mask is not None:
        mask = mask.contiguous()
        mask = mask.view(torch.uint8) if mask.dtype == torch.bool else mask  # same bytes
    sk = sinks.float().contiguous() if sinks is not None else lse
    kernel = _kernel(interpreting())
    kernel[(nb, hkv * qt, splits)](
        q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, q_pos, kv_pos,
        mask if mask is not None else lse, mask_indptr if mask_indptr is not None else qo_indptr,
        sk, o, lse, po, plse,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0),
        v_buf.stride(1), o.stride(0), o.stride(1), hq, qt, float(scale),
        float(softcap or 1.0), int(window or 1),
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, D=d, SPLITS=splits,
        HAS_MASK=mask is not None, HAS_WINDOW=window is not None,
        HAS_SOFTCAP=softcap is not None, HAS_SINKS=sinks is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else None,
        # skip invisible tiles only where many exist: an untrimmed window or a long causal prefill
        SKIP_EMPTY=(window is not None and kv_indices.numel() > nb * (window + max_q_len + block_n))
        or (mask is None and max_q_len > block_n),
        num_warps=warps)
    if splits > 1:
        combine_splits(po, plse, sinks.float().contiguous() if sinks is not None else None, o, lse)
    return o, lse
