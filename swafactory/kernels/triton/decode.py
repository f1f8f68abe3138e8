"""Split-KV (flash-decoding) paged decode: one query per request, GQA heads together.

Stage 1 runs one program per (request, KV head, split). It loads the query rows of all
``Hq // Hkv`` heads that share the KV head as one [BLOCK_H, D] tile, so each K/V row is read
once per KV head, not once per query head. It walks its share of the request's keys in
``BLOCK_N`` tiles and keeps an online softmax. Keys a query cannot see (outside the window,
in the future, or past the list) are loaded under a mask. So they cost no bytes, and a NaN
in the dummy slot or in an evicted row never enters the sum. A tile with no visible key is
skipped (only with a window: the branch costs load pipelining where every tile is visible).
Stage 2 (``merge.combine_splits``) reduces the splits and adds the sink. With one split, stage 1
writes the final output itself. The split count is a runtime argument (only "split or not" is
compiled in): it follows the batch (`merge.plan_splits`), and a compiled
count would JIT a new kernel, about a second, whenever a serving step met a new count.

With ``new_kv`` the kernel writes the step's K/V and attends to its key from registers; at
8 warps (head_dim ≥ 256) that launch is capped at 128 registers, as the plain kernel compiles,
so two CTAs still share a multiprocessor (`fused_registers`).

Contract: see ``kernels/torch_ref.py``; here ``mask`` must be None and ``qo_indptr`` = arange(B+1).
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from swafactory.kernels.cuda.decode import decode_d64, decode_d64_serves
from swafactory.kernels.cuda.decode_fp8 import decode_fp8, decode_fp8_serves
from swafactory.kernels.triton.host import (check_rows, finish, flags, outputs, partials,
                                            scalars, sinks_arg, strides)
from swafactory.kernels.triton.merge import interpreting, plan_splits
from swafactory.kernels.torch_ref import check_contract

__all__ = ["decode_attention", "decode_config", "launches"]

launches = 0
"""Decode passes launched in this process, through the Triton kernel or the CUDA cluster kernel
(tests check that a path reaches the decode kernel)."""


def decode_config(head_dim: int, group: int) -> tuple[int, int, int, int]:
    """(BLOCK_H, BLOCK_N, num_warps, num_stages) for a head_dim and GQA group; tl.dot needs
    tiles ≥ 16."""
    block_h = max(16, 1 << (group - 1).bit_length())
    if head_dim >= 512:
        return block_h, 32, 8, 3
    if head_dim >= 256:
        return block_h, 64, 8, 3
    if head_dim >= 128:
        return block_h, 64, 4, 3
    # 128-key tiles, two stages: GPT-OSS's full layer (D 64, 8 KV heads, 8192 keys) with the
    # step's write and the merge, as a graph runs it on the H200: bs 64 276 µs = 91% of copy
    # bandwidth against 324 µs with 64-key tiles, bs 8 52 against 56 µs (bench/results/
    # probe-decode-tiles-091048e.json)
    return block_h, 128, 4, 2


def fused_registers(fused: bool, warps: int) -> dict:
    """Launch options that keep the fused write's kernel at two CTAs a multiprocessor.

    The plain kernel at head_dim 256/512 (8 warps) takes 128 registers, so two CTAs fit; the
    step's write and its key's tail took it to 153-164, one CTA a multiprocessor, and the layer
    from 92% to 61% of copy bandwidth (H200, Gemma 4 at bs 64: 0.415 against 0.281 ms SWA, 1.60
    against 1.12 full; capped at 128 registers: 0.294 and, with the MMA-layout tail at head_dim
    512, 1.156; bench/results/probe-fused-decode-49b0cc2.md). Interpreted runs take no options.
    """
    if not fused or warps < 8 or interpreting():
        return {}
    return {"maxnreg": 65536 // (2 * 32 * warps)}


@functools.cache
def _kernel(interpret: bool) -> Any:
    del interpret  # cache key only: triton.jit reads TRITON_INTERPRET when decorating
    global online  # the kernel calls its shared steps through the module (see online.py)
    import triton
    import triton.language as tl

    from swafactory.kernels.triton import online

    @triton.jit
    def decode_stage1(q_ptr, k_ptr, v_ptr, qo_indptr, kv_indptr, kv_indices, q_pos, kv_pos,
                      sinks_ptr, o_ptr, lse_ptr, po_ptr, plse_ptr, kn_ptr, vn_ptr, wloc_ptr,
                      stride_qt, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh,
                      stride_ot, stride_oh, stride_nt, stride_nh, Hq, n_splits, scale, softcap,
                      window, dummy_rows,
                      GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                      D: tl.constexpr, SPLIT: tl.constexpr, HAS_WINDOW: tl.constexpr,
                      HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
                      PRECISION: tl.constexpr, SKIP_EMPTY: tl.constexpr, CDT: tl.constexpr,
                      FUSED: tl.constexpr, DOT_TAIL: tl.constexpr):
        b = tl.program_id(0)
        kh = tl.program_id(1)
        sp = tl.program_id(2)
        qi = tl.load(qo_indptr + b)
        live = tl.load(qo_indptr + b + 1) > qi
        kv0 = tl.load(kv_indptr + b)
        n = tl.load(kv_indptr + b + 1) - kv0
        # equal shares, rounded to whole tiles; the split reads keys [lo, hi) of the request
        chunk = tl.cdiv(tl.cdiv(n, n_splits), BLOCK_N) * BLOCK_N
        lo = sp * chunk
        hi = tl.minimum(lo + chunk, n)
        hi = tl.where(live, hi, lo)
        r = tl.arange(0, BLOCK_H)
        heads = kh * GROUP + r
        hmask = r < tl.where(live, GROUP, 0)  # (not `& live`: the interpreter rejects scalar-bool masks)
        d = tl.arange(0, D)
        qrow = qi.to(tl.int64)
        q = tl.load(q_ptr + qrow * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=hmask[:, None], other=0.0).to(CDT)
        qp = tl.load(q_pos + qi, mask=live, other=0)
        m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        den = tl.zeros((BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_H, D), tl.float32)
        for start in range(lo, hi, BLOCK_N):
            offs = start + tl.arange(0, BLOCK_N)
            inr = offs < hi
            kp = tl.load(kv_pos + kv0 + offs, mask=inr, other=0)
            if FUSED:  # the new token's key comes from registers, after the loop
                vis = inr & (kp < qp)
            else:
                vis = inr & (kp <= qp)
            if HAS_WINDOW:
                vis = vis & (qp - kp < window)
            if SKIP_EMPTY:  # a runtime branch stops Triton pipelining the loads: only with a window
                go = tl.max(vis.to(tl.int32), axis=0) > 0
            else:
                go = True
            if go:
                rows = tl.load(kv_indices + kv0 + offs, mask=vis, other=0).to(tl.int64)
                k = tl.load(k_ptr + rows[:, None] * stride_kr + kh * stride_kh + d[None, :],
                            mask=vis[:, None], other=0.0).to(CDT)  # fp8: dequantized in registers
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
                if HAS_SOFTCAP:
                    s = online.tanh_cap(s, softcap)
                s = tl.where(vis[None, :], s, float("-inf"))
                m_new, ref, alpha = online.online_max(m, tl.max(s, axis=1))
                p = tl.exp(s - ref[:, None])
                v = tl.load(v_ptr + rows[:, None] * stride_vr + kh * stride_vh + d[None, :],
                            mask=vis[:, None], other=0.0).to(CDT)
                den, acc = online.accumulate(den, acc, alpha, p, v, PRECISION)
                m = m_new
        if FUSED:  # this step's K/V of KV head kh: written once, attended from registers
            nrow = qrow * stride_nt + kh * stride_nh
            if sp == 0:  # no program reads this row from the pool (keys before q's position)
                kn = tl.load(kn_ptr + nrow + d)
                vn = tl.load(vn_ptr + nrow + d)
                w = tl.load(wloc_ptr + qi).to(tl.int64)
                # a padding request's write to the dummy page is dropped (a tensor mask: the
                # interpreter rejects scalar ones)
                keep = (d * 0 + w) >= dummy_rows
                tl.store(k_ptr + w * stride_kr + kh * stride_kh + d, kn, mask=keep)
                tl.store(v_ptr + w * stride_vr + kh * stride_vh + d, vn, mask=keep)
            if sp == n_splits - 1:
                if DOT_TAIL:  # one more key tile in the loop's MMA layouts, only row 0 visible
                    first = tl.arange(0, BLOCK_N) == 0
                    same = (tl.arange(0, BLOCK_N) * 0)[:, None] + d[None, :]  # row 0, N times
                    kt = tl.load(kn_ptr + nrow + same).to(CDT)
                    s1 = tl.dot(q, tl.trans(kt), input_precision=PRECISION) * scale
                    if HAS_SOFTCAP:
                        s1 = online.tanh_cap(s1, softcap)
                    s1 = tl.where(first[None, :] & hmask[:, None], s1, float("-inf"))
                    m_new, ref, alpha = online.online_max(m, tl.max(s1, axis=1))
                    p1 = tl.exp(s1 - ref[:, None])
                    vt = tl.load(vn_ptr + nrow + same).to(CDT)
                    den, acc = online.accumulate(den, acc, alpha, p1, vt, PRECISION)
                else:  # q·kn as a broadcast sum
                    kn = tl.load(kn_ptr + nrow + d)
                    vn = tl.load(vn_ptr + nrow + d)
                    s1 = tl.sum(q.to(tl.float32) * kn.to(tl.float32)[None, :], axis=1) * scale
                    if HAS_SOFTCAP:
                        s1 = online.tanh_cap(s1, softcap)
                    s1 = tl.where(hmask, s1, float("-inf"))
                    m_new, ref, alpha = online.online_max(m, s1)
                    p1 = tl.exp(s1 - ref)
                    den = den * alpha + p1
                    acc = acc * alpha[:, None] + p1[:, None] * vn.to(tl.float32)[None, :]
                m = m_new
        if not SPLIT and HAS_SINKS:
            m, den, acc = online.add_sink(sinks_ptr, heads, hmask, m, den, acc)
        o, lse = online.normalize(m, den, acc)
        if not SPLIT:
            tl.store(o_ptr + qrow * stride_ot + heads[:, None] * stride_oh + d[None, :],
                     o.to(o_ptr.dtype.element_ty), mask=hmask[:, None])
            tl.store(lse_ptr + qrow * Hq + heads, lse, mask=hmask)
        else:
            part = (qrow * Hq + heads) * n_splits + sp
            tl.store(po_ptr + part[:, None] * D + d[None, :], o, mask=hmask[:, None])
            tl.store(plse_ptr + part, lse, mask=hmask)

    return decode_stage1


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                     qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                     q_pos: torch.Tensor, kv_pos: torch.Tensor, *, mask: torch.Tensor | None = None,
                     mask_indptr: torch.Tensor | None = None, window: int | None = None,
                     scale: float, softcap: float | None = None, sinks: torch.Tensor | None = None,
                     num_splits: int | None = None, k_scale: float = 1.0,
                     v_scale: float = 1.0, new_kv: tuple | None = None,
                     dummy_rows: int = 1, skip_empty: bool | None = None,
                     cuda: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged decode under the kernel contract (``kernels/torch_ref.py``); returns (o, lse).

    q: [B, Hq, D] (one query per request: qo_indptr = arange(B+1), int32); k_buf, v_buf:
    [rows, Hkv, D] in q's dtype, last dim contiguous; kv_indptr: [B+1] int32; kv_indices:
    [total_kv] int32/int64; q_pos: [B] int32; kv_pos: [total_kv] int32; sinks: [Hq] fp32.
    fp8 buffers (with ``k_scale``/``v_scale``) are read in q's dtype: k_scale joins the softmax
    scale and v_scale the output.
    ``num_splits`` overrides the split count (tests); by default it is planned from static sizes.
    new_kv: (k [B, Hkv, D], v [B, Hkv, D] in the pool's dtype, slots [B] int64): this step's
    rows, written by the kernel (split 0 of each request and KV head) and attended from
    registers, so the pool reads stop before q's position (decode lists hold the new key once,
    at it). Writes to the dummy page (rows below ``dummy_rows``: padding requests) are dropped,
    which keeps a check-mode pool's poison.
    ``skip_empty``: test each key tile for a visible key (windowed passes only; the branch stops
    Triton pipelining the loads). None: where the lists hold more than the window, judged from
    ``kv_indices``' size; a graph bucket's static lists are sized for the pool, so its caller
    passes False (the planner trims windowed lists).
    ``cuda``: head_dim-64 bf16 passes in our CUDA kernel (``kernels/cuda/decode_d64.cu``: the
    splits merged in a thread-block cluster, one launch), and fp8_e4m3 pools at head_dim 256/512
    (with the step's K/V stored first) in ``kernels/cuda/decode_fp8.cu``, where they serve
    (None: wherever they serve; False: never; True: required, else ValueError).
    ``num_splits`` caps their splits.
    """
    if mask is not None or mask_indptr is not None:
        raise ValueError("decode_attention is causal by position; use extend_attention for masks")
    nb, group = check_contract(q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, q_pos, kv_pos,
                               mask, mask_indptr, sinks)
    total_q, hq, d = q.shape
    hkv = k_buf.shape[1]
    if total_q != nb:
        raise ValueError(f"decode needs one query per request: {total_q} queries, {nb} requests")
    q = check_rows(q, k_buf, v_buf)
    kn = vn = wloc = q
    if new_kv is not None:
        kn, vn, wloc = new_kv
        if kn.shape != (nb, hkv, d) or vn.shape != kn.shape or kn.dtype != k_buf.dtype or \
                vn.dtype != v_buf.dtype or k_buf.dtype.itemsize == 1:
            raise ValueError(f"new_kv must be [{nb}, {hkv}, {d}] in the pool's dtype "
                             f"{k_buf.dtype} (not fp8: the store quantizes), got "
                             f"{list(kn.shape)} {kn.dtype} / {list(vn.shape)} {vn.dtype}")
        kn, vn = kn.contiguous(), vn.contiguous()  # one stride pair serves both
    fp8_scaled = k_buf.dtype.itemsize == 1 or k_scale != 1.0 or v_scale != 1.0
    global launches
    if cuda is not False and decode_d64_serves(q, k_buf, v_buf, group, softcap, fp8_scaled):
        launches += nb > 0
        return decode_d64(q, k_buf, v_buf, kv_indptr, kv_indices, q_pos, kv_pos, window=window,
                          scale=scale, sinks=sinks, new_kv=new_kv, dummy_rows=dummy_rows,
                          num_splits=num_splits)
    if cuda is not False and new_kv is None and \
            decode_fp8_serves(q, k_buf, v_buf, group, softcap):
        launches += nb > 0
        return decode_fp8(q, k_buf, v_buf, kv_indptr, kv_indices, q_pos, kv_pos, window=window,
                          scale=scale, k_scale=k_scale, v_scale=v_scale, sinks=sinks,
                          num_splits=num_splits)
    if cuda:
        raise ValueError("cuda=True: the CUDA decode kernels serve bf16 q over a bf16 pool at "
                         "head_dim 64 or an fp8_e4m3 pool at head_dim 256/512 (the step's K/V "
                         "stored first), GQA group ≤ 8, no softcap, on Hopper with nvcc present")
    block_h, block_n, warps, stages = decode_config(d, group)
    splits = num_splits or plan_splits(nb * hkv, kv_indices.numel(), nb, block_n, q.device)
    o, lse = outputs(q)
    if nb == 0:
        return o, lse
    po, plse = partials(q, splits, lse)  # lse (unused) when one split writes the output itself
    launches += 1
    kernel = _kernel(interpreting())
    kernel[(nb, hkv, splits)](
        q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, q_pos, kv_pos, sinks_arg(sinks, lse),
        o, lse, po, plse, kn, vn, wloc, *strides(q, k_buf, v_buf, o), kn.stride(0), kn.stride(1),
        hq, splits, *scalars(scale, k_scale, softcap, window), int(dummy_rows),
        GROUP=group, BLOCK_H=block_h, BLOCK_N=block_n, D=d, SPLIT=splits > 1,
        # skip invisible tiles only where the list is longer than the window (not trimmed)
        SKIP_EMPTY=window is not None and (kv_indices.numel() > nb * (window + block_n)
                                           if skip_empty is None else skip_empty),
        FUSED=new_kv is not None, DOT_TAIL=d >= 512, num_warps=warps, num_stages=stages,
        **flags(q, k_buf, window, softcap, sinks), **fused_registers(new_kv is not None, warps))
    return finish(o, lse, po, plse, splits, sinks, v_scale)

