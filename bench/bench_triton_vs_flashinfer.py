"""Our Triton decode / verify kernels against FlashInfer on the same data, in one run.

Each case builds one paged pool (page size 1, a random slot permutation, slot 0 unused). Both
kernels read the same K/V rows and indices. SWA cases hand both kernels the index list trimmed
to the window, as the planner does. The ``_untrimmed`` row gives ours all indices instead.
Times are ``triton.testing.do_bench`` medians after warm-up, for the whole Python call on each
side. Bandwidth counts only the K/V bytes a case needs (SWA layers read only their window),
against a device-to-device copy measured in the same run.

Usage (GPU host): python bench/bench_triton_vs_flashinfer.py --out $OUT
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
    ("gemma4_full_verify8", 32, 4, 512, None, 8192, 64, 8, False, True),
    ("gemma4_swa_verify8", 32, 16, 256, 1024, 8192, 64, 8, False, True),
]


def copy_bandwidth(do_bench) -> float:
    """Device-to-device copy, bytes read + written per second (the decode ceiling)."""
    src = torch.randn(256 * 2**20, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * src.numel() * 4 / (ms * 1e-3)


def build(hq, hkv, d, window, ctx, bs, q_len, trim, seed=0):
    """Pool, indices and positions: each request has ctx prefix keys + q_len new keys."""
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
    q_pos = qp.to("cuda").repeat(bs)
    q = torch.randn(bs * q_len, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    qo_indptr = torch.arange(bs + 1, device="cuda", dtype=torch.int32) * q_len
    kp, qq = kv_pos[:n_keys], q_pos[:q_len]
    block = (kp[None, :] <= qq[:, None])                              # causal chain structure
    mask = block.reshape(-1).repeat(bs)
    mask_indptr = torch.arange(bs + 1, device="cuda", dtype=torch.int32) * block.numel()
    need = min(ctx, window) if window else ctx
    need += q_len if q_len > 1 else 0
    kv_bytes = bs * need * hkv * d * 2 * 2
    return dict(q=q, k=k, v=v, qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=slots[:bs * n_keys],
                q_pos=q_pos, kv_pos=kv_pos, mask=mask, mask_indptr=mask_indptr, kv_bytes=kv_bytes)


def flashinfer_call(t, hq, hkv, d, window, q_len, scale, ws):
    import flashinfer

    bs = t["kv_indptr"].numel() - 1
    last = torch.ones(bs, dtype=torch.int32, device="cuda")
    kv4, vv4 = t["k"].unsqueeze(1), t["v"].unsqueeze(1)          # NHD, page_size 1
    wl = -1 if window is None else window - 1
    if q_len == 1:
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
        w.plan(t["kv_indptr"], t["kv_indices"], last, hq, hkv, d, 1, window_left=wl,
               q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=scale)
    else:
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(t["qo_indptr"], t["kv_indptr"], t["kv_indices"], last, hq, hkv, d, 1,
               custom_mask=t["mask"], window_left=wl, q_data_type=torch.bfloat16,
               kv_data_type=torch.bfloat16, sm_scale=scale)
    return lambda: w.run(t["q"], (kv4, vv4))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    from triton.testing import do_bench

    from swafactory.kernels.triton.decode import decode_attention
    from swafactory.kernels.triton.extend import extend_attention

    bw = copy_bandwidth(do_bench)
    ws = torch.zeros(512 * 2**20, dtype=torch.uint8, device="cuda")
    rows = []
    for name, hq, hkv, d, window, ctx, bs, q_len, sinks, trim in CASES:
        if args.only and args.only not in name:
            continue
        t0 = time.time()
        t = build(hq, hkv, d, window, ctx, bs, q_len, trim)
        scale = d ** -0.5
        sk = torch.randn(hq, device="cuda") if sinks else None
        common = (t["q"], t["k"], t["v"], t["qo_indptr"], t["kv_indptr"], t["kv_indices"],
                  t["q_pos"], t["kv_pos"])
        if q_len == 1:
            ours = lambda: decode_attention(*common, window=window, scale=scale, sinks=sk)  # noqa: E731
            ours_nosink = lambda: decode_attention(*common, window=window, scale=scale)  # noqa: E731
            variants = {"ours": ours}
        else:
            ours_nosink = lambda: extend_attention(*common, window=window, scale=scale,  # noqa: E731
                                                   mask=t["mask"], mask_indptr=t["mask_indptr"],
                                                   max_q_len=q_len)
            variants = {"ours": ours_nosink,  # the tree-capable path, same mask as FlashInfer
                        "ours_causal": lambda: extend_attention(*common, window=window, scale=scale,
                                                                max_q_len=q_len)}
        fi = flashinfer_call(t, hq, hkv, d, window, q_len, scale, ws)
        ref = fi()
        mine = ours_nosink()[0]
        torch.cuda.synchronize()
        err = ((mine.float() - ref.float()).norm() / ref.float().norm()).item()
        ms_fi = do_bench(fi, warmup=50, rep=300, return_mode="median")
        row = dict(case=name, hq=hq, hkv=hkv, d=d, window=window, ctx=ctx, bs=bs, q_len=q_len,
                   sinks_in_ours=bool(sinks and q_len == 1), trimmed=trim,
                   kv_bytes=t["kv_bytes"], flashinfer_ms=ms_fi, rel_err_vs_flashinfer=err,
                   flashinfer_tb_s=t["kv_bytes"] / (ms_fi * 1e-3) / 1e12)
        for key, fn in variants.items():
            ms = do_bench(fn, warmup=50, rep=300, return_mode="median")
            row[f"{key}_ms"] = ms
            row[f"{key}_tb_s"] = t["kv_bytes"] / (ms * 1e-3) / 1e12
            row[f"{key}_vs_copy"] = t["kv_bytes"] / (ms * 1e-3) / bw
            row[f"{key}_over_flashinfer"] = ms / ms_fi
        sweep = {}
        for n in (1, 2, 4, 8, 16):  # how the split count moves our time (the default is planned)
            if q_len == 1:
                fn = lambda n=n: decode_attention(*common, window=window, scale=scale,  # noqa: E731
                                                  sinks=sk, num_splits=n)
            else:
                fn = lambda n=n: extend_attention(*common, window=window, scale=scale,  # noqa: E731
                                                  mask=t["mask"], mask_indptr=t["mask_indptr"],
                                                  max_q_len=q_len, num_splits=n)
            sweep[n] = do_bench(fn, warmup=20, rep=100, return_mode="median")
        row["ours_ms_by_splits"] = sweep
        row["wall_s"] = time.time() - t0
        rows.append(row)
        print(json.dumps(row), flush=True)
        del t, common, variants, fi, ref, mine
        torch.cuda.empty_cache()
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), gpu=torch.cuda.get_device_name(),
                torch=torch.__version__, triton=__import__("triton").__version__,
                flashinfer=__import__("flashinfer").__version__, python=platform.python_version(),
                copy_tb_s=bw / 1e12, commit=os.environ.get("BENCH_COMMIT", "unknown"))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_triton_vs_flashinfer.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [f"copy bandwidth {bw / 1e12:.2f} TB/s; {meta['gpu']}; torch {meta['torch']}, "
             f"triton {meta['triton']}, flashinfer {meta['flashinfer']}", "",
             "| case | FlashInfer ms | ours ms | ours/FI | ours TB/s (% copy) | FI TB/s | rel err | "
             "ours ms by splits 1/2/4/8/16 |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for key in ("ours", "ours_causal"):
            if f"{key}_ms" in r:
                lines.append(f"| {r['case']}{'' if key == 'ours' else ' (causal, no mask)'} | "
                             f"{r['flashinfer_ms']:.3f} | {r[key + '_ms']:.3f} | "
                             f"{r[key + '_over_flashinfer']:.2f}x | {r[key + '_tb_s']:.2f} "
                             f"({100 * r[key + '_vs_copy']:.0f}%) | {r['flashinfer_tb_s']:.2f} | "
                             f"{r['rel_err_vs_flashinfer']:.1e} | "
                             + ("/".join(f"{v:.3f}" for v in r["ours_ms_by_splits"].values())
                                if key == "ours" else "") + " |")
    table = "\n".join(lines)
    with open(os.path.join(args.out, "bench_triton_vs_flashinfer.md"), "w") as f:
        f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
