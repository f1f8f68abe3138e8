"""Are our Triton decode / verify kernels as fast as FlashInfer's on the same data?

Each case builds one paged pool (page size 1, a random slot permutation, slot 0 unused). Both
kernels read the same K/V rows and indices. SWA cases hand both kernels the index list trimmed
to the window, as the planner does. The ``_untrimmed`` row gives ours all indices instead.
Times are ``triton.testing.do_bench`` medians after warm-up, for the whole Python call on each
side. Bandwidth counts only the K/V bytes a case needs (SWA layers read only their window),
against a device-to-device copy measured in the same run.

Verify cases come as a chain (causal by position, written out as FlashInfer's custom mask; ours
runs it with that mask, and without one as ``causal``) and as an 8-node tree (custom mask, nodes
at prefix + depth). FlashInfer's sliding window counts positions by index, which a tree breaks,
so its tree cases get the window folded into the custom mask (``window_left=-1``); ours takes
the window by position as the contract says.

Usage (GPU host): python bench/probes/triton_vs_flashinfer.py --out $OUT
``--no-flashinfer`` checks ours against the fp32 torch reference instead (no FlashInfer JIT);
``--sweep`` also times a grid of extend tile configs on the verify cases, each one checked;
``--wide-sweep`` a grid of the two-kernel wide verify's tiles (``verify_wide``) on D ≥ 512 verify.
At D ≥ 512 a verify case also times "ours_wide", the opt-in two-kernel path, beside "ours"
(the one-kernel tile, the default).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

CASES = [  # name, Hq, Hkv, D, window, ctx, bs, q_len, sinks, trim
    ("gemma4_swa_decode", 32, 16, 256, 1024, 8192, 64, 1, False, True),
    ("gemma4_swa_decode_untrimmed", 32, 16, 256, 1024, 8192, 64, 1, False, False),
    ("gemma4_full_decode", 32, 4, 512, None, 8192, 64, 1, False, True),
    ("gptoss_swa_decode", 64, 8, 64, 128, 8192, 64, 1, True, True),
    ("gptoss_full_decode", 64, 8, 64, None, 8192, 64, 1, True, True),
    ("gptoss_full_decode_bs8", 64, 8, 64, None, 8192, 8, 1, True, True),
    ("gptoss_swa_decode_bs8", 64, 8, 64, 128, 8192, 8, 1, True, True),
    ("gemma4_full_verify8", 32, 4, 512, None, 8192, 64, 8, False, True),
    ("gemma4_swa_verify8", 32, 16, 256, 1024, 8192, 64, 8, False, True),
    ("gemma4_full_verify8_tree", 32, 4, 512, None, 8192, 64, 8, False, True),
    ("gemma4_swa_verify8_tree", 32, 16, 256, 1024, 8192, 64, 8, False, True),
]
TREE_PARENTS = [-1, 0, 0, 1, 1, 2, 3, 5]  # 8 nodes, depths 0 1 1 2 2 2 3 3

# extend tile configs (BLOCK_M, BLOCK_N, num_warps, num_stages, pool rows a tile ahead) timed by
# --sweep on the chain verify cases, per head_dim, with one split
SWEEP = {512: [(64, 32, 8, 2, 1), (64, 32, 8, 2, 0), (64, 32, 16, 2, 1), (32, 32, 8, 3, 1)],
         256: [(16, 32, 4, 3, 1), (16, 32, 4, 3, 0), (16, 32, 2, 3, 1), (16, 32, 4, 2, 1),
               (16, 64, 2, 2, 1), (16, 64, 8, 3, 1)]}
# verify_wide tiles timed by --wide-sweep (BN, scores warps/stages, D slice, P·V warps/stages,
# the D slice the scores accumulate over: 512 holds Q resident, less re-reads it per slice)
WIDE_SWEEP = [dict(BN=bn, s_warps=sw, s_stages=ss, DS=ds, pv_warps=pw, pv_stages=ps, DK=dk)
              for bn, sw, ss, ds, pw, ps, dk in [
                  (32, 4, 3, 256, 8, 3, 512), (32, 4, 3, 128, 4, 3, 512),
                  (64, 4, 2, 256, 8, 2, 512), (32, 8, 3, 256, 8, 3, 512),
                  (64, 4, 3, 128, 4, 3, 128), (64, 4, 4, 128, 4, 2, 64),
                  (32, 4, 4, 128, 4, 3, 128), (128, 8, 3, 128, 4, 3, 128)]]


def kernel_report(jit_fn) -> list:
    """Registers, spills, shared memory and instruction kinds of each compiled variant."""
    out = []
    try:
        for caches in jit_fn.device_caches.values():
            for key, ck in caches[0].items():
                ptx = ck.asm.get("ptx", "")
                out.append(dict(key=str(key), n_regs=ck.n_regs, n_spills=ck.n_spills,
                                shared=ck.metadata.shared, warps=ck.metadata.num_warps,
                                stages=ck.metadata.num_stages, wgmma="wgmma" in ptx,
                                cp_async="cp.async" in ptx, mma_sync="mma.sync" in ptx))
    except Exception as ex:  # noqa: BLE001 (the cache layout is triton-internal)
        out.append(repr(ex))
    return out


def copy_bandwidth(do_bench) -> float:
    """Device-to-device copy, bytes read + written per second (the decode ceiling)."""
    src = torch.randn(256 * 2**20, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * src.numel() * 4 / (ms * 1e-3)


def build(hq, hkv, d, window, ctx, bs, q_len, trim, seed=0, tree=False):
    """Pool, indices and positions: each request has ctx prefix keys + q_len new keys (a chain,
    or with ``tree`` the nodes of TREE_PARENTS at ctx + depth)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    first = max(0, ctx - window) if (trim and window) else 0
    n_keys = ctx - first + (q_len if q_len > 1 else 0)   # decode: the query's key is inside ctx
    rows = bs * n_keys + 1
    k = torch.randn(rows, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(rows, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    slots = (torch.randperm(rows - 1, device="cuda", generator=g) + 1).int()
    kv_indptr = torch.arange(bs + 1, device="cuda", dtype=torch.int32) * n_keys
    top = ctx + (q_len if q_len > 1 else 0)
    kv_pos = torch.arange(top - n_keys, top, device="cuda", dtype=torch.int32).repeat(bs)
    qp = torch.arange(ctx - 1, ctx, dtype=torch.int32) if q_len == 1 else \
        torch.arange(ctx, ctx + q_len, dtype=torch.int32)
    if tree:
        assert q_len == len(TREE_PARENTS)
        dep = []
        for par in TREE_PARENTS:
            dep.append(0 if par < 0 else dep[par] + 1)
        qp = torch.tensor([ctx + x for x in dep], dtype=torch.int32)
        kv_pos = torch.cat([kv_pos[:n_keys - q_len], qp.to("cuda")]).repeat(bs)
    q_pos = qp.to("cuda").repeat(bs)
    q = torch.randn(bs * q_len, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    qo_indptr = torch.arange(bs + 1, device="cuda", dtype=torch.int32) * q_len
    kp, qq = kv_pos[:n_keys], q_pos[:q_len]
    block = (kp[None, :] <= qq[:, None])                              # causal chain structure
    fi_block = block
    if tree:
        anc = torch.eye(q_len, dtype=torch.bool)
        for i, par in enumerate(TREE_PARENTS):
            if par >= 0:
                anc[i] |= anc[par]
        block = torch.ones(q_len, n_keys, dtype=torch.bool, device="cuda")
        block[:, n_keys - q_len:] = anc.to("cuda")
        fi_block = block
        if window:  # FlashInfer's window counts by index: fold ours (by position) into its mask
            fi_block = block & (qq[:, None] - kp[None, :] < window)
    mask = block.reshape(-1).repeat(bs)
    fi_mask = fi_block.reshape(-1).repeat(bs)
    mask_indptr = torch.arange(bs + 1, device="cuda", dtype=torch.int32) * block.numel()
    need = min(ctx, window) if window else ctx
    need += q_len if q_len > 1 else 0
    kv_bytes = bs * need * hkv * d * 2 * 2
    return dict(q=q, k=k, v=v, qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=slots[:bs * n_keys],
                q_pos=q_pos, kv_pos=kv_pos, mask=mask, mask_indptr=mask_indptr, kv_bytes=kv_bytes,
                fi_mask=fi_mask, tree=tree)


def flashinfer_call(t, hq, hkv, d, window, q_len, scale, ws):
    import flashinfer

    bs = t["kv_indptr"].numel() - 1
    last = torch.ones(bs, dtype=torch.int32, device="cuda")
    kv4, vv4 = t["k"].unsqueeze(1), t["v"].unsqueeze(1)          # NHD, page_size 1
    wl = -1 if window is None or t["tree"] else window - 1  # tree: the window is in fi_mask
    if q_len == 1:
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
        w.plan(t["kv_indptr"], t["kv_indices"], last, hq, hkv, d, 1, window_left=wl,
               q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=scale)
    else:
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(t["qo_indptr"], t["kv_indptr"], t["kv_indices"], last, hq, hkv, d, 1,
               custom_mask=t["fi_mask"], window_left=wl, q_data_type=torch.bfloat16,
               kv_data_type=torch.bfloat16, sm_scale=scale)
    return lambda: w.run(t["q"], (kv4, vv4))


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--only", default="", help="comma-separated substrings of case names")
    ap.add_argument("--no-flashinfer", action="store_true",
                    help="check ours against the fp32 torch reference; no FlashInfer (no JIT)")
    ap.add_argument("--sweep", action="store_true", help="time SWEEP's tile configs on verify cases")
    ap.add_argument("--wide-sweep", action="store_true",
                    help="time WIDE_SWEEP's two-kernel tiles on D >= 512 verify cases")
    ap.add_argument("--splits", default="1,2,4,8,16", help="split counts timed per case")
    args = ap.parse_args()
    from triton.testing import do_bench

    from swafactory.kernels.torch_ref import attention_reference
    from swafactory.kernels.triton.decode import decode_attention
    from swafactory.kernels.triton.extend import extend_attention, extend_config

    use_fi = not args.no_flashinfer
    only = [x for x in args.only.split(",") if x]
    split_list = [int(x) for x in args.splits.split(",") if x]
    bw = copy_bandwidth(do_bench)
    ws = torch.zeros(512 * 2**20, dtype=torch.uint8, device="cuda") if use_fi else None
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for name, hq, hkv, d, window, ctx, bs, q_len, sinks, trim in CASES:
        if only and not any(x in name for x in only):
            continue
        t0 = time.time()
        tree = name.endswith("_tree")
        t = build(hq, hkv, d, window, ctx, bs, q_len, trim, tree=tree)
        scale = d ** -0.5
        sk = torch.randn(hq, device="cuda") if sinks else None
        common = (t["q"], t["k"], t["v"], t["qo_indptr"], t["kv_indptr"], t["kv_indices"],
                  t["q_pos"], t["kv_pos"])
        masked = dict(mask=t["mask"], mask_indptr=t["mask_indptr"])
        if q_len == 1:
            ours = lambda: decode_attention(*common, window=window, scale=scale, sinks=sk)  # noqa: E731
            ours_nosink = lambda: decode_attention(*common, window=window, scale=scale)  # noqa: E731
            variants = {"ours": ours}
        else:
            ours_nosink = lambda: extend_attention(*common, window=window, scale=scale,  # noqa: E731
                                                   **masked, max_q_len=q_len)
            variants = {"ours": ours_nosink}  # the tree-capable path, same mask as FlashInfer
            if not tree:
                variants["ours_causal"] = lambda: extend_attention(  # noqa: E731
                    *common, window=window, scale=scale, max_q_len=q_len)
            if d >= 512:  # the opt-in two-kernel path (verify_wide)
                variants["ours_wide"] = lambda: extend_attention(  # noqa: E731
                    *common, window=window, scale=scale, **masked, max_q_len=q_len, wide=True)
        if use_fi:
            fi = flashinfer_call(t, hq, hkv, d, window, q_len, scale, ws)
            ref = fi()
        else:
            ref = attention_reference(*common, **(masked if q_len > 1 else {}), window=window,
                                      scale=scale)[0]
        mine = ours_nosink()[0]
        torch.cuda.synchronize()
        err = rel_err(mine, ref)
        row = dict(case=name, hq=hq, hkv=hkv, d=d, window=window, ctx=ctx, bs=bs, q_len=q_len,
                   sinks_in_ours=bool(sinks and q_len == 1), trimmed=trim, tree=tree,
                   kv_bytes=t["kv_bytes"], reference="flashinfer" if use_fi else "torch_fp32")
        if use_fi:
            ms_fi = do_bench(fi, warmup=50, rep=300, return_mode="median")
            row.update(flashinfer_ms=ms_fi, rel_err_vs_flashinfer=err,
                       flashinfer_tb_s=t["kv_bytes"] / (ms_fi * 1e-3) / 1e12)
        else:
            row.update(rel_err_vs_reference=err)
        if q_len > 1:
            row["ours_config"] = list(extend_config(d, hq // hkv, q_len * hq // hkv))
        for key, fn in variants.items():
            ms = do_bench(fn, warmup=50, rep=300, return_mode="median")
            row[f"{key}_ms"] = ms
            row[f"{key}_tb_s"] = t["kv_bytes"] / (ms * 1e-3) / 1e12
            row[f"{key}_vs_copy"] = t["kv_bytes"] / (ms * 1e-3) / bw
            if use_fi:
                row[f"{key}_over_flashinfer"] = ms / ms_fi
        sweep = {}
        for n in split_list:  # how the split count moves our time (the default is planned)
            if q_len == 1:
                fn = lambda n=n: decode_attention(*common, window=window, scale=scale,  # noqa: E731
                                                  sinks=sk, num_splits=n)
            else:
                fn = lambda n=n: extend_attention(*common, window=window, scale=scale,  # noqa: E731
                                                  **masked, max_q_len=q_len, num_splits=n)
            sweep[n] = do_bench(fn, warmup=20, rep=100, return_mode="median")
        row["ours_ms_by_splits"] = sweep
        if args.wide_sweep and q_len > 1 and d >= 512:
            from swafactory.kernels.triton import verify_wide
            from swafactory.kernels.triton.merge import compute_dtype
            wide = {}
            wm = dict(masked)
            if wm["mask"] is not None:
                wm["mask"] = wm["mask"].contiguous().view(torch.uint8)
            for cfg in WIDE_SWEEP:
                key = "/".join(f"{k}{v}" for k, v in cfg.items())
                fn = lambda cfg=cfg: verify_wide.wide_verify(  # noqa: E731
                    *common, **wm, window=window, scale=scale, softcap=None, sinks=None,
                    group=hq // hkv, block_m=64, cdt=compute_dtype(t["q"].dtype, t["k"].dtype),
                    config=cfg)
                try:
                    e = rel_err(fn()[0], ref)
                    wide[key] = dict(ms=do_bench(fn, warmup=20, rep=100, return_mode="median"),
                                     rel_err=e)
                except Exception as ex:  # noqa: BLE001 (out of shared memory, say)
                    wide[key] = dict(error=repr(ex)[:200])
                print(name, key, wide[key], flush=True)
            row["wide_sweep"] = wide
            row["wide_kernels"] = (kernel_report(verify_wide._kernels(False)[0])
                                   + kernel_report(verify_wide._kernels(False)[1]))
        if args.sweep and q_len > 1 and not tree:
            from swafactory.kernels.triton.extend import _kernel, dense_runs
            grid = {}
            pre = lambda: dense_runs(t["qo_indptr"], t["kv_indptr"], t["q_pos"],  # noqa: E731
                                     t["kv_pos"], t["mask"], t["mask_indptr"], window, q_len)
            rng = pre()
            grid["dense_range pre-pass alone"] = dict(
                ms=do_bench(pre, warmup=20, rep=100, return_mode="median"), rel_err=0.0)
            print(name, "dense_range", grid["dense_range pre-pass alone"], rng[:2].tolist(),
                  flush=True)
            cfgs = [(c, 1, True) for c in SWEEP.get(d, [])]
            for cfg, n, dense in cfgs:
                key = f"{cfg}/s{n}" + ("" if dense else "/nodense")
                fn = lambda cfg=cfg, n=n, dense=dense: extend_attention(  # noqa: E731
                    *common, window=window, scale=scale, **masked, max_q_len=q_len,
                    num_splits=n, config=cfg, dense=dense)
                try:
                    e = rel_err(fn()[0], ref)
                    ms = do_bench(fn, warmup=20, rep=100, return_mode="median")
                    grid[key] = dict(ms=ms, rel_err=e)
                except Exception as ex:  # noqa: BLE001 (out of shared memory, say)
                    grid[key] = dict(error=repr(ex)[:200])
                print(name, key, grid[key], flush=True)
            row["sweep"] = grid
            row["kernels"] = kernel_report(_kernel(False)[1])
            for k in row["kernels"]:
                print(name, {a: b for a, b in k.items() if a != "key"} if isinstance(k, dict) else k,
                      flush=True)
        row["wall_s"] = time.time() - t0
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(os.path.join(args.out, "bench_triton_vs_flashinfer.partial.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
        del t, common, variants, ref, mine
        torch.cuda.empty_cache()
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), gpu=torch.cuda.get_device_name(),
                torch=torch.__version__, triton=__import__("triton").__version__,
                flashinfer=__import__("flashinfer").__version__ if use_fi else None,
                python=platform.python_version(),
                copy_tb_s=bw / 1e12, commit=os.environ.get("BENCH_COMMIT", "unknown"))
    with open(os.path.join(args.out, "bench_triton_vs_flashinfer.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    ref_name = "FlashInfer" if use_fi else "torch fp32 reference (no FlashInfer timing)"
    lines = [f"copy bandwidth {bw / 1e12:.2f} TB/s; {meta['gpu']}; torch {meta['torch']}, "
             f"triton {meta['triton']}, flashinfer {meta['flashinfer']}; rel err vs {ref_name}", "",
             "| case | FlashInfer ms | ours ms | ours/FI | ours TB/s (% copy) | FI TB/s | rel err | "
             "ours ms by splits " + "/".join(map(str, split_list)) + " |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for key in ("ours", "ours_causal", "ours_wide"):
            if f"{key}_ms" not in r:
                continue
            fi_ms = f"{r['flashinfer_ms']:.3f}" if use_fi else "–"
            ratio = f"{r[key + '_over_flashinfer']:.2f}x" if use_fi else "–"
            fi_tb = f"{r['flashinfer_tb_s']:.2f}" if use_fi else "–"
            err = r.get("rel_err_vs_flashinfer", r.get("rel_err_vs_reference"))
            tag = {"ours": "", "ours_causal": " (causal, no mask)", "ours_wide": " (two kernels)"}
            lines.append(f"| {r['case']}{tag[key]} | "
                         f"{fi_ms} | {r[key + '_ms']:.3f} | {ratio} | {r[key + '_tb_s']:.2f} "
                         f"({100 * r[key + '_vs_copy']:.0f}%) | {fi_tb} | {err:.1e} | "
                         + ("/".join(f"{v:.3f}" for v in r["ours_ms_by_splits"].values())
                            if key == "ours" else "") + " |")
    for r in rows:
        for key, v in r.get("wide_sweep", {}).items():
            lines.append(f"- {r['case']} wide {key}: " + (
                f"{v['ms']:.3f} ms, rel err {v['rel_err']:.1e}" if "ms" in v else v["error"]))
        if "sweep" in r:
            lines += ["", f"{r['case']}: extend configs (BLOCK_M, BLOCK_N, warps, stages)/splits, "
                      f"default {tuple(r['ours_config'])}", ""]
            for key, v in r["sweep"].items():
                lines.append(f"- {key}: " + (f"{v['ms']:.3f} ms, rel err {v['rel_err']:.1e}"
                                             if "ms" in v else v["error"]))
    table = "\n".join(lines)
    with open(os.path.join(args.out, "bench_triton_vs_flashinfer.md"), "w") as f:
        f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
