"""Where fp8 KV time goes in our Triton kernels (H200): the same decode / verify on bf16 buffers,
on fp8 buffers read in bf16 (the dequantized tile multiplied in bf16) and read in fp16 (q cast
to fp16: e4m3 → fp16 is one conversion per two values on SM90), and the K/V write each way.

    python3 bench/probe_fp8.py OUT

Cases are bench_triton_vs_flashinfer's (bs 64, ctx 8192). Prints a table; writes OUT/probe-fp8.json.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from bench_triton_vs_flashinfer import CASES, build, copy_bandwidth

WANT = ("gemma4_full_decode", "gemma4_swa_decode", "gptoss_full_decode", "gemma4_full_verify8")


def main() -> int:
    from triton.testing import do_bench

    from swafactory.kernels.triton.decode import decode_attention
    from swafactory.kernels.triton.extend import extend_attention
    from swafactory.kvcache.quant import quantize, store_rows

    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    bw = copy_bandwidth(do_bench)
    rows = []
    for name, hq, hkv, d, window, ctx, bs, q_len, sinks, trim in CASES:
        if name not in WANT:
            continue
        t = build(hq, hkv, d, window, ctx, bs, q_len, trim)
        k8, v8 = quantize(t["k"], 0.125, torch.float8_e4m3fn), quantize(t["v"], 0.0625,
                                                                        torch.float8_e4m3fn)
        idx = (t["qo_indptr"], t["kv_indptr"], t["kv_indices"], t["q_pos"], t["kv_pos"])
        fn = decode_attention if q_len == 1 else extend_attention
        kw = dict(window=window, scale=d ** -0.5)
        if q_len > 1:
            kw.update(max_q_len=q_len)
        variants = {
            "bf16": lambda: fn(t["q"], t["k"], t["v"], *idx, **kw),
            "fp8 read as bf16": lambda: fn(t["q"], k8, v8, *idx, **kw, k_scale=0.125,
                                           v_scale=0.0625),
            "fp8 read as fp16": lambda: fn(t["q"].half(), k8, v8, *idx, **kw, k_scale=0.125,
                                           v_scale=0.0625),
        }
        ref = variants["bf16"]()[0].float()
        row = dict(case=name, kv_bytes_bf16=t["kv_bytes"])
        for key, f in variants.items():
            o = f()[0].float()
            row[key] = dict(ms=do_bench(f, warmup=20, rep=100, return_mode="median"),
                            rel_err_vs_bf16=float((o - ref).abs().max() / ref.abs().max()))
        n = bs * q_len
        kn = torch.randn(n, hkv, d, device="cuda", dtype=torch.bfloat16)
        rws = t["kv_indices"][:n].long()
        row["write bf16"] = do_bench(lambda: t["k"].index_copy_(0, rws, kn), warmup=20, rep=100,
                                     return_mode="median")
        row["write fp8"] = do_bench(lambda: store_rows(k8, rws, kn, 0.125), warmup=20, rep=100,
                                    return_mode="median")
        print(json.dumps(row), flush=True)
        rows.append(row)
        del t, k8, v8
        torch.cuda.empty_cache()
    lines = [f"copy bandwidth {bw / 1e12:.2f} TB/s", "",
             "| case | bf16 ms | fp8 as bf16 ms | fp8 as fp16 ms | fp16 err vs bf16 | write bf16 ms "
             "| write fp8 ms |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['bf16']['ms']:.3f} | {r['fp8 read as bf16']['ms']:.3f} | "
                     f"{r['fp8 read as fp16']['ms']:.3f} | "
                     f"{r['fp8 read as fp16']['rel_err_vs_bf16']:.1e} | {r['write bf16']:.4f} | "
                     f"{r['write fp8']:.4f} |")
    print("\n".join(lines))
    (out / "probe-fp8.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
