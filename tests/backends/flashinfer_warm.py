"""Compile the FlashInfer kernel variants the GPU tests and smoke runs use, in parallel.

FlashInfer JIT-compiles one module per (kind, head_dim, dtype, sliding window, soft-cap) on first
use, 15–25 s each, one after another inside a process. Building them here in parallel processes
(the JIT cache is shared on disk) turns minutes of serial compiles into one batch. The plan
arguments mirror `swafactory.kernels.flashinfer.Adapter` exactly, so the cached modules are the
ones the adapter loads. Run on the GPU host: ``python3 tests/backends/flashinfer_warm.py
[HEAD_DIM ...] [KIND ...]`` (only those head dims' and kinds' variants, e.g. ``256 512`` for
Gemma 4, ``decode short`` for decode and chain verify).
"""
from __future__ import annotations

import sys
import time
from concurrent.futures import ProcessPoolExecutor

__all__ = ["VARIANTS", "warm"]

# (kind, Hq, Hkv, head_dim, window_left >= 0?, soft-cap?[, fp8 KV?]); kinds, as the adapter plans
# them: ``decode`` (tensor-core decode), ``mask`` (masked prefill: FA2), ``short`` (a causal pass
# of a few queries per request: FA2 asked for), ``long`` (a causal chunk: FlashInfer's own
# choice, FA3 on Hopper where the head dim has it)
VARIANTS = [
    ("decode", 32, 16, 256, True, False), ("decode", 32, 4, 512, False, False),   # gemma4
    ("mask", 32, 16, 256, False, False), ("mask", 32, 4, 512, False, False),
    ("short", 32, 16, 256, True, False), ("long", 32, 16, 256, True, False),
    ("decode", 8, 4, 64, True, False), ("decode", 8, 2, 64, False, False),       # tiny / gpt-oss
    ("mask", 8, 4, 64, False, False), ("short", 8, 4, 64, True, False),
    ("long", 8, 4, 64, True, False), ("long", 8, 2, 64, False, False),
    ("decode", 8, 4, 64, True, True), ("decode", 8, 2, 64, False, True),         # soft-cap
    ("mask", 8, 4, 64, False, True), ("short", 8, 4, 64, True, True),
    ("mask", 32, 8, 128, False, False),                                          # mistral
    ("decode", 8, 2, 64, True, False, True), ("decode", 8, 2, 64, False, False, True),  # fp8 KV
    ("mask", 8, 2, 64, False, False, True),
]


def warm(v: tuple) -> str:
    try:
        return _warm(v)
    except Exception as e:  # report every variant, not just the first failure
        return f"{v}: FAILED {type(e).__name__}: {e}"


def _warm(v: tuple) -> str:
    import flashinfer
    import torch

    kind, hq, hkv, d, window, softcap = v[:6]
    kv_dtype = torch.float8_e4m3fn if len(v) > 6 and v[6] else torch.bfloat16
    t0 = time.time()
    dev = "cuda"
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
    n = 16
    k = torch.randn(n + 1, 1, hkv, d, dtype=torch.bfloat16, device=dev).to(kv_dtype)
    idx = torch.arange(1, n + 1, dtype=torch.int32, device=dev)
    kv_indptr = torch.tensor([0, n], dtype=torch.int32)
    last = torch.ones(1, dtype=torch.int32)  # host, like the adapter
    common = dict(q_data_type=torch.bfloat16, kv_data_type=kv_dtype, sm_scale=d ** -0.5,
                  logits_soft_cap=2.0 if softcap else None)
    left = 7 if window else -1
    if kind == "decode":
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
        w.plan(kv_indptr, idx, last, hq, hkv, d, 1, window_left=left, **common)
        q = torch.randn(1, hq, d, dtype=torch.bfloat16, device=dev)
    else:
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            ws, "NHD", backend="fa2" if kind == "short" else "auto")
        qo = torch.tensor([0, 4], dtype=torch.int32)
        if kind == "mask":
            mask = torch.ones(4 * n, dtype=torch.bool, device=dev)
            w.plan(qo, kv_indptr, idx, last, hq, hkv, d, 1, custom_mask=mask, window_left=-1,
                   **common)
        else:
            w.plan(qo, kv_indptr, idx, last, hq, hkv, d, 1, causal=True, window_left=left,
                   **common)
        q = torch.randn(4, hq, d, dtype=torch.bfloat16, device=dev)
    scales = dict(k_scale=0.5, v_scale=0.5) if kv_dtype != torch.bfloat16 else {}
    w.run(q, (k, k), return_lse=True, **scales)
    torch.cuda.synchronize()
    return f"{v}: {time.time() - t0:.1f}s"


def main(args: list[str]) -> int:
    """Warm every variant, or those of the given head dims (Gemma 4's: 256 512) and kinds
    (``decode mask short long``; default all)."""
    t0 = time.time()
    head_dims = [int(a) for a in args if a.isdigit()]
    kinds = [a for a in args if not a.isdigit()]
    chosen = [v for v in VARIANTS if (not head_dims or v[3] in head_dims)
              and (not kinds or v[0] in kinds)]
    with ProcessPoolExecutor(max_workers=max(1, len(chosen))) as ex:
        for line in ex.map(warm, chosen):
            print(line, flush=True)
    print(f"warmed {len(chosen)} variants in {time.time() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
