"""Where an fp8 decode tile loses its halved bytes (H200 probe, for the fp8 ≥ 1.5× goal).

`probe_fp8.py` showed our Triton decode reading e4m3 K/V *slower* than bf16 (Triton 3.6 turns
each e4m3 tile into 16-bit values between shared memory and the tensor cores). This probe times
one decode tile (stage 1 of split-KV decode, no window, no sinks: the combine is the same for
every variant) at the goal's geometries, on shuffled pool rows as the allocator leaves them,
with the K/V tile turned into tensor-core operands five ways:

* ``bf16``: bf16 buffers, ``dot(q, kᵀ)`` (today's path, the reference time);
* ``fp8→bf16``: e4m3 buffers, ``load().to(bf16)`` (today's fp8 path);
* ``fp8→fp16``: e4m3 buffers, ``.to(fp16)`` (one SM90 ``cvt`` per two values), q in fp16;
* ``fp8 bits``: e4m3 bytes → fp16 by integer ops (``prmt``/shift/mask: an e4m3 value is the
  fp16 whose exponent and mantissa bits are its own shifted by 7, times 2⁸; the 2⁸ joins the
  scales), q in fp16;
* ``fp8 bits, Kᵀ``: the same, with the keys as the MMA's first operand (``dot(k, qᵀ)``, the
  output held transposed), so the converted tile feeds the MMA from registers.

    python3 bench/probe_fp8_tile.py OUT

Prints a table (ms, TB/s of the bytes each variant reads, fp8 / bf16 time); writes
OUT/probe-fp8-tile.json. Every variant's output is checked against the dequantized fp32 result.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

CASES = (  # name, bs, KV heads, group, head_dim, keys per request, splits, BLOCK_N, warps
    ("gemma4_swa", 64, 16, 2, 256, 1024, 1, 64, 8),
    ("gemma4_full", 64, 4, 8, 512, 8192, 2, 32, 8),
    ("gemma4_full_n64", 64, 4, 8, 512, 8192, 2, 64, 8),
    ("gptoss_full", 64, 8, 8, 64, 8192, 2, 64, 4),
)
VARIANTS = ("bf16", "fp8→bf16", "fp8→fp16", "fp8 bits", "fp8 bits, Kᵀ")


def kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def e4m3_bits_to_f16(x):
        """4 e4m3 bytes → 4 fp16 values, each the e4m3 value × 2⁻⁸ (exact)."""
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 y, t, z;
            mov.b32 z, 0;
            prmt.b32 y, z, $2, 0x5040;
            shr.b32 t, y, 1;
            and.b32 t, t, 0x3F803F80;
            and.b32 y, y, 0x80008000;
            or.b32 $0, y, t;
            prmt.b32 y, z, $2, 0x7060;
            shr.b32 t, y, 1;
            and.b32 t, t, 0x3F803F80;
            and.b32 y, y, 0x80008000;
            or.b32 $1, y, t;
            }""",
            constraints="=r,=r,r", args=[x], dtype=tl.float16, is_pure=True, pack=4)

    @triton.jit
    def tile(q_ptr, k_ptr, v_ptr, kv_indptr, kv_indices, po_ptr, plse_ptr, Hq, n_splits,
             scale, out_scale, stride_kr, stride_kh,
             GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
             D: tl.constexpr, MODE: tl.constexpr, KT: tl.constexpr, CDT: tl.constexpr):
        b = tl.program_id(0)
        kh = tl.program_id(1)
        sp = tl.program_id(2)
        kv0 = tl.load(kv_indptr + b)
        n = tl.load(kv_indptr + b + 1) - kv0
        chunk = tl.cdiv(tl.cdiv(n, n_splits), BLOCK_N) * BLOCK_N
        lo = sp * chunk
        hi = tl.minimum(lo + chunk, n)
        r = tl.arange(0, BLOCK_H)
        heads = kh * GROUP + r
        hmask = r < GROUP
        d = tl.arange(0, D)
        q = tl.load(q_ptr + b * Hq * D + heads[:, None] * D + d[None, :], mask=hmask[:, None],
                    other=0.0).to(CDT)
        m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        den = tl.zeros((BLOCK_H,), tl.float32)
        if KT:
            acc = tl.zeros((D, BLOCK_H), tl.float32)
        else:
            acc = tl.zeros((BLOCK_H, D), tl.float32)
        for start in range(lo, hi, BLOCK_N):
            offs = start + tl.arange(0, BLOCK_N)
            inr = offs < hi
            rows = tl.load(kv_indices + kv0 + offs, mask=inr, other=0).to(tl.int64)
            kp = k_ptr + rows[:, None] * stride_kr + kh * stride_kh + d[None, :]
            vp = v_ptr + rows[:, None] * stride_kr + kh * stride_kh + d[None, :]
            if MODE == 2:  # e4m3 bytes, integer conversion
                k = e4m3_bits_to_f16(tl.load(kp, mask=inr[:, None], other=0))
            else:
                k = tl.load(kp, mask=inr[:, None], other=0.0).to(CDT)
            if KT:
                s = tl.dot(k, tl.trans(q)) * scale  # [BLOCK_N, BLOCK_H]
                s = tl.where(inr[:, None], s, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, axis=0))
                alpha = tl.exp(m - m_new)
                p = tl.exp(s - m_new[None, :])
                den = den * alpha + tl.sum(p, axis=0)
            else:
                s = tl.dot(q, tl.trans(k)) * scale  # [BLOCK_H, BLOCK_N]
                s = tl.where(inr[None, :], s, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, axis=1))
                alpha = tl.exp(m - m_new)
                p = tl.exp(s - m_new[:, None])
                den = den * alpha + tl.sum(p, axis=1)
            if MODE == 2:
                v = e4m3_bits_to_f16(tl.load(vp, mask=inr[:, None], other=0))
            else:
                v = tl.load(vp, mask=inr[:, None], other=0.0).to(CDT)
            if KT:
                acc = acc * alpha[None, :] + tl.dot(tl.trans(v), p.to(CDT))
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(CDT), v)
            m = m_new
        if KT:
            o = tl.trans(acc) / den[:, None] * out_scale
        else:
            o = acc / den[:, None] * out_scale
        part = (b * Hq + heads) * n_splits + sp
        tl.store(po_ptr + part[:, None] * D + d[None, :], o, mask=hmask[:, None])
        tl.store(plse_ptr + part, m + tl.log(den), mask=hmask)

    return tile


def main() -> int:
    from triton.testing import do_bench
    import triton.language as tl

    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    tile = kernel()
    src = torch.empty(2**28, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    bw = 2 * src.numel() * 4 / (ms * 1e-3)
    del src, dst
    rows_out = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, bs, hkv, group, dim, keys, splits, block_n, warps in CASES:
        hq = hkv * group
        n = bs * keys
        k = torch.randn(n + 1, hkv, dim, device="cuda", generator=g).to(torch.bfloat16)
        v = torch.randn(n + 1, hkv, dim, device="cuda", generator=g).to(torch.bfloat16)
        ks, vs = 0.125, 0.0625
        k8 = (k.float() / ks).to(torch.float8_e4m3fn)
        v8 = (v.float() / vs).to(torch.float8_e4m3fn)
        kd, vd = (k8.float() * ks), (v8.float() * vs)  # what the fp8 variants must reproduce
        q = torch.randn(bs, hq, dim, device="cuda", generator=g).to(torch.bfloat16)
        indptr = torch.arange(0, n + 1, keys, device="cuda", dtype=torch.int32)
        indices = (torch.randperm(n, device="cuda", generator=g) + 1).to(torch.int32)
        scale = dim ** -0.5
        po = torch.empty(bs * hq * splits, dim, device="cuda")
        plse = torch.empty(bs * hq * splits, device="cuda")

        def ref(kk, vv, nb=4):
            """fp32 attention of the first ``nb`` requests over ``kk``/``vv``."""
            sel = indices[:nb * keys].long()
            kr = kk[sel].view(nb, keys, hkv, dim).float()
            vr = vv[sel].view(nb, keys, hkv, dim).float()
            qq = q[:nb].float().view(nb, hkv, group, dim)
            s = torch.einsum("bhgd,bnhd->bhgn", qq, kr) * scale
            return torch.einsum("bhgn,bnhd->bhgd", s.softmax(-1), vr).reshape(nb, hq, dim)

        def combine():
            o = po.view(bs, hq, splits, dim)
            lse = plse.view(bs, hq, splits)
            w = torch.softmax(lse, -1)
            return (o * w[..., None]).sum(2)

        row = dict(case=name, bs=bs, hkv=hkv, group=group, head_dim=dim, keys=keys,
                   splits=splits, block_n=block_n)
        ref_bf, ref_8 = ref(k, v), ref(kd, vd)
        for var in VARIANTS:
            fp8 = var != "bf16"
            mode = 2 if "bits" in var else 1
            cdt = tl.bfloat16 if var in ("bf16", "fp8→bf16") else tl.float16
            qq = q if cdt is tl.bfloat16 else q.half()
            kb, vb = (k8, v8) if fp8 else (k, v)
            if mode == 2:
                kb, vb = kb.view(torch.uint8), vb.view(torch.uint8)
            sc = scale * (ks if fp8 else 1.0) * (256.0 if mode == 2 else 1.0)
            osc = (vs if fp8 else 1.0) * (256.0 if mode == 2 else 1.0)

            def launch():
                tile[(bs, hkv, splits)](qq, kb, vb, indptr, indices, po, plse, hq, splits, sc,
                                        osc, kb.stride(0), kb.stride(1), GROUP=group,
                                        BLOCK_H=max(16, group), BLOCK_N=block_n, D=dim,
                                        MODE=mode, KT="Kᵀ" in var, CDT=cdt, num_warps=warps)
            try:
                launch()
                o = combine()
                want = ref_8 if fp8 else ref_bf
                err = float((o[:want.shape[0]] - want).abs().max() / want.abs().max())
                t = do_bench(launch, warmup=20, rep=100, return_mode="median")
                nbytes = 2 * n * hkv * dim * (1 if fp8 else 2)
                row[var] = dict(ms=t, tbs=nbytes / (t * 1e-3) / 1e12, rel_err=err)
            except Exception as e:  # noqa: BLE001 - a probe row records what failed
                row[var] = dict(error=f"{type(e).__name__}: {e}"[:300])
            print(name, var, row[var], flush=True)
        rows_out.append(row)
        del k, v, k8, v8, kd, vd
        torch.cuda.empty_cache()
    lines = [f"copy bandwidth {bw / 1e12:.2f} TB/s (read + write)", "",
             "| case | " + " | ".join(VARIANTS) + " | best fp8 / bf16 |",
             "|---|" + "---|" * (len(VARIANTS) + 1)]
    for r in rows_out:
        cells = []
        for var in VARIANTS:
            x = r[var]
            cells.append(f"{x['ms']:.3f} ms, {x['tbs']:.2f} TB/s" if "ms" in x else "error")
        fp8 = [r[v]["ms"] for v in VARIANTS[1:] if "ms" in r[v]]
        best = (f"{min(fp8) / r['bf16']['ms']:.2f}" if fp8 and "ms" in r["bf16"] else "-")
        lines.append(f"| {r['case']} | " + " | ".join(cells) + f" | {best} |")
    print("\n".join(lines))
    (out / "probe-fp8-tile.json").write_text(json.dumps(dict(copy_tbs=bw / 1e12, rows=rows_out),
                                                        indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
