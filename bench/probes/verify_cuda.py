"""Which variant of our CUDA head_dim-512 verify tile is fastest, against the Triton tile?

Gemma 4 full-layer geometry (Hq 32, Hkv 4, D 512), bs 64, ctx 8192, an 8-token chain (and the
8-node tree), page size 1 with random slots. Prints and writes JSON: the dense-run kernel alone
per (BN, stages, splits), the whole verify through ``extend_attention`` with and without it, the
Triton tile, FlashInfer's decode of one token per request (``--flashinfer``), and the floor
(the K/V bytes over a device copy measured in the same run). Checks against an fp32 reference.

    python3 bench/probes/verify_cuda.py --out DIR [--flashinfer]
"""
from __future__ import annotations

import argparse
import json
import math
import os

import torch

from triton_vs_flashinfer import build, copy_bandwidth, flashinfer_call, rel_err


def reference(t, scale, reqs):
    """fp32 attention of each listed request's queries over its dense run (lo, hi)."""
    from swafactory.kernels.triton.extend import dense_runs
    rng = dense_runs(t["qo_indptr"], t["kv_indptr"], t["q_pos"], t["kv_pos"], None, None, None, 8)
    out = []
    for b in reqs:
        q0, q1 = t["qo_indptr"][b].item(), t["qo_indptr"][b + 1].item()
        kv0 = t["kv_indptr"][b].item()
        lo, hi = rng[b].tolist()
        rows = t["kv_indices"][kv0 + lo:kv0 + hi].long()
        q = t["q"][q0:q1].float()                                   # [nq, 32, D]
        k = t["k"][rows].float().repeat_interleave(8, dim=1)         # [n, 32, D]
        v = t["v"][rows].float().repeat_interleave(8, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, k) * scale
        lse = torch.logsumexp(s, dim=-1)                            # [32, nq]
        o = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)
        out.append((b, q0, q1, o, lse.T))
    return rng, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--flashinfer", action="store_true")
    ap.add_argument("--configs", default="32x2,16x3,16x4",
                    help="BNxSTAGES[xSPLITKVxLAZYxPAIRBAR], comma-separated")
    ap.add_argument("--splits", default="1,2")
    ap.add_argument("--only-dense", action="store_true")
    args = ap.parse_args()
    from triton.testing import do_bench

    from swafactory.kernels.cuda.verify import dense_verify_d512, verify_d512_kernel
    from swafactory.kernels.triton.extend import extend_attention

    bench = lambda f: do_bench(f, warmup=25, rep=200, return_mode="median")  # noqa: E731
    copy = copy_bandwidth(do_bench)
    scale = 1 / math.sqrt(512)
    res = dict(copy_tbs=copy / 1e12, bs=args.bs, ctx=args.ctx, rows=[])
    t = build(32, 4, 512, None, args.ctx, args.bs, 8, False)
    floor_ms = t["kv_bytes"] / copy * 1e3
    res["floor_ms"] = floor_ms
    print(f"copy {copy / 1e12:.2f} TB/s; verify K/V {t['kv_bytes'] / 1e9:.2f} GB; floor {floor_ms:.3f} ms")
    rng, refs = reference(t, scale, [0, 1, args.bs - 1])
    T = t["q"].shape[0]
    common = (t["q"], t["k"], t["v"], t["qo_indptr"], t["kv_indptr"], t["kv_indices"])
    for cfg in args.configs.split(","):
        cf = tuple(int(x) for x in cfg.split("x"))
        bn, ns = cf[:2]
        for splits in (int(x) for x in args.splits.split(",")):
            po = torch.zeros(T, 32, 1 + splits, 512, device="cuda")
            plse = torch.full((T, 32, 1 + splits), float("nan"), device="cuda")
            run = lambda: dense_verify_d512(*common, rng, po, plse, part_base=1, splits=splits,  # noqa: E731
                                            scale=scale, config=cf)
            try:
                run()
                torch.cuda.synchronize()
            except Exception as ex:  # noqa: BLE001 (a probe reports and goes on)
                print(f"  {cfg} s{splits}: {ex!r}")
                res["rows"].append(dict(kind="dense", config=cfg, splits=splits, error=repr(ex)))
                continue
            errs = []
            for b, q0, q1, o_ref, lse_ref in refs:
                pl = plse[q0:q1, :, 1:]
                m = pl.max(-1, keepdim=True).values
                w = torch.exp(pl - m)
                o = (po[q0:q1, :, 1:] * w[..., None]).sum(2) / w.sum(-1)[..., None]
                lse = m[..., 0] + torch.log(w.sum(-1))
                errs.append(max(rel_err(o, o_ref), (lse - lse_ref).abs().max().item()))
            ms = bench(run)
            row = dict(kind="dense", config=cfg, splits=splits, ms=ms,
                       of_floor=floor_ms / ms, err=max(errs),
                       regs=verify_d512_kernel(*cf).registers(t["q"].device))
            res["rows"].append(row)
            print(f"  dense {cfg} splits {splits}: {ms:.3f} ms ({floor_ms / ms:.0%} of copy) "
                  f"err {max(errs):.1e} regs {row['regs']}")
    for tree in (() if args.only_dense else (False, True)):
        tt = build(32, 4, 512, None, args.ctx, args.bs, 8, False, tree=tree)
        kw = dict(mask=tt["mask"], mask_indptr=tt["mask_indptr"], scale=scale, max_q_len=8)
        c2 = (tt["q"], tt["k"], tt["v"], tt["qo_indptr"], tt["kv_indptr"], tt["kv_indices"],
              tt["q_pos"], tt["kv_pos"])
        o_t, l_t = extend_attention(*c2, cuda=False, **kw)
        o_c, l_c = extend_attention(*c2, cuda=True, **kw)
        err = max(rel_err(o_c, o_t), (l_c - l_t).abs().max().item())
        ms_t = bench(lambda: extend_attention(*c2, cuda=False, **kw))
        ms_c = bench(lambda: extend_attention(*c2, cuda=True, **kw))
        name = "tree8" if tree else "chain8"
        res["rows"].append(dict(kind="verify", case=name, triton_ms=ms_t, cuda_ms=ms_c, err=err))
        print(f"  verify {name}: triton tile {ms_t:.3f} ms, with the CUDA tile {ms_c:.3f} ms "
              f"(err vs triton {err:.1e})")
    if args.flashinfer and not args.only_dense:
        td = build(32, 4, 512, None, args.ctx, args.bs, 1, False)
        ws = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
        ms = bench(flashinfer_call(td, 32, 4, 512, None, 1, scale, ws))
        res["rows"].append(dict(kind="flashinfer_decode", ms=ms))
        print(f"  flashinfer decode (1 token): {ms:.3f} ms")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "probe-verify-cuda.json"), "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
