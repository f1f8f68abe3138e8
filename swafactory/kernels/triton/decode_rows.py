"""Paged decode over whole pool rows: one program per (request, split) reads every KV head.

`decode.py` runs one program per (request, KV head, split), so each program gathers its head's
slice of a pool row: 128 bytes at head_dim 64. Scattered 128-byte reads leave the H200 near 70%
of its copy bandwidth (GPT-OSS full layer, bs 64: 2.97 TB/s, `bench/results/probe-fp8-tile-5705fd3.md`),
while whole 1 KB rows reached 97% at head_dim 512. Here a program loads a key tile as
[Hkv, BLOCK_N, D] (each key's row, every head, contiguous) and multiplies per KV head with a
batched ``tl.dot``: the query tile is [Hkv, group (padded to 16), D].

Two more launches per layer go away, which is what a small batch under a CUDA graph pays for:

* **the split merge**: each split writes its partial (o, lse); the last split of a request to
  finish (an atomic counter per request) merges them, adds the sink and writes the output, then
  resets its counter to 0, so a graph replays on zeroed counters;
* **the K/V write** (``new_kv``): the program of split 0 stores this step's K/V rows, and the last
  split adds the new token's key from registers. The pool reads take keys strictly before the
  query's position, so no program reads a row another one is writing. This needs what decode
  lists hold: the new token's key once, at the query's position.

Serves where the tiles fit registers: Hkv · D ≤ 1024 and a group ≤ 16 (GPT-OSS: 8 × 64, group 8;
Mistral: 8 × 128, group 4), K/V in q's dtype (bf16/fp16/fp32). Contract: ``kernels/torch_ref.py``
with ``mask`` None and one query per request.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from swafactory.kernels.triton.merge import interpreting, sm_count

__all__ = ["decode_rows", "rows_serve", "rows_config", "rows_splits", "launches"]

launches = 0
"""Launches of `decode_rows` in this process (tests check that a path reaches it)."""


def rows_serve(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor) -> bool:
    """Whether `decode_rows` serves this layer: whole rows of Hkv · D ≤ 1024, a GQA group of at
    most 16, power-of-two Hkv and D ≥ 16, K/V in q's dtype with contiguous rows."""
    hq, d = q.shape[1], q.shape[2]
    hkv = k_buf.shape[1]
    group = hq // hkv if hkv else 0
    pow2 = lambda x: x >= 1 and not x & (x - 1)  # noqa: E731
    return (pow2(hkv) and pow2(d) and d >= 16 and hkv * d <= 1024 and 1 <= group <= 16
            and hq == group * hkv and k_buf.dtype == q.dtype == v_buf.dtype
            and k_buf.stride(2) == 1 and v_buf.stride(2) == 1
            and k_buf.stride(1) == d and v_buf.stride(1) == d)


def rows_config(hkv: int, d: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages): key tiles of about 32 KB of K and V together."""
    block_n = max(16, min(64, 16384 // (hkv * d)))
    return block_n, 8 if hkv >= 8 else 4, 3


def rows_splits(batch: int, keys_per_request: int, block_n: int, device: torch.device) -> int:
    """Splits per request from static sizes (no device read): about two programs per
    multiprocessor, each with at least two key tiles."""
    want = max(1, -(-2 * sm_count(device) // max(batch, 1)))
    most = max(1, -(-keys_per_request // (2 * block_n)))
    return int(min(want, most, 64))


@functools.cache
def _kernel(interpret: bool) -> Any:
    del interpret  # cache key only: triton.jit reads TRITON_INTERPRET when decorating
    import triton
    import triton.language as tl

    @triton.jit
    def decode_rows_kernel(q_ptr, k_ptr, v_ptr, kv_indptr, kv_indices, q_pos, kv_pos,
                           sinks_ptr, kn_ptr, vn_ptr, wloc_ptr, o_ptr, lse_ptr, po_ptr, pl_ptr,
                           cnt_ptr, stride_qt, stride_qh, stride_kr, stride_vr, stride_nt,
                           stride_ot, stride_oh, n_splits, scale, softcap, window, dummy_rows,
                           HKV: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr,
                           D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                           HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                           HAS_SINKS: tl.constexpr, FUSED: tl.constexpr,
                           PRECISION: tl.constexpr):
        b = tl.program_id(0)
        sp = tl.program_id(1)
        hq = HKV * GROUP
        kv0 = tl.load(kv_indptr + b)
        n = tl.load(kv_indptr + b + 1) - kv0
        chunk = tl.cdiv(tl.cdiv(n, n_splits), BLOCK_N) * BLOCK_N
        lo = sp * chunk
        hi = tl.minimum(lo + chunk, n)
        h3 = tl.arange(0, HKV)[:, None, None]
        g3 = tl.arange(0, GP)[None, :, None]
        d3 = tl.arange(0, D)[None, None, :]
        heads = h3 * GROUP + g3  # [HKV, GP, 1]
        hmask = g3 < GROUP
        bq = b.to(tl.int64)
        q = tl.load(q_ptr + bq * stride_qt + heads * stride_qh + d3, mask=hmask, other=0.0)
        qp = tl.load(q_pos + b)
        n3 = tl.arange(0, BLOCK_N)[None, :, None]
        m = tl.full((HKV, GP), float("-inf"), tl.float32)
        den = tl.zeros((HKV, GP), tl.float32)
        acc = tl.zeros((HKV, GP, D), tl.float32)
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
            rows = tl.load(kv_indices + kv0 + offs, mask=vis, other=0).to(tl.int64)
            r3 = rows[None, :, None]
            v3 = vis[None, :, None]
            k = tl.load(k_ptr + r3 * stride_kr + h3 * D + d3, mask=v3, other=0.0)
            s = tl.dot(q, tl.permute(k, (0, 2, 1)), input_precision=PRECISION) * scale
            if HAS_SOFTCAP:  # cap·tanh(s/cap), tanh written with exp
                s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
            s = tl.where(vis[None, None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=2))
            ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - ref)
            p = tl.exp(s - ref[:, :, None])
            v = tl.load(v_ptr + r3 * stride_vr + h3 * D + d3, mask=v3, other=0.0)
            den = den * alpha + tl.sum(p, axis=2)
            acc = acc * alpha[:, :, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        if FUSED:
            kn = tl.load(kn_ptr + bq * stride_nt + h3 * D + d3)  # [HKV, 1, D]
            vn = tl.load(vn_ptr + bq * stride_nt + h3 * D + d3)
            if sp == 0:  # this step's row, written once; no program reads it from the pool
                w = tl.load(wloc_ptr + b).to(tl.int64)
                # a padding request's write to the dummy page is dropped (a tensor mask: the
                # interpreter rejects scalar ones)
                live = (h3 * 0 + w) >= dummy_rows
                tl.store(k_ptr + w * stride_kr + h3 * D + d3, kn, mask=live)
                tl.store(v_ptr + w * stride_vr + h3 * D + d3, vn, mask=live)
            if sp == n_splits - 1:
                s = tl.sum(q.to(tl.float32) * kn.to(tl.float32), axis=2) * scale
                if HAS_SOFTCAP:
                    s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
                m_new = tl.maximum(m, s)  # one more key: the online-softmax step
                ref = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp(m - ref)
                p1 = tl.exp(s - ref)
                den = den * alpha + p1
                acc = acc * alpha[:, :, None] + p1[:, :, None] * vn.to(tl.float32)
                m = m_new
        if SPLIT:  # this split's partial, then the last split of the request merges
            ref = tl.where(m == float("-inf"), 0.0, m)
            ok = den != 0  # NaN stays NaN: a visible stale read must show
            part = (bq * n_splits + sp) * hq + heads  # [HKV, GP, 1]
            tl.store(po_ptr + part * D + d3,
                     tl.where(ok[:, :, None], acc / tl.where(ok, den, 1.0)[:, :, None], 0.0),
                     mask=hmask)
            lpart = (bq * n_splits + sp) * hq + tl.arange(0, HKV)[:, None] * GROUP + \
                tl.arange(0, GP)[None, :]
            tl.store(pl_ptr + lpart, tl.where(ok, ref + tl.log(tl.where(ok, den, 1.0)),
                                              float("-inf")), mask=tl.arange(0, GP)[None, :] < GROUP)
            tl.debug_barrier()  # every thread's partial is stored before the release below
            done = tl.atomic_add(cnt_ptr + b, 1, sem="acq_rel")
            if done == n_splits - 1:
                tl.debug_barrier()
                m = tl.full((HKV, GP), float("-inf"), tl.float32)
                den = tl.zeros((HKV, GP), tl.float32)
                acc = tl.zeros((HKV, GP, D), tl.float32)
                for s2 in range(0, n_splits):
                    base = (bq * n_splits + s2) * hq
                    ls = tl.load(pl_ptr + base + tl.arange(0, HKV)[:, None] * GROUP +
                                 tl.arange(0, GP)[None, :],
                                 mask=tl.arange(0, GP)[None, :] < GROUP, other=float("-inf"),
                                 cache_modifier=".cg")
                    os_ = tl.load(po_ptr + (base + heads) * D + d3, mask=hmask, other=0.0,
                                  cache_modifier=".cg")
                    m_new = tl.maximum(m, ls)
                    ref = tl.where(m_new == float("-inf"), 0.0, m_new)
                    alpha = tl.exp(m - ref)
                    w = tl.exp(ls - ref)
                    den = den * alpha + w
                    acc = acc * alpha[:, :, None] + w[:, :, None] * os_
                    m = m_new
                tl.store(cnt_ptr + b, 0)  # zeroed for the next launch (a graph replays it)
        if HAS_SINKS:  # one more logit per head, with a zero value
            sk = tl.load(sinks_ptr + tl.arange(0, HKV)[:, None] * GROUP + tl.arange(0, GP)[None, :],
                         mask=tl.arange(0, GP)[None, :] < GROUP, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, sk)
            ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - ref)
            den = den * alpha + tl.exp(sk - ref)
            acc = acc * alpha[:, :, None]
            m = m_new
        ref = tl.where(m == float("-inf"), 0.0, m)
        ok = den != 0
        o = tl.where(ok[:, :, None], acc / tl.where(ok, den, 1.0)[:, :, None], 0.0)
        lse = tl.where(ok, ref + tl.log(tl.where(ok, den, 1.0)), float("-inf"))
        # one split writes directly; with splits only the merging program holds a valid state
        final = True
        if SPLIT:
            final = done == n_splits - 1
        if final:
            tl.store(o_ptr + bq * stride_ot + heads * stride_oh + d3, o.to(o_ptr.dtype.element_ty),
                     mask=hmask)
            tl.store(lse_ptr + bq * hq + tl.arange(0, HKV)[:, None] * GROUP +
                     tl.arange(0, GP)[None, :], lse, mask=tl.arange(0, GP)[None, :] < GROUP)

    return decode_rows_kernel


def decode_rows(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                kv_indptr: torch.Tensor, kv_indices: torch.Tensor, q_pos: torch.Tensor,
                kv_pos: torch.Tensor, *, window: int | None, scale: float,
                softcap: float | None = None, sinks: torch.Tensor | None = None,
                new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                dummy_rows: int = 1, num_splits: int | None = None,
                counters: torch.Tensor | None = None, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode of one query per request over whole pool rows, in one launch; returns (o, lse).

    q: [B, Hq, D]; k_buf, v_buf: [rows, Hkv, D] in q's dtype (`rows_serve`); kv_indptr: [B+1]
    int32; kv_indices: [total_kv] int32/int64 rows; q_pos: [B] int32; kv_pos: [total_kv] int32;
    sinks: [Hq] fp32. new_kv: (k [B, Hkv, D], v [B, Hkv, D], slots [B] int64): this step's rows,
    written by the kernel at ``slots`` (each request's key list holds that slot once, at q's
    position). dummy_rows: the pool's dummy page (rows [0, dummy_rows), no request's): writes of
    padding requests there are dropped, which keeps a check-mode pool's poison. num_splits: per request (default `rows_splits` of static sizes). counters: [≥ B]
    int32 zeros the kernel leaves zeroed (a graph's own buffer; default a fresh one).
    out: [B, Hq, D] to write o into (default new).
    """
    nb, hq, d = q.shape
    hkv = k_buf.shape[1]
    if not rows_serve(q, k_buf, v_buf):
        raise ValueError(f"decode_rows needs Hkv·D ≤ 1024, a group ≤ 16 and K/V in q's dtype; "
                         f"got q {list(q.shape)} {q.dtype}, K/V {list(k_buf.shape)} {k_buf.dtype}")
    if kv_indptr.numel() != nb + 1:
        raise ValueError(f"decode_rows needs one query per request: {nb} queries, "
                         f"{kv_indptr.numel() - 1} requests")
    if q.stride(2) != 1:
        q = q.contiguous()
    block_n, warps, stages = rows_config(hkv, d)
    splits = num_splits or rows_splits(nb, kv_indices.numel() // max(nb, 1), block_n, q.device)
    o = out if out is not None else torch.empty_like(q)
    lse = torch.empty(nb, hq, dtype=torch.float32, device=q.device)
    if nb == 0:
        return o, lse
    po = pl = lse  # unused with one split
    if splits > 1:
        po = torch.empty(nb * splits * hq * d, dtype=torch.float32, device=q.device)
        pl = torch.empty(nb * splits * hq, dtype=torch.float32, device=q.device)
    if counters is None:
        counters = torch.zeros(nb, dtype=torch.int32, device=q.device)
    kn = vn = wloc = q
    if new_kv is not None:
        kn, vn, wloc = new_kv
        if kn.shape != (nb, hkv, d) or vn.shape != kn.shape or not (
                kn.is_contiguous() and vn.is_contiguous()) or kn.dtype != k_buf.dtype:
            raise ValueError(f"new_kv must be contiguous [{nb}, {hkv}, {d}] {k_buf.dtype}, got "
                             f"{list(kn.shape)} {kn.dtype} / {list(vn.shape)}")
    sk = sinks.float().contiguous() if sinks is not None else lse
    global launches
    launches += 1
    _kernel(interpreting())[(nb, splits)](
        q, k_buf, v_buf, kv_indptr, kv_indices, q_pos, kv_pos, sk, kn, vn, wloc, o, lse, po, pl,
        counters, q.stride(0), q.stride(1), k_buf.stride(0), v_buf.stride(0),
        kn.stride(0), o.stride(0), o.stride(1), splits, float(scale), float(softcap or 1.0),
        int(window or 1), int(dummy_rows), HKV=hkv, GROUP=hq // hkv, GP=max(16, 1 << (hq // hkv - 1).bit_length()),
        D=d, BLOCK_N=block_n, SPLIT=splits > 1, HAS_WINDOW=window is not None,
        HAS_SOFTCAP=softcap is not None, HAS_SINKS=sinks is not None, FUSED=new_kv is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else None, num_warps=warps,
        num_stages=stages)
    return o, lse
