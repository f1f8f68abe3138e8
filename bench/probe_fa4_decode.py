"""flash-attn-4's decode at GPT-OSS full-layer geometry: its tile, GQA packing and splits (H200).

    python3 bench/probe_fa4_decode.py OUT

The goal asks flash_attn at page 128 to read a GPT-OSS full layer's decode K/V at ≥ 85% of copy
bandwidth; `bench_pages` measured 54% (wall time). Two suspects, separated here:

* host launch time: FA4's Python interface runs per call; each variant is timed as the wall time
  of the call (do_bench) and as its kernels' device time (`bench_factory.device_ms`: captured in
  a CUDA graph and replayed);
* the tile: at head_dim 64 FA4 4.0.0b9 picks a 192 × 128 tile on SM90; with its GQA packing a
  decode tile holds 8 query rows (one token × 8 heads per KV head), so most of its MMA work is
  padding. ``_flash_attn_fwd`` takes ``tile_mn``, ``pack_gqa``, ``num_splits`` and
  ``num_threads``; the variants below try smaller tiles and split-KV.

The case: bs 64, 8192 keys each, Hq 64, Hkv 8, D 64, bf16, causal, the pool's pages at 128 (and
page size 1), random page order. Each variant is checked against the public
``flash_attn_varlen_func``'s output. Writes OUT/probe-fa4-decode.json.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

BS, CTX, HQ, HKV, D = 64, 8192, 64, 8, 64
VARIANTS = [  # name, _flash_attn_fwd keyword arguments
    ("default", {}),
    ("tile_128x128", {"tile_mn": (128, 128)}),
    ("tile_64x128", {"tile_mn": (64, 128)}),
    ("tile_64x128_256thr", {"tile_mn": (64, 128), "num_threads": 256}),
    ("splits_auto", {"num_splits": 0}),
    ("tile_128x128_splits_auto", {"tile_mn": (128, 128), "num_splits": 0}),
    ("no_pack_gqa", {"pack_gqa": False}),
]


def case(page: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    pages_per = CTX // page
    n_pages = BS * pages_per + 1
    k = torch.randn(n_pages, page, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    perm = (torch.randperm(n_pages - 1, device="cuda", generator=g) + 1).int()
    table = perm.view(BS, pages_per).contiguous()
    q = torch.randn(BS, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    cu_q = torch.arange(BS + 1, device="cuda", dtype=torch.int32)
    used = torch.full((BS,), CTX, device="cuda", dtype=torch.int32)
    return q, k, v, table, cu_q, used


def main() -> int:
    from triton.testing import do_bench

    from bench_factory import copy_bandwidth, device_ms
    from flash_attn.cute import interface as fa

    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    bw = copy_bandwidth(do_bench)
    kv_bytes = BS * CTX * HKV * D * 2 * 2
    rows = []
    for page in (128, 1):
        q, k, v, table, cu_q, used = case(page)
        common = dict(cu_seqlens_q=cu_q, seqused_k=used, max_seqlen_q=1, page_table=table,
                      softmax_scale=D ** -0.5, causal=True)
        ref, _ = fa.flash_attn_varlen_func(q, k, v, return_lse=True, **common)
        for name, extra in VARIANTS:
            r = dict(page=page, variant=name, kwargs={k2: str(x) for k2, x in extra.items()})
            try:
                def call(extra=extra):
                    return fa._flash_attn_fwd(q, k, v, return_lse=True, **common, **extra)[0]
                o = call()
                torch.cuda.synchronize()
                r["max_abs_diff"] = float((o.float() - ref.float()).abs().max())
                wall = do_bench(call, warmup=10, rep=100, return_mode="median")
                dev, how = device_ms(call, do_bench)
                r.update(wall_ms=wall, device_ms=dev, device_by=how,
                         wall_of_copy=kv_bytes / (wall * 1e-3) / bw,
                         device_of_copy=kv_bytes / (dev * 1e-3) / bw)
            except Exception as exc:  # noqa: BLE001 - a variant the library refuses is a row
                r["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(r)
            print(json.dumps(r), flush=True)
    (out / "probe-fa4-decode.json").write_text(json.dumps(
        dict(copy_tbs=bw / 1e12, kv_gb=kv_bytes / 1e9, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
