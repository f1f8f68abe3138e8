"""Probe: `decode_rows` (whole pool rows per program, one launch) against the per-head split-KV
Triton decode and FlashInfer's tensor-core decode, on GPT-OSS geometry.

GPT-OSS-20b layers (Hq 64, Hkv 8, D 64, sinks): the full layer over ctx keys and the SWA layer
over its W = 128 window (a trimmed list), bs 8 and 64, page size 1 with shuffled slots. Each
kernel alone, timed as a captured CUDA graph replayed (`do_bench` median), as a step replays it;
TB/s is the K/V bytes read over that time, beside a device copy measured in the same run. Sweeps
(BLOCK_N, warps, stages) × splits for `decode_rows`, with and without the fused K/V write, and
checks every variant against an fp32 reference.

    python3 bench/probe_decode_rows.py --out DIR [--flashinfer] [--tiles 32x8x3,16x4x3]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_triton_vs_flashinfer import build, copy_bandwidth, flashinfer_call, rel_err  # noqa: E402

HQ, HKV, D = 64, 8, 64


def graph_ms(fn, do_bench) -> float:
    """Median replay time of ``fn`` captured once in a CUDA graph (after one eager warm-up)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return do_bench(g.replay, warmup=20, rep=200, return_mode="median")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--bs", default="8,64")
    ap.add_argument("--flashinfer", action="store_true")
    ap.add_argument("--tiles", default="32x8x3,16x8x3,32x4x3,64x8x2,32x8x2,16x4x4")
    ap.add_argument("--splits", default="0,8,16,33,64", help="0: rows_splits' own choice")
    args = ap.parse_args()
    from triton.testing import do_bench

    import swafactory.kernels.triton.decode_rows as dr
    from swafactory.kernels.torch_ref import attention_reference
    from swafactory.kernels.triton.decode import decode_attention

    bw = copy_bandwidth(do_bench)
    ws = torch.zeros(512 * 2**20, dtype=torch.uint8, device="cuda") if args.flashinfer else None
    rows, own = [], dr.rows_config
    scale = D ** -0.5
    sinks = torch.randn(HQ, device="cuda")
    for bs in (int(x) for x in args.bs.split(",")):
        for layer, window in (("full", None), ("swa", 128)):
            t = build(HQ, HKV, D, window, args.ctx, bs, 1, trim=window is not None, seed=bs)
            args_ = (t["q"], t["k"], t["v"], t["kv_indptr"], t["kv_indices"], t["q_pos"],
                     t["kv_pos"])
            ref, _ = attention_reference(t["q"].float(), t["k"].float(), t["v"].float(),
                                         t["qo_indptr"], *args_[3:], window=window, scale=scale,
                                         sinks=sinks)
            gb = t["kv_bytes"] / 1e9
            case = dict(bs=bs, layer=layer, ctx=args.ctx, kv_gb=gb, copy_tbs=bw / 1e12)

            def record(name, fn, **extra):
                try:
                    out = fn()
                    err = rel_err(out[0] if isinstance(out, tuple) else out, ref)
                    ms = graph_ms(fn, do_bench)
                    r = dict(case, kernel=name, ms=ms, tbs=gb / ms, of_copy=gb / ms * 1e12 / bw,
                             err=err, **extra)
                except Exception as e:  # noqa: BLE001 - a variant's failure is a row
                    r = dict(case, kernel=name, error=f"{type(e).__name__}: {e}"[:200], **extra)
                rows.append(r)
                print(json.dumps(r), flush=True)

            record("per_head", lambda: decode_attention(*args_, window=window, scale=scale,
                                                        sinks=sinks))
            if ws is not None:
                fi = flashinfer_call(t, HQ, HKV, D, window, 1, scale, ws)
                record("flashinfer", fi)  # no sinks: the kernel alone
            last = t["kv_indptr"][1:].long() - 1
            slots = t["kv_indices"][last].long()
            kn, vn = t["k"][slots].clone(), t["v"][slots].clone()
            for tile in args.tiles.split(","):
                bn, warps, stages = (int(x) for x in tile.split("x"))
                dr.rows_config = lambda h, d, c=(bn, warps, stages): c  # noqa: E731
                for sp in (int(x) for x in args.splits.split(",")):
                    kw = dict(window=window, scale=scale, sinks=sinks, num_splits=sp or None)
                    record("rows", lambda: dr.decode_rows(*args_, **kw), tile=tile, splits=sp)
                    if sp == 0:
                        record("rows_fused", lambda: dr.decode_rows(
                            *args_, new_kv=(kn, vn, slots), **kw), tile=tile, splits=sp)
            dr.rows_config = own
            del t
            torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "probe-decode-rows.json"), "w") as f:
        json.dump({"copy_tbs": bw / 1e12, "rows": rows}, f, indent=1)
    print("\n| bs | layer | kernel | tile | splits | µs | TB/s | of copy | rel err |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "ms" in r:
            print(f"| {r['bs']} | {r['layer']} | {r['kernel']} | {r.get('tile', '')} | "
                  f"{r.get('splits', '')} | {r['ms'] * 1e3:.1f} | {r['tbs']:.2f} | "
                  f"{r['of_copy']:.0%} | {r['err']:.1e} |")
        else:
            print(f"| {r['bs']} | {r['layer']} | {r['kernel']} | {r.get('tile', '')} | "
                  f"{r.get('splits', '')} | {r['error'][:80]} | | | |")


if __name__ == "__main__":
    main()
