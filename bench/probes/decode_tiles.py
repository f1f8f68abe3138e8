"""Which tile and split count makes our decode kernel fastest on GPT-OSS geometry in a graph?

GPT-OSS-20b layers (Hq 64, Hkv 8, D 64, sinks): the full layer over ``ctx`` keys and the SWA
layer over its W = 128 window (a trimmed list), bs 8 and 64, page size 1 with shuffled slots.
Each variant is `decode_attention` with this step's K/V written by the kernel (``new_kv``) and,
where it splits, the merge launch: captured once in a CUDA graph and replayed (`do_bench`
median). TB/s: the K/V bytes read over that time, beside a device copy of the same run. Every
variant is checked against an fp32 reference.

    python3 bench/probes/decode_tiles.py --out DIR [--tiles 64x4x3,32x4x4] [--splits 0,4,8,16]
        [--cuda 64x3,128x2]

``--cuda`` adds our CUDA cluster kernel (``kernels/cuda/decode_d64.cu``, splits merged in the
cluster, one launch) with each listed tile (keys x stages); its ``splits`` is forced (0: planned). The
Triton rows run with ``cuda=False``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
from common import capture  # noqa: E402
from triton_vs_flashinfer import build, copy_bandwidth, rel_err  # noqa: E402

HQ, HKV, D = 64, 8, 64


def graph_ms(fn, do_bench) -> float:
    """Median replay time of ``fn`` captured once in a CUDA graph (after one eager warm-up)."""
    g, _ = capture(fn)
    return do_bench(g.replay, warmup=20, rep=200, return_mode="median")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--bs", default="8,64")
    ap.add_argument("--tiles", default="64x4x3,32x4x3,32x4x4,64x4x4,128x4x2,64x8x3,32x2x4")
    ap.add_argument("--splits", default="0,4,8,16", help="0: the planned count")
    ap.add_argument("--cuda", default="", help="tiles of the CUDA kernel to add, e.g. 64x3,128x2")
    args = ap.parse_args()
    from triton.testing import do_bench

    import swafactory.kernels.cuda.decode as cdec
    import swafactory.kernels.triton.decode as dec
    from swafactory.kernels.torch_ref import attention_reference

    bw = copy_bandwidth(do_bench)
    rows, own, own_splits = [], dec.decode_config, cdec.cluster_splits
    scale = D ** -0.5
    sinks = torch.randn(HQ, device="cuda")
    for bs in (int(x) for x in args.bs.split(",")):
        for layer, window in (("full", None), ("swa", 128)):
            t = build(HQ, HKV, D, window, args.ctx, bs, 1, trim=window is not None, seed=bs)
            a = (t["q"], t["k"], t["v"], t["qo_indptr"], t["kv_indptr"], t["kv_indices"],
                 t["q_pos"], t["kv_pos"])
            ref, _ = attention_reference(t["q"].float(), t["k"].float(), t["v"].float(), *a[3:],
                                         window=window, scale=scale, sinks=sinks)
            last = t["kv_indptr"][1:].long() - 1
            slots = t["kv_indices"][last].long()
            new = (t["k"][slots].clone(), t["v"][slots].clone(), slots)
            gb = t["kv_bytes"] / 1e9
            variants = [t for t in args.tiles.split(",") if t]
            variants += [f"cuda-{x}" for x in args.cuda.split(",") if x]
            for tile in variants:
                cuda = tile.startswith("cuda")
                if cuda:
                    os.environ["SWAFACTORY_DECODE_TILE"] = tile[len("cuda-"):]
                else:
                    bn, warps, stages = (int(x) for x in tile.split("x"))
                    dec.decode_config = lambda d, g, c=(16, bn, warps, stages): c  # noqa: E731
                for sp in (int(x) for x in args.splits.split(",")):
                    if window is not None and sp > 4:
                        continue
                    r = dict(bs=bs, layer=layer, ctx=args.ctx, tile=tile, splits=sp, kv_gb=gb)
                    cdec.cluster_splits = own_splits if not (cuda and sp) else (
                        lambda *_, s=sp, **__: s)
                    fn = lambda: dec.decode_attention(*a, window=window, scale=scale,  # noqa
                                                      sinks=sinks, new_kv=new,
                                                      num_splits=sp or None, cuda=cuda)
                    try:
                        err = rel_err(fn()[0], ref)
                        ms = graph_ms(fn, do_bench)
                        r.update(ms=ms, tbs=gb / ms, of_copy=gb / ms * 1e12 / bw, err=err)
                    except Exception as e:  # noqa: BLE001 - a variant's failure is a row
                        r.update(error=f"{type(e).__name__}: {e}"[:200])
                    rows.append(r)
                    print(json.dumps(r), flush=True)
            dec.decode_config = own
            cdec.cluster_splits = own_splits
            os.environ.pop("SWAFACTORY_DECODE_TILE", None)
            del t
            torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "probe-decode-tiles.json"), "w") as f:
        json.dump({"copy_tbs": bw / 1e12, "rows": rows}, f, indent=1)
    print("\n| bs | layer | BNxWARPSxSTAGES | splits | µs | TB/s | of copy | rel err |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        tail = (f"{r['ms'] * 1e3:.1f} | {r['tbs']:.2f} | {r['of_copy']:.0%} | {r['err']:.1e}"
                if "ms" in r else f"{r['error'][:80]} | | |")
        print(f"| {r['bs']} | {r['layer']} | {r['tile']} | {r['splits']} | {tail} |")


if __name__ == "__main__":
    main()
