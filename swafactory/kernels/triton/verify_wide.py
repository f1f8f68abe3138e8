"""Verify on wide heads (D ≥ 512) in two kernels: scores, then P·V split over D.

Why. A verify step at Gemma 4's full layers packs 8 tokens × 8 GQA heads = 64 rows per KV head
at D = 512. The one-kernel tile (`extend.py`) then holds a 64 × 512 fp32 accumulator, half the
register file: one program per multiprocessor, every key tile a dependent chain (scores, rescale,
P·V), and it runs at 1.7-2.0 ms per layer where its K/V take 0.5 ms to read (H200, bs 64, ctx 8K;
bench/results/probes-54316e4.md). Split the work so no program holds it:

* ``scores``: one program per (request, KV head, key split); per key tile of ``BN`` keys it
  computes the 64 × BN scores, their row max ``m_t`` and ``l_t = Σ exp(s − m_t)``, and stores
  ``P_t = exp(s − m_t)`` in the compute dtype. Keys a row cannot see (structure, window, past the
  list) are stored as ``-1``, a value ``exp`` never gives (and NaN never equals), so the second
  kernel knows them without a mask of its own.
* ``pv``: one program per (D slice, request, KV head[, key split]); it takes the row max ``M`` over
  the tiles' ``m_t``, then ``acc += (P_t · e^{m_t − M}) · V_t[:, slice]`` and ``L += l_t ·
  e^{m_t − M}``; ``o = acc / L``. Programs of one (request, head) differ only in their D slice and
  are launched next to each other, so P comes from L2 after the first.

Measured (H200, commit 2db4d40, `bench/probes/triton_vs_flashinfer.py --only gemma4_full_verify8
--wide-sweep`; bs 64, ctx 8192, 8 chain tokens, D 512, group 8): 4.04-4.21 ms at BN 32 and 5.27
at BN 64, against 2.01 ms for the one-kernel tile and 2.23 for FlashInfer's custom-mask prefill,
outputs equal (rel err 3.1e-3 against FlashInfer, as the tile's). Both kernels still run one
program per multiprocessor: the scores kernel holds Q (64 × 512 bf16, 64 KB) in shared memory
beside its K stages (135 KB at 3 stages), and the P·V kernel takes 240 registers at 8 warps
(226 at 4 warps with 128-column slices, 4.21 ms). So it is opt-in (``extend_attention(...,
wide=True)``) and not what the backends run. What it would take next: Q·Kᵀ accumulated over D
slices, so Q is not resident (the ``DK`` tile option; in `--wide-sweep`, not yet timed), and
several P·V programs per multiprocessor.

Each tile is its own softmax chunk, so P is exact up to its dtype's rounding (it lies in [0, 1]),
as in the one-kernel tile, which casts p to the V dtype before its product too.

Tiles are numbered per request: tile t of request b is row ``kv_indptr[b] // BN + b + t`` of
the workspace, unique across requests (⌊(a + n)/BN⌋ ≥ ⌊a/BN⌋ + ⌊n/BN⌋), so the workspace is
sized from host-known totals: ``total_kv // BN + B + 1`` tiles, no read-back.

Stale reads behave as in the one-kernel tile: a non-finite K makes the scores of the rows that see
it NaN (through P and l_t); a non-finite V is zeroed before the product and only the rows that see
that key are set to NaN, so a key no row of the tile sees poisons nothing.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from swafactory.kernels.triton.merge import combine_splits, interpreting, sm_count

__all__ = ["wide_verify", "wide_config"]

def wide_config(head_dim: int) -> dict:
    """Tiles: BN keys per tile, scores warps/stages, P·V D-slice width, warps/stages, and DK,
    the D slice the scores accumulate over (D: Q resident; less: Q re-read per slice, untimed so
    far). A config may also fix ``s_splits`` / ``pv_splits``, each kernel's key splits."""
    return dict(BN=32, s_warps=4, s_stages=3, DS=256, pv_warps=8, pv_stages=3, DK=head_dim)


@functools.cache
def _kernels(interpret: bool) -> Any:
    del interpret  # cache key only: triton.jit reads TRITON_INTERPRET when decorating
    import triton
    import triton.language as tl

    @triton.jit
    def scores(q_ptr, k_ptr, qo_indptr, kv_indptr, kv_indices, q_pos, kv_pos, mask_ptr,
               mask_indptr, p_ptr, m_ptr, l_ptr, stride_qt, stride_qh, stride_kr, stride_kh,
               n_splits, G, scale, softcap, window, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
               BN: tl.constexpr, D: tl.constexpr, HAS_MASK: tl.constexpr,
               HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
               CDT: tl.constexpr, DK: tl.constexpr):
        b = tl.program_id(0)
        kh = tl.program_id(1)
        sp = tl.program_id(2)
        q0 = tl.load(qo_indptr + b)
        nq = tl.load(qo_indptr + b + 1) - q0
        kv0 = tl.load(kv_indptr + b)
        n = tl.load(kv_indptr + b + 1) - kv0
        r = tl.arange(0, BLOCK_M)
        ql = r // GROUP
        heads = kh * GROUP + r % GROUP
        rvalid = ql < nq
        chunk = tl.cdiv(tl.cdiv(n, n_splits), BN) * BN
        lo = sp * chunk
        hi = tl.minimum(lo + chunk, n)
        qrow = (q0 + ql).to(tl.int64)
        q_at = q_ptr + qrow[:, None] * stride_qt + heads[:, None] * stride_qh
        if DK == D:  # Q stays resident (in shared memory beside the K stages)
            q = tl.load(q_at + tl.arange(0, D)[None, :], mask=rvalid[:, None], other=0.0).to(CDT)
        qp = tl.load(q_pos + qrow, mask=rvalid, other=0)
        mrow = ql.to(tl.int64) * n
        if HAS_MASK:
            mrow += tl.load(mask_indptr + b).to(tl.int64)
        tile0 = kv0 // BN + b  # this request's first workspace tile
        for start in range(lo, hi, BN):
            offs = start + tl.arange(0, BN)
            inr = offs < hi
            kp = tl.load(kv_pos + kv0 + offs, mask=inr, other=0)
            both = rvalid[:, None] & inr[None, :]
            if HAS_MASK:
                vis = both & (tl.load(mask_ptr + mrow[:, None] + offs[None, :], mask=both,
                                      other=0) != 0)
            else:
                vis = both & (kp[None, :] <= qp[:, None])
            if HAS_WINDOW:
                vis = vis & (qp[:, None] - kp[None, :] < window)
            kvis = tl.max(vis.to(tl.int32), axis=0) > 0  # keys nobody sees are not loaded
            rows = tl.load(kv_indices + kv0 + offs, mask=kvis, other=0).to(tl.int64)
            k_at = k_ptr + rows[:, None] * stride_kr + kh * stride_kh
            if DK == D:
                k = tl.load(k_at + tl.arange(0, D)[None, :], mask=kvis[:, None], other=0.0)
                s = tl.dot(q, tl.trans(k.to(CDT)), input_precision=PRECISION)
            else:  # Q·Kᵀ over D slices of DK: Q is re-read from cache, not held (occupancy)
                s = tl.zeros((BLOCK_M, BN), tl.float32)
                for d0 in tl.static_range(0, D, DK):
                    dk = d0 + tl.arange(0, DK)
                    qc = tl.load(q_at + dk[None, :], mask=rvalid[:, None], other=0.0).to(CDT)
                    kc = tl.load(k_at + dk[None, :], mask=kvis[:, None], other=0.0).to(CDT)
                    s += tl.dot(qc, tl.trans(kc), input_precision=PRECISION)
            s = s * scale
            if HAS_SOFTCAP:  # cap·tanh(s/cap), tanh written with exp (portable to the interpreter)
                s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
            s = tl.where(vis, s, float("-inf"))
            mt = tl.max(s, axis=1)
            ref = tl.where(mt == float("-inf"), 0.0, mt)
            p = tl.exp(s - ref[:, None])
            lt = tl.sum(p, axis=1)
            p = tl.where(vis, p, -1.0)  # the marker of an unseen key
            g = (kh * G + tile0 + start // BN).to(tl.int64) * BLOCK_M + r
            tl.store(p_ptr + g[:, None] * BN + tl.arange(0, BN)[None, :], p.to(CDT))
            tl.store(m_ptr + g, mt)
            tl.store(l_ptr + g, lt)

    @triton.jit
    def pv(v_ptr, qo_indptr, kv_indptr, kv_indices, p_ptr, m_ptr, l_ptr, o_ptr, lse_ptr, po_ptr,
           plse_ptr, stride_vr, stride_vh, stride_ot, stride_oh, Hq, Hkv, n_splits, G, v_scale,
           GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
           DS: tl.constexpr, TT: tl.constexpr, SPLIT: tl.constexpr, CDT: tl.constexpr):
        NDS: tl.constexpr = D // DS
        ds = tl.program_id(0) % NDS
        kh = (tl.program_id(0) // NDS) % Hkv
        b = tl.program_id(0) // (NDS * Hkv)
        sp = tl.program_id(1)
        q0 = tl.load(qo_indptr + b)
        nq = tl.load(qo_indptr + b + 1) - q0
        kv0 = tl.load(kv_indptr + b)
        n = tl.load(kv_indptr + b + 1) - kv0
        r = tl.arange(0, BLOCK_M)
        ql = r // GROUP
        heads = kh * GROUP + r % GROUP
        rvalid = ql < nq
        tiles = tl.cdiv(n, BN)
        per = tl.cdiv(tiles, n_splits)
        t_lo = sp * per
        t_hi = tl.minimum(t_lo + per, tiles)
        base = kh * G + kv0 // BN + b  # this request's first workspace tile
        # the row max over this split's tiles, TT tiles a load
        big = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        for t0 in range(t_lo, t_hi, TT):
            tt = t0 + tl.arange(0, TT)
            g = (base + tt).to(tl.int64)[:, None] * BLOCK_M + r[None, :]
            mt = tl.load(m_ptr + g, mask=(tt < t_hi)[:, None], other=float("-inf"))
            big = tl.maximum(big, tl.max(mt, axis=0))
        ref = tl.where(big == float("-inf"), 0.0, big)
        dd = ds * DS + tl.arange(0, DS)
        acc = tl.zeros((BLOCK_M, DS), tl.float32)
        den = tl.zeros((BLOCK_M,), tl.float32)
        poisoned = tl.zeros((BLOCK_M,), tl.int32)
        for t in range(t_lo, t_hi):
            g = (base + t).to(tl.int64) * BLOCK_M + r
            w = tl.exp(tl.load(m_ptr + g) - ref)
            den += tl.load(l_ptr + g) * w
            p = tl.load(p_ptr + g[:, None] * BN + tl.arange(0, BN)[None, :]).to(tl.float32)
            offs = t * BN + tl.arange(0, BN)
            vis = (p != -1.0) & (offs < n)[None, :]  # NaN != -1: a NaN score stays seen
            kvis = tl.max(vis.to(tl.int32), axis=0) > 0
            rows = tl.load(kv_indices + kv0 + offs, mask=kvis, other=0).to(tl.int64)
            v = tl.load(v_ptr + rows[:, None] * stride_vr + kh * stride_vh + dd[None, :],
                        mask=kvis[:, None], other=0.0).to(CDT)
            bad = (v * 0.0) != 0.0                              # NaN or ±inf
            vbad = tl.max(bad.to(tl.int32), axis=1)
            poisoned = tl.maximum(poisoned, tl.max(tl.where(vis, vbad[None, :], 0), axis=1))
            v = tl.where(bad, 0.0, v)
            pw = tl.where(vis, p * w[:, None], 0.0).to(CDT)
            acc += tl.dot(pw, v, input_precision="ieee" if CDT == tl.float32 else None)
        ok = den != 0  # NaN stays NaN: a visible stale read must show
        o = tl.where(ok[:, None], acc / tl.where(ok, den, 1.0)[:, None], 0.0) * v_scale
        o = tl.where(poisoned[:, None] > 0, float("nan"), o)
        lse = tl.where(ok, ref + tl.log(tl.where(ok, den, 1.0)), float("-inf"))
        qrow = (q0 + ql).to(tl.int64)
        if not SPLIT:
            tl.store(o_ptr + qrow[:, None] * stride_ot + heads[:, None] * stride_oh + dd[None, :],
                     o.to(o_ptr.dtype.element_ty), mask=rvalid[:, None])
            if ds == 0:
                tl.store(lse_ptr + qrow * Hq + heads, lse, mask=rvalid)
        else:
            part = (qrow * Hq + heads) * n_splits + sp
            tl.store(po_ptr + part[:, None] * D + dd[None, :], o, mask=rvalid[:, None])
            if ds == 0:
                tl.store(plse_ptr + part, lse, mask=rvalid)

    return scores, pv


def _splits(programs: int, tiles_per_req: int, device: torch.device, floor: int) -> int:
    """Splits per program so ``programs × splits`` fills about ``floor`` waves, each split at
    least 8 tiles: static sizes only (stable under graph capture)."""
    want = -(-floor * sm_count(device) // max(programs, 1))
    return int(max(1, min(want, tiles_per_req // 8, 64)))


def wide_verify(q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, q_pos, kv_pos, *, mask,
                mask_indptr, window, scale, softcap, sinks, group: int, block_m: int,
                cdt, k_scale: float = 1.0, v_scale: float = 1.0, config: dict | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of tiles of ``block_m`` = queries × group rows (≤ 64) → (o, lse).

    Arguments as ``extend.extend_attention`` takes them after its contract check (q [total_q, Hq,
    D]; k_buf, v_buf [rows, Hkv, D]; int32 indptrs [B+1], kv_indices [total_kv], q_pos
    [total_q] / kv_pos [total_kv] int32; mask flat uint8 with mask_indptr, or None for causal;
    sinks [Hq] fp32 or None); ``cdt`` the Triton compute dtype. Nothing is read back.
    """
    cfg = dict(wide_config(q.shape[2]), **(config or {}))
    total_q, hq, d = q.shape
    bn, dsw = cfg["BN"], min(cfg["DS"], d)
    nb = qo_indptr.numel() - 1
    hkv = k_buf.shape[1]
    total_kv = kv_indices.numel()
    o = torch.empty_like(q)
    lse = torch.empty(total_q, hq, dtype=torch.float32, device=q.device)
    g = total_kv // bn + nb + 1
    p = torch.empty(hkv * g * block_m * bn, dtype=q.dtype, device=q.device)  # P in the tile dtype
    mt = torch.empty(hkv * g * block_m, dtype=torch.float32, device=q.device)
    lt = torch.empty_like(mt)
    tiles = max(1, -(-(total_kv // max(nb, 1)) // bn))
    s_splits = cfg.get("s_splits") or _splits(nb * hkv, tiles, q.device, 4)
    scores, pv = _kernels(interpreting())
    prec = "ieee" if q.dtype == torch.float32 else None
    dummy = mask if mask is not None else lse
    scores[(nb, hkv, s_splits)](
        q, k_buf, qo_indptr, kv_indptr, kv_indices, q_pos, kv_pos, dummy,
        mask_indptr if mask_indptr is not None else qo_indptr, p, mt, lt,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), s_splits, g,
        float(scale) * k_scale, float(softcap or 1.0), int(window or 1),
        GROUP=group, BLOCK_M=block_m, BN=bn, D=d, HAS_MASK=mask is not None,
        HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None, PRECISION=prec,
        CDT=cdt, DK=min(cfg["DK"], d), num_warps=cfg["s_warps"], num_stages=cfg["s_stages"])
    nds = d // dsw
    splits = cfg.get("pv_splits") or _splits(nb * hkv * nds, tiles, q.device, 2)
    split = splits > 1 or sinks is not None  # the sinks join in the split merge
    po = plse = lse
    if split:
        po = torch.empty(total_q, hq, splits, d, dtype=torch.float32, device=q.device)
        plse = torch.empty(total_q, hq, splits, dtype=torch.float32, device=q.device)
    pv[(nb * hkv * nds, splits)](
        v_buf, qo_indptr, kv_indptr, kv_indices, p, mt, lt, o, lse, po, plse,
        v_buf.stride(0), v_buf.stride(1), o.stride(0), o.stride(1), hq, hkv, splits, g,
        1.0 if split else float(v_scale),
        GROUP=group, BLOCK_M=block_m, BN=bn, D=d, DS=dsw, TT=16, SPLIT=split, CDT=cdt,
        num_warps=cfg["pv_warps"], num_stages=cfg["pv_stages"])
    if split:
        combine_splits(po, plse, sinks.float().contiguous() if sinks is not None else None, o,
                       lse)
        if v_scale != 1.0:
            o.mul_(v_scale)
    return o, lse
