"""Which way of compiling FlexAttention lowers at serving shapes on this GPU?

The flex adapter's padded batches change shape every forward (requests, query counts, key
counts). torch 2.11 on the H200 failed to lower ``torch.compile(flex_attention, dynamic=True)``
there (NoValidChoicesError). This probe runs one compile mode over a sequence of serve-like
shapes (GPT-OSS geometry: 64 q heads, 8 KV heads, head_dim 64, window 128) in a fresh process
each, and prints per mode: ok or the error, compiles, and seconds per shape (first call, warm).

    python3 bench/probes/flex_compile.py OUT.json [MODE ...]
MODE: dynamic (dynamic=True), auto (dynamic=None), static_bucketed (dynamic=False, shapes
rounded up to powers of two, keys to a multiple of 128), dynamic_bucketed, dynamic_transposed
(dynamic=True on [B, S, H, D] tensors viewed as [B, H, S, D], as the adapter first did), and
the two fixes for the passes of 9-127 queries that failed: dynamic_pad128 (such passes
padded to one full 128-query block) and dynamic_force (``kernel_options=
{"FORCE_USE_FLEX_ATTENTION": True}``: never the flex-decoding kernel).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

# (B, qmax, kvmax): prefill chunks, decode, verify, a tree, a growing context
SHAPES = [(1, 256, 300), (1, 200, 456), (2, 256, 300), (2, 200, 420), (8, 1, 260), (8, 4, 300), (8, 8, 311), (4, 1, 1200),
          (8, 6, 900), (3, 512, 700), (8, 1, 1500), (5, 3, 170),
          # extend passes with one 128-query block: where serve runs failed to lower (1da1d66)
          (8, 64, 900), (1, 100, 600), (4, 128, 700)]
MODES = ["dynamic", "dynamic_transposed", "auto", "static_bucketed", "dynamic_bucketed",
         "dynamic_pad128", "dynamic_force"]


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def child(mode: str) -> dict:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import torch._dynamo
    torch._dynamo.config.recompile_limit = 256
    dyn = {"dynamic": True, "auto": None, "static_bucketed": False, "dynamic_bucketed": True,
           "dynamic_transposed": True, "dynamic_pad128": True, "dynamic_force": True}[mode]
    opts = {"kernel_options": {"FORCE_USE_FLEX_ATTENTION": True}} if mode == "dynamic_force" else {}
    fn = torch.compile(flex_attention, dynamic=dyn)
    hq, hkv, d, W = 64, 8, 64, 128
    rows = []
    for (b, qm, km) in SHAPES:
        if mode.endswith("bucketed"):
            b, qm, km = _pow2(b), _pow2(qm), -(-km // 128) * 128
        if mode == "dynamic_pad128" and 8 < qm < 128:
            qm = 128
        dev = "cuda"
        q = torch.randn(b, hq, qm, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(b, hkv, km, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(b, hkv, km, d, device=dev, dtype=torch.bfloat16)
        if mode == "dynamic_transposed":
            q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
        qpos = torch.arange(qm, device=dev) + (km - qm)
        kpos = torch.arange(km, device=dev)
        dist = qpos[:, None] - kpos[None, :]
        vis = ((dist >= 0) & (dist < W))[None].expand(b, qm, km).contiguous()

        def mask_mod(bi, h, qi, ki):
            return vis[bi, qi, ki]

        bm = create_block_mask(mask_mod, b, None, qm, km, device=dev, BLOCK_SIZE=128)
        t0 = time.perf_counter()
        try:
            o, aux = fn(q, k, v, block_mask=bm, scale=d ** -0.5, enable_gqa=True,
                        return_aux=__import__("torch.nn.attention.flex_attention",
                                              fromlist=["AuxRequest"]).AuxRequest(lse=True),
                        **opts)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 — the probe reports any lowering failure
            rows.append({"shape": [b, qm, km], "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            break
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        fn(q, k, v, block_mask=bm, scale=d ** -0.5, enable_gqa=True, **opts)
        torch.cuda.synchronize()
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.float(), k.float().repeat_interleave(hq // hkv, 1),
            v.float().repeat_interleave(hq // hkv, 1), attn_mask=vis[:, None])
        err = float((o.float() - ref).abs().max())
        rows.append({"shape": [b, qm, km], "first_s": round(first, 2),
                     "warm_s": round(time.perf_counter() - t0, 4), "max_abs_err": err})
    return {"mode": mode, "torch": torch.__version__, "rows": rows,
            "ok": all("error" not in r for r in rows) and len(rows) == len(SHAPES)}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):  # the usage; nothing run
        print(__doc__)
        sys.exit(0 if len(sys.argv) > 1 else 2)
    if sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2])))
        return
    out, modes = sys.argv[1], sys.argv[2:] or MODES
    results = []
    for m in modes:
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, __file__, "--child", m], capture_output=True,
                           text=True, timeout=400)
        try:
            r = json.loads(p.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            r = {"mode": m, "ok": False, "rows": [], "stderr": p.stderr[-1500:]}
        r["wall_s"] = round(time.perf_counter() - t0, 1)
        results.append(r)
        print(f"{m:18s} ok={r['ok']} wall={r['wall_s']}s "
              + "; ".join(f"{x['shape']}:{x.get('first_s', x.get('error', ''))}" for x in r["rows"]),
              flush=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
