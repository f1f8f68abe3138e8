"""Paged extend / verify: several queries per request, causal or custom structure, window by position.

It serves prefill with a cached prefix, chain and tree verify, draft extend and DFlash blocks.
All of them are one rule: allowed = structure & (q_pos - kv_pos < W). The structure is either
causal by position (``mask`` None, or a request's empty block: a graph bucket captured with a
mask replays chains too) or a per-request bool block.

One program per (request, KV head, query tile, split). Its tile rows are (query, head) pairs:
row r is query ``r // GROUP`` and head ``r % GROUP`` of the KV head. So the GQA heads and the
tile's queries (the 8 tokens of a verify step) share every K/V row load; for a verify step the
tile holds all of them (8 tokens × group 8 = 64 rows at Gemma 4's full layers: one wgmma tile on
Hopper), so each K/V row is read once per KV head.

Two kinds of key tiles. A pre-pass (``dense_runs``, one small program per request, no sync)
finds the request's *dense run* [lo, hi): the first run of keys that every query of the request
sees (structure and window), read from the mask and positions, so any structure stays exact.
For a verify step that is the whole cached prefix (inside the window). Tiles inside the dense run
take the plain flash-attention body: no structure or window test, no mask bytes, no per-key NaN
bookkeeping (a non-finite value there is seen by every row, so it may flow; a row it reached is
made NaN whole at the end, as the general body does), with the next tile's pool rows loaded a
tile ahead by hand (``IDX_AHEAD``). The keys before and after it (the window edge, the draft tokens, the tree columns)
take the general body: keys no row can see are loaded under a mask (no bytes, no NaN), and a tile
nobody sees is skipped (with a window, or in a long causal prefill, where skipping pays for the
branch). A key that some rows see and others do not is loaded. Its probability is exactly 0 for
the rows that cannot see it, but 0·NaN would still poison them. So non-finite V values are zeroed
before the product, and only the rows that really see one are set to NaN (stale reads still show).
Splits and the sink are reduced by ``merge.combine_splits``; one split writes the result itself.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from swafactory.kernels.triton.extend_tiles import extend_config, extend_splits
from swafactory.kernels.triton.host import (check_rows, finish, flags, outputs, partials,
                                            scalars, sinks_arg, strides)
from swafactory.kernels.triton.merge import compute_dtype, interpreting
from swafactory.kernels.torch_ref import check_contract
from swafactory.kernels.triton.verify_wide import wide_verify
from swafactory.kernels.cuda.verify import dense_verify_d512, verify_d512_serves

__all__ = ["extend_attention", "extend_config", "extend_splits", "dense_runs"]


@functools.cache
def _kernel(interpret: bool) -> Any:
    del interpret  # cache key only: triton.jit reads TRITON_INTERPRET when decorating
    global online  # the kernel calls its shared steps through the module (see online.py)
    import triton
    import triton.language as tl

    from swafactory.kernels.triton import online

    @triton.jit
    def dense_range(qo_indptr, kv_indptr, q_pos, kv_pos, mask_ptr, mask_indptr, rng_ptr, window,
                    CH: tl.constexpr, RB: tl.constexpr, HAS_MASK: tl.constexpr,
                    HAS_WINDOW: tl.constexpr):
        """rng[b] = (lo, hi): keys lo..hi-1 of request b are seen by all of its queries; the run
        starts at the first such key (lo = hi = n where there is none)."""
        BIG: tl.constexpr = 1 << 30
        b = tl.program_id(0)
        q0 = tl.load(qo_indptr + b)
        nq = tl.load(qo_indptr + b + 1) - q0
        kv0 = tl.load(kv_indptr + b)
        n = tl.load(kv_indptr + b + 1) - kv0
        qmin = tl.full((), BIG, tl.int32)
        qmax = tl.full((), -BIG, tl.int32)
        for i0 in range(0, nq, CH):
            qi = i0 + tl.arange(0, CH)
            qok = qi < nq
            qp = tl.load(q_pos + q0 + qi, mask=qok, other=0)
            qmin = tl.minimum(qmin, tl.min(tl.where(qok, qp, BIG), axis=0))
            qmax = tl.maximum(qmax, tl.max(tl.where(qok, qp, -BIG), axis=0))
        lo = n
        hi = n
        for j0 in range(0, n, CH):
            offs = j0 + tl.arange(0, CH)
            inr = offs < n
            kp = tl.load(kv_pos + kv0 + offs, mask=inr, other=0)
            allv = inr
            if HAS_MASK:
                mbase = tl.load(mask_indptr + b).to(tl.int64)
                if tl.load(mask_indptr + b + 1) > mbase:
                    for i0 in range(0, nq, RB):
                        ri = i0 + tl.arange(0, RB)
                        mv = tl.load(mask_ptr + mbase + ri[:, None].to(tl.int64) * n
                                     + offs[None, :], mask=(ri[:, None] < nq) & inr[None, :],
                                     other=1)
                        allv = allv & (tl.min(mv, axis=0) != 0)
                else:  # an empty block: causal by position (a graph bucket's chain request)
                    allv = allv & (kp <= qmin)
            else:
                allv = allv & (kp <= qmin)
            if HAS_WINDOW:
                allv = allv & (qmax - kp < window)
            lo = tl.minimum(lo, tl.min(tl.where(allv, offs, n), axis=0))
            hi = tl.minimum(hi, tl.min(tl.where(inr & (allv == 0) & (offs > lo), offs, n), axis=0))
        tl.store(rng_ptr + 2 * b, lo)
        tl.store(rng_ptr + 2 * b + 1, hi)

    @triton.jit
    def extend_stage1(q_ptr, k_ptr, v_ptr, qo_indptr, kv_indptr, kv_indices, q_pos, kv_pos,
                      mask_ptr, mask_indptr, rng_ptr, sinks_ptr, o_ptr, lse_ptr, po_ptr, plse_ptr,
                      stride_qt, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh,
                      stride_ot, stride_oh, Hq, QT, n_splits, part_stride, part_base, scale,
                      softcap, window, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      D: tl.constexpr, SPLIT: tl.constexpr, HAS_MASK: tl.constexpr,
                      HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                      HAS_SINKS: tl.constexpr, PRECISION: tl.constexpr,
                      SKIP_EMPTY: tl.constexpr, DENSE: tl.constexpr, BLOCK_NG: tl.constexpr,
                      IDX_AHEAD: tl.constexpr, CDT: tl.constexpr, SKIP_DENSE: tl.constexpr):
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
        chunk = tl.cdiv(tl.cdiv(n, n_splits), BLOCK_N) * BLOCK_N
        lo = sp * chunk
        hi = tl.minimum(lo + chunk, n)
        hi = tl.where(qt * BLOCK_Q < nq, hi, lo)  # a tile past the request's queries does nothing
        if DENSE:  # the dense run, clipped to this split: [lo, a) general, [a, e) dense, [e, hi) general
            a = tl.minimum(tl.maximum(tl.load(rng_ptr + 2 * b), lo), hi)
            e = tl.minimum(tl.maximum(tl.load(rng_ptr + 2 * b + 1), a), hi)
        else:
            a = hi
            e = hi
        d = tl.arange(0, D)
        qrow = (q0 + ql).to(tl.int64)
        q = tl.load(q_ptr + qrow[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=rvalid[:, None], other=0.0).to(CDT)
        qp = tl.load(q_pos + qrow, mask=rvalid, other=0)
        mrow = ql.to(tl.int64) * n
        rmask = rvalid  # rows that read mask bytes
        if HAS_MASK:  # an empty block (a graph bucket's chain request): causal by position
            mrow += tl.load(mask_indptr + b).to(tl.int64)
            block_len = tl.load(mask_indptr + b + 1) - tl.load(mask_indptr + b)
            rmask = rvalid & ((tl.zeros([BLOCK_M], tl.int32) + block_len) > 0)
        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        den = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        poisoned = tl.zeros((BLOCK_M,), tl.int32)
        if SKIP_DENSE:  # another kernel reads the dense run (the CUDA tile at head_dim 512)
            e_run = a
        else:
            e_run = e
        if IDX_AHEAD:  # the next tile's pool rows are loaded one tile ahead, by hand
            nxt = a + tl.arange(0, BLOCK_N)
            rows_next = tl.load(kv_indices + kv0 + nxt, mask=nxt < e_run, other=0)
        for start in range(a, e_run, BLOCK_N):  # every row sees every key up to e
            offs = start + tl.arange(0, BLOCK_N)
            inr = offs < e_run
            if IDX_AHEAD:
                rows = rows_next.to(tl.int64)
                nxt = offs + BLOCK_N
                rows_next = tl.load(kv_indices + kv0 + nxt, mask=nxt < e_run, other=0)
            else:
                rows = tl.load(kv_indices + kv0 + offs, mask=inr, other=0).to(tl.int64)
            k = tl.load(k_ptr + rows[:, None] * stride_kr + kh * stride_kh + d[None, :],
                        mask=inr[:, None], other=0.0).to(CDT)  # fp8: dequantized in registers
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            if HAS_SOFTCAP:
                s = online.tanh_cap(s, softcap)
            s = tl.where(inr[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))  # no -inf guard: every row sees a key here
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            v = tl.load(v_ptr + rows[:, None] * stride_vr + kh * stride_vh + d[None, :],
                        mask=inr[:, None], other=0.0).to(CDT)
            den, acc = online.accumulate(den, acc, alpha, p, v, PRECISION)
            m = m_new
        # the general tiles: [lo, a) (before the run: window edge) and [e, hi) (after it)
        tiles_a = tl.cdiv(a - lo, BLOCK_NG)
        for t in range(0, tiles_a + tl.cdiv(hi - e, BLOCK_NG)):
            start = tl.where(t < tiles_a, lo + t * BLOCK_NG, e + (t - tiles_a) * BLOCK_NG)
            bound = tl.where(t < tiles_a, a, hi)
            offs = start + tl.arange(0, BLOCK_NG)
            inr = offs < bound
            kp = tl.load(kv_pos + kv0 + offs, mask=inr, other=0)
            both = rvalid[:, None] & inr[None, :]
            if HAS_MASK:
                vis = tl.load(mask_ptr + mrow[:, None] + offs[None, :],
                              mask=rmask[:, None] & inr[None, :], other=0) != 0
                vis = tl.where(rmask[:, None], vis, kp[None, :] <= qp[:, None]) & both
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
                            mask=kvis[:, None], other=0.0).to(CDT)
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
                if HAS_SOFTCAP:
                    s = online.tanh_cap(s, softcap)
                s = tl.where(vis, s, float("-inf"))
                m_new, ref, alpha = online.online_max(m, tl.max(s, axis=1))
                p = tl.exp(s - ref[:, None])
                v = tl.load(v_ptr + rows[:, None] * stride_vr + kh * stride_vh + d[None, :],
                            mask=kvis[:, None], other=0.0).to(CDT)
                bad = (v * 0.0) != 0.0                              # NaN or ±inf
                vbad = tl.max(bad.to(tl.int32), axis=1)             # [BLOCK_NG]
                poisoned = tl.maximum(poisoned, tl.max(tl.where(vis, vbad[None, :], 0), axis=1))
                v = tl.where(bad, 0.0, v)
                den, acc = online.accumulate(den, acc, alpha, p, v, PRECISION)
                m = m_new
        if not SPLIT and HAS_SINKS:
            m, den, acc = online.add_sink(sinks_ptr, heads, rvalid, m, den, acc)
        if DENSE:  # a NaN that flowed through the dense run poisons the whole row, as elsewhere
            poisoned = tl.maximum(poisoned, tl.max(((acc * 0.0) != 0.0).to(tl.int32), axis=1))
        o, lse = online.normalize(m, den, acc, poisoned)
        if not SPLIT:
            tl.store(o_ptr + qrow[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                     o.to(o_ptr.dtype.element_ty), mask=rvalid[:, None])
            tl.store(lse_ptr + qrow * Hq + heads, lse, mask=rvalid)
        else:
            part = (qrow * Hq + heads) * part_stride + part_base + sp
            tl.store(po_ptr + part[:, None] * D + d[None, :], o, mask=rvalid[:, None])
            tl.store(plse_ptr + part, lse, mask=rvalid)

    return dense_range, extend_stage1


def dense_runs(qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, q_pos: torch.Tensor,
               kv_pos: torch.Tensor, mask: torch.Tensor | None, mask_indptr: torch.Tensor | None,
               window: int | None, max_q_len: int) -> torch.Tensor:
    """[B, 2] int32 (lo, hi) per request: keys lo..hi-1 are seen by every query of the request
    (structure and window); lo = hi = n where no key is. One small program per request, no sync.
    ``mask`` as in ``extend_attention`` (flat bool/uint8) or None for causal."""
    nb = qo_indptr.numel() - 1
    rng = torch.empty(nb, 2, dtype=torch.int32, device=qo_indptr.device)
    if mask is not None:
        mask = mask.contiguous()
        mask = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    gpu = qo_indptr.is_cuda
    _kernel(interpreting())[0][(nb,)](
        qo_indptr, kv_indptr, q_pos, kv_pos, mask if mask is not None else rng,
        mask_indptr if mask_indptr is not None else qo_indptr, rng, int(window or 1),
        CH=2048 if gpu else 64, RB=min(16, max(2, 1 << (max(max_q_len, 1) - 1).bit_length())),
        HAS_MASK=mask is not None, HAS_WINDOW=window is not None, num_warps=8 if gpu else 1)
    return rng


def extend_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                     qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                     q_pos: torch.Tensor, kv_pos: torch.Tensor, *, mask: torch.Tensor | None = None,
                     mask_indptr: torch.Tensor | None = None, window: int | None = None,
                     scale: float, softcap: float | None = None, sinks: torch.Tensor | None = None,
                     max_q_len: int | None = None, num_splits: int | None = None,
                     config: tuple[int, ...] | None = None, dense: bool = True,
                     k_scale: float = 1.0, v_scale: float = 1.0, wide: bool = False,
                     cuda: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged extend/verify under the kernel contract (``kernels/torch_ref.py``); returns (o, lse).

    q: [total_q, Hq, D]; k_buf, v_buf: [rows, Hkv, D] in q's dtype, last dim contiguous;
    qo_indptr, kv_indptr: [B+1] int32; kv_indices: [total_kv] int32/int64; q_pos: [total_q]
    int32; kv_pos: [total_kv] int32; mask: flat bool/uint8 with mask_indptr [B+1] int32 (elements),
    or None for causal; sinks: [Hq] fp32. ``max_q_len`` (host int) sizes the grid; without it the
    longest request is read from qo_indptr, which syncs a GPU (pass it under CUDA-graph capture).
    ``num_splits`` overrides the KV split count, ``config`` the tile (BLOCK_M, BLOCK_N, warps,
    stages[, pool rows loaded a tile ahead by hand]) and ``dense=False`` turns the dense-run fast
    path off (tests, benchmarks); by default they are planned from static sizes. fp8 buffers
    (with ``k_scale``/``v_scale``) are read in q's dtype: k_scale joins the softmax scale and
    v_scale the output. ``wide=True`` takes the two-kernel path of ``verify_wide`` instead (up to
    64 rows per KV head; opt-in, slower on the H200 so far). ``cuda``: the dense run of a
    head_dim-512 verify tile in our CUDA kernel (``kernels/cuda/verify_d512.cu``) where it
    serves (None: wherever it serves; False: never; True: required, else ValueError).
    """
    nb, group = check_contract(q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, q_pos, kv_pos,
                               mask, mask_indptr, sinks)
    total_q, hq, d = q.shape
    hkv = k_buf.shape[1]
    q = check_rows(q, k_buf, v_buf)
    o, lse = outputs(q)
    if nb == 0 or total_q == 0:
        return o, lse
    if max_q_len is None:
        max_q_len = int((qo_indptr[1:] - qo_indptr[:-1]).max())
    rows = max_q_len * group
    if mask is not None:
        mask = mask.contiguous()
        mask = mask.view(torch.uint8) if mask.dtype == torch.bool else mask  # same bytes
    if wide:  # opt-in: measured slower than this tile (`verify_wide`'s docstring)
        if rows > 64:
            raise ValueError(f"the wide verify path holds 64 rows per KV head, got {rows}")
        return wide_verify(q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, q_pos, kv_pos,
                           mask=mask, mask_indptr=mask_indptr, window=window, scale=scale,
                           softcap=softcap, sinks=sinks, group=group,
                           block_m=max(16, 1 << (rows - 1).bit_length()),
                           cdt=compute_dtype(q.dtype, k_buf.dtype), k_scale=k_scale,
                           v_scale=v_scale)
    cfg = tuple(config or extend_config(d, group, rows))
    block_m, block_n, warps, stages = cfg[:4]
    idx_ahead = bool(cfg[4]) if len(cfg) > 4 else False
    # skip invisible tiles only where many exist: an untrimmed window or a long causal prefill
    skip = window is not None and kv_indices.numel() > nb * (window + max_q_len + block_n)
    # the general tiles of a short extend on a trimmed list are the window edge and the draft
    # keys, a few keys each: narrow tiles
    block_ng = min(block_n, 16) if dense and max_q_len <= 16 and not skip else block_n
    qt = -(-max_q_len // (block_m // group))
    tile = cuda is not False and dense and softcap is None and k_scale == 1.0 and v_scale == 1.0 \
        and verify_d512_serves(q, k_buf, v_buf, group, rows)
    if cuda and not tile:
        raise ValueError("cuda=True: the CUDA verify tile serves bf16 q and pool, head_dim 512, "
                         "group 8, ≤ 64 rows, no softcap or fp8, with nvcc present")
    if tile and kv_indices.dtype != torch.int32:  # pool rows fit int32; the tile reads int32
        kv_indices = kv_indices.to(torch.int32)
    if tile:  # the dense run in the CUDA tile (partials 1..), the other keys here (partial 0)
        splits = 1 + extend_splits(nb * hkv, kv_indices.numel(), nb, 64, 32, d, q.device)
    else:
        splits = num_splits or extend_splits(nb * hkv * qt, kv_indices.numel(), nb, block_m,
                                             block_n, d, q.device)
    po, plse = partials(q, splits, lse)  # lse (unused) when one split writes the output itself
    dummy_mask = mask if mask is not None else lse
    dummy_mi = mask_indptr if mask_indptr is not None else qo_indptr
    stage1 = _kernel(interpreting())[1]
    rng = qo_indptr  # unused without the dense path
    if dense:
        rng = dense_runs(qo_indptr, kv_indptr, q_pos, kv_pos, mask, mask_indptr, window, max_q_len)
    stage1[(nb, hkv * qt, 1 if tile else splits)](
        q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, q_pos, kv_pos,
        dummy_mask, dummy_mi, rng, sinks_arg(sinks, lse), o, lse, po, plse,
        *strides(q, k_buf, v_buf, o), hq, qt, 1 if tile else splits, splits, 0,
        *scalars(scale, k_scale, softcap, window),
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, D=d, SPLIT=splits > 1,
        HAS_MASK=mask is not None, SKIP_EMPTY=skip or (mask is None and max_q_len > block_n),
        DENSE=dense, BLOCK_NG=block_ng, IDX_AHEAD=idx_ahead, SKIP_DENSE=tile, num_warps=warps,
        num_stages=stages, **flags(q, k_buf, window, softcap, sinks))
    if tile:
        dense_verify_d512(q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, rng, po, plse,
                          part_base=1, splits=splits - 1, scale=scale)
    return finish(o, lse, po, plse, splits, sinks, v_scale)
