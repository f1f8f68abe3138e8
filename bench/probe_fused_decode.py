"""The Triton decode at Gemma 4 geometry (bs 64, ctx 8192) with and without the step's K/V
written by the kernel (``new_kv``), over int32 and int64 pool rows (H200).

    python3 bench/probe_fused_decode.py OUT

Cases are bench_triton_vs_flashinfer's; prints a table, writes OUT/probe-fused-decode.json.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from bench_triton_vs_flashinfer import CASES, build, copy_bandwidth

WANT = ("gemma4_swa_decode", "gemma4_full_decode")


def main() -> int:
    from triton.testing import do_bench

    from swafactory.kernels.triton.decode import decode_attention

    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    bw = copy_bandwidth(do_bench)
    rows = []
    for name, hq, hkv, d, window, ctx, bs, q_len, sinks, trim in CASES:
        if name not in WANT:
            continue
        t = build(hq, hkv, d, window, ctx, bs, q_len, trim)
        ends = t["kv_indptr"][1:].long() - 1  # each request's last key: the step's own row
        slots = t["kv_indices"].long()[ends]
        kn = torch.randn(bs, hkv, d, device="cuda", dtype=torch.bfloat16)
        vn = torch.randn_like(kn)
        row = dict(case=name, kv_gb=t["kv_bytes"] / 1e9, floor_ms=t["kv_bytes"] / bw * 1e3)
        for idx_name, idx in (("int32", t["kv_indices"].int()), ("int64", t["kv_indices"].long())):
            args = (t["q"], t["k"], t["v"], t["qo_indptr"], t["kv_indptr"], idx, t["q_pos"],
                    t["kv_pos"])
            for fused in (False, True):
                kw = dict(window=window, scale=1.0, new_kv=(kn, vn, slots) if fused else None)
                for splits in (None, 1, 2, 4):
                    f = lambda: decode_attention(*args, **kw, num_splits=splits)  # noqa: E731
                    key = f"{idx_name} {'fused' if fused else 'plain'} splits={splits}"
                    row[key] = do_bench(f, warmup=10, rep=60, return_mode="median")
        print(json.dumps(row), flush=True)
        rows.append(row)
        del t
        torch.cuda.empty_cache()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    for r in rows:
        print(f"{r['case']}: floor {r['floor_ms']:.3f} ms")
        for k, v in r.items():
            if "splits" in k:
                print(f"  {k:28s} {v:.3f} ms  {r['floor_ms'] / v:.0%} of copy")
    (out / "probe-fused-decode.json").write_text(json.dumps(dict(copy_tbs=bw / 1e12, rows=rows),
                                                            indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
