"""Why Gemma 4's full-layer verify tile is slow: the same kernel on three slot orders, and a
transposed ("swap AB") dense tile, at the verify goal's geometry (H200).

    python3 bench/probe_verify.py OUT [--ncu]

The case is one Gemma 4 full layer at verify: bs 64, ctx 8192 + 8 chain tokens, 4 KV heads ×
512, group 8 (64 tile rows per KV head), page size 1. Each kernel runs on three slot orders of
the same K/V bytes:

* ``random``: a random permutation of the pool's rows (what the benchmarks use);
* ``sequential``: each request's keys in consecutive rows (streaming reads);
* ``l2``: every key list reads the same 4096 rows (resident in L2: the compute-bound time).

Kernels: ``extend`` (ours, `extend_attention`, causal chain, its default tile) and the dense run
of it written two ways in this file, over the prefix keys only (every row sees every key):
``dense`` (scores as q·kᵀ, [64 rows, N keys]) and ``dense_t`` (scores as k·qᵀ, [N keys, 64
rows]; o accumulated as vᵀ·p, [512, 64]), so a warpgroup's wgmma M runs over keys or D instead of
splitting the 64 rows. Each is checked against `extend` on the prefix keys. ``--ncu`` is used by
the ncu pass (one launch of the random case). Writes OUT/probe-verify.json and the TTGIR
summary of each compiled variant.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import triton  # a GPU probe: its kernels are module-level (a jit helper must be a global)
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))

BS, CTX, NQ, HQ, HKV, D = 64, 8192, 8, 32, 4, 512


@triton.jit
def prologue(q_ptr, kv_indptr, stride_qt, stride_qh, NQ: tl.constexpr, GROUP: tl.constexpr,
             BLOCK_M: tl.constexpr, D: tl.constexpr):
    """(KV head, first key, keys, tile heads, tile q rows, q [BLOCK_M, D]) of a program."""
    b = tl.program_id(0)
    kh = tl.program_id(1)
    kv0 = tl.load(kv_indptr + b)
    n = tl.load(kv_indptr + b + 1) - kv0
    r = tl.arange(0, BLOCK_M)
    heads = kh * GROUP + r % GROUP
    qrow = (b * NQ + r // GROUP).to(tl.int64)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + qrow[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :])
    return kh, kv0, n, heads, qrow, q

@triton.jit
def tile(ptr, kv_indices, kv0, n, start, kh, stride_kr, stride_kh, BLOCK_N: tl.constexpr,
         D: tl.constexpr):
    """Keys (or values) start..start+BLOCK_N of the list, [BLOCK_N, D], and which exist."""
    offs = start + tl.arange(0, BLOCK_N)
    inr = offs < n
    rows = tl.load(kv_indices + kv0 + offs, mask=inr, other=0).to(tl.int64)
    x = tl.load(ptr + rows[:, None] * stride_kr + kh * stride_kh + tl.arange(0, D)[None, :],
                mask=inr[:, None], other=0.0)
    return x, inr

@triton.jit
def dense(q_ptr, k_ptr, v_ptr, kv_indptr, kv_indices, o_ptr, stride_qt, stride_qh,
          stride_kr, stride_kh, stride_ot, stride_oh, scale,
          NQ: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr, D: tl.constexpr):
    kh, kv0, n, heads, qrow, q = prologue(q_ptr, kv_indptr, stride_qt, stride_qh, NQ, GROUP,
                                          BLOCK_M, D)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    den = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    qk = scale * 1.4426950408889634
    for start in range(0, n, BLOCK_N):
        k, inr = tile(k_ptr, kv_indices, kv0, n, start, kh, stride_kr, stride_kh, BLOCK_N, D)
        s = tl.dot(q, tl.trans(k)) * qk
        s = tl.where(inr[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        den = den * alpha + tl.sum(p, axis=1)
        v, _ = tile(v_ptr, kv_indices, kv0, n, start, kh, stride_kr, stride_kh, BLOCK_N, D)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    o = acc / den[:, None]
    d = tl.arange(0, D)
    tl.store(o_ptr + qrow[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             o.to(o_ptr.dtype.element_ty))

@triton.jit
def dense_t(q_ptr, k_ptr, v_ptr, kv_indptr, kv_indices, o_ptr, stride_qt, stride_qh,
            stride_kr, stride_kh, stride_ot, stride_oh, scale,
            NQ: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, D: tl.constexpr):
    kh, kv0, n, heads, qrow, q = prologue(q_ptr, kv_indptr, stride_qt, stride_qh, NQ, GROUP,
                                          BLOCK_M, D)
    qt = tl.trans(q)                                    # [D, M]
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    den = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((D, BLOCK_M), tl.float32)            # oᵀ
    qk = scale * 1.4426950408889634
    for start in range(0, n, BLOCK_N):
        k, inr = tile(k_ptr, kv_indices, kv0, n, start, kh, stride_kr, stride_kh, BLOCK_N, D)
        s = tl.dot(k, qt) * qk                          # [N, M]
        s = tl.where(inr[:, None], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[None, :])
        den = den * alpha + tl.sum(p, axis=0)
        v, _ = tile(v_ptr, kv_indices, kv0, n, start, kh, stride_kr, stride_kh, BLOCK_N, D)
        acc = acc * alpha[None, :] + tl.dot(tl.trans(v), p.to(v.dtype))   # [D, N]·[N, M]
        m = m_new
    o = acc / den[None, :]                              # [D, M]
    d = tl.arange(0, D)
    tl.store(o_ptr + qrow[None, :] * stride_ot + heads[None, :] * stride_oh + d[:, None],
             o.to(o_ptr.dtype.element_ty))

KERNELS = {"dense": dense, "dense_t": dense_t}


def run_dense(name, t, cfg):
    """One of this file's dense kernels over every request's prefix keys (no draft keys)."""
    block_n, warps, stages = cfg
    q, k, v = t["q"], t["k"], t["v"]
    o = torch.empty_like(q)
    KERNELS[name][(BS, HKV)](
        q, k, v, t["pre_indptr"], t["pre_indices"], o, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), o.stride(0), o.stride(1), 1.0, NQ=NQ, GROUP=HQ // HKV, BLOCK_M=NQ * HQ // HKV,
        BLOCK_N=block_n, D=D, num_warps=warps, num_stages=stages)
    return o


def slot_orders(t):
    """The case's slots (random), each request's keys in consecutive rows, and 4096 L2 rows."""
    n = t["kv_indices"].numel()
    seq = torch.arange(1, n + 1, device="cuda", dtype=torch.int32)
    l2 = (torch.arange(n, device="cuda", dtype=torch.int32) % 4096) + 1
    return {"random": t["kv_indices"], "sequential": seq, "l2": l2}


def ttgir_summary(jit_fn) -> list:
    out = []
    for caches in jit_fn.device_caches.values():
        for key, ck in caches[0].items():
            ir = ck.asm.get("ttgir", "")
            ptx = ck.asm.get("ptx", "")
            out.append(dict(key=str(key)[:200], regs=getattr(ck, "n_regs", None),
                            spills=getattr(ck, "n_spills", None),
                            shared=ck.metadata.shared, warps=ck.metadata.num_warps,
                            stages=ck.metadata.num_stages,
                            async_copy=ir.count("async_copy_global_to_local"),
                            wgmma=ir.count("warp_group_dot"), wait=ir.count("warp_group_dot_wait"),
                            local_alloc=ir.count("local_alloc"),
                            convert_layout=ir.count("convert_layout"),
                            ptx_wgmma="wgmma.mma_async" in ptx, ptx_mma_sync="mma.sync" in ptx,
                            ptx_cp_async=ptx.count("cp.async.cg") + ptx.count("cp.async.ca")))
    return out


def main() -> int:
    from triton.testing import do_bench

    from bench_triton_vs_flashinfer import build, copy_bandwidth
    from swafactory.kernels.triton.extend import _kernel, extend_attention

    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    ncu = "--ncu" in sys.argv
    t = build(HQ, HKV, D, None, CTX, BS, NQ, True)
    n_keys = CTX + NQ
    # the prefix keys of each request (the dense run): the first CTX of its n_keys
    idx = t["kv_indices"].view(BS, n_keys)
    t["pre_indptr"] = torch.arange(BS + 1, device="cuda", dtype=torch.int32) * CTX
    ext = dict(qo_indptr=t["qo_indptr"], kv_indptr=t["kv_indptr"], q_pos=t["q_pos"],
               kv_pos=t["kv_pos"], scale=1.0, max_q_len=NQ)
    if ncu:  # one launch of each, the random case, for `ncu -k regex:...`
        extend_attention(t["q"], t["k"], t["v"], kv_indices=t["kv_indices"], **ext)
        t["pre_indices"] = idx[:, :CTX].reshape(-1).contiguous()
        run_dense("dense", t, (32, 8, 2))
        run_dense("dense_t", t, (64, 8, 1))
        torch.cuda.synchronize()
        return 0
    bw = copy_bandwidth(do_bench)
    kv_bytes = BS * n_keys * HKV * D * 2 * 2
    pre_bytes = BS * CTX * HKV * D * 2 * 2  # the prefix keys the dense tiles read
    rows = []
    configs = {"dense": [(32, 8, 2), (32, 8, 3), (64, 8, 1), (16, 8, 3), (16, 8, 4), (16, 8, 5),
                         (16, 4, 4)],
               "dense_t": [(64, 8, 1), (64, 8, 2), (32, 8, 2), (32, 8, 3), (128, 8, 1)]}

    def timed_row(r, fn, nbytes, ref):
        """Row ``r`` with fn's median time, its share of copy bandwidth over ``nbytes`` and its
        error against ``ref``, or the error that stopped it (a config that does not build)."""
        try:
            o = fn()
            torch.cuda.synchronize()
            err = float((o.float() - ref.float()).abs().max() / ref.float().abs().max())
            ms = do_bench(fn, warmup=10, rep=50, return_mode="median")
            r.update(ms=ms, rel_err=err, of_copy=nbytes / (ms * 1e-3) / bw)
        except Exception as exc:  # noqa: BLE001 - a config that does not build is a row
            r["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(r)
        print(json.dumps(r), flush=True)

    # our tile's own configs on the benchmark's (random) slots, checked against its default:
    # deeper pipelines of narrower key tiles keep more K/V bytes in flight per multiprocessor
    # (one 64 x 512 program fills one)
    ext_ref, _ = extend_attention(t["q"], t["k"], t["v"], kv_indices=t["kv_indices"], **ext)
    for cfg in [(64, 32, 8, 2, 1), (64, 16, 8, 3, 1), (64, 16, 8, 4, 1), (64, 16, 8, 5, 1),
                (64, 16, 8, 4, 0), (64, 32, 8, 2, 0)]:
        timed_row(dict(kernel="extend", order="random", cfg=list(cfg)),
                  lambda cfg=cfg: extend_attention(t["q"], t["k"], t["v"],
                                                   kv_indices=t["kv_indices"], config=cfg,
                                                   **ext)[0], kv_bytes, ext_ref)
    for order, slots in slot_orders(t).items():
        extend_attention(t["q"], t["k"], t["v"], kv_indices=slots, **ext)  # warm-up
        ms = do_bench(lambda: extend_attention(t["q"], t["k"], t["v"], kv_indices=slots, **ext),
                      warmup=10, rep=50, return_mode="median")
        rows.append(dict(kernel="extend", order=order, cfg="default", ms=ms,
                         tbs=kv_bytes / ms / 1e9, of_copy=kv_bytes / (ms * 1e-3) / bw))
        print(json.dumps(rows[-1]), flush=True)
        sl = slots.view(BS, n_keys)
        t["pre_indices"] = sl[:, :CTX].reshape(-1).contiguous()
        pre_kv = torch.arange(BS + 1, device="cuda", dtype=torch.int32) * CTX
        ref, _ = extend_attention(t["q"], t["k"], t["v"], t["qo_indptr"], pre_kv,
                                  t["pre_indices"], t["q_pos"],
                                  torch.zeros(BS * CTX, device="cuda", dtype=torch.int32),
                                  scale=1.0, max_q_len=NQ)
        for name, cfgs in configs.items():
            for cfg in cfgs:
                timed_row(dict(kernel=name, order=order, cfg=list(cfg)),
                          lambda name=name, cfg=cfg: run_dense(name, t, cfg), pre_bytes, ref)
    report = dict(copy_tbs=bw / 1e12, rows=rows,
                  ttgir={"extend": ttgir_summary(_kernel(False)[1]),
                         **{k: ttgir_summary(f) for k, f in KERNELS.items()}})
    (out / "probe-verify.json").write_text(json.dumps(report, indent=1))
    for k, v in report["ttgir"].items():
        for x in v:
            print(k, json.dumps(x))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
