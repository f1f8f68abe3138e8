"""Probe (GPU host): FlashInfer decode for GPT-OSS geometry (Hq 64, Hkv 8, D 64, bf16, ctx 8K),
tensor-core (the prefill kernel) against CUDA-core decode, eager and replayed in a CUDA graph
that was captured with 1-key requests (as the graph contract captures), at bs 8 and 64.
Prints one JSON line per case. Usage: python3 bench/probe_decode.py"""
from __future__ import annotations

import json

import torch


def case(bs: int, tc: bool, window: int | None, ctx: int = 8192) -> dict:
    import flashinfer
    from triton.testing import do_bench

    hq, hkv, d = 64, 8, 64
    rows = bs * ctx + 1
    k = torch.randn(rows, 1, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    perm = torch.randperm(rows - 1, device="cuda").int() + 1
    n = ctx if window is None else window
    kv = torch.arange(0, (bs + 1) * n, n, dtype=torch.int32)
    idx = perm[:bs * n].contiguous()
    last = torch.ones(bs, dtype=torch.int32)
    q = torch.randn(bs, hq, d, device="cuda", dtype=torch.bfloat16)
    ws = torch.zeros(512 * 2**20, dtype=torch.uint8, device="cuda")
    wl = -1 if window is None else window - 1
    common = dict(q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, window_left=wl)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
    w.plan(kv, idx, last, hq, hkv, d, 1, **common)
    eager = do_bench(lambda: w.run(q, (k, v), return_lse=True), warmup=10, rep=50,
                     return_mode="median")
    i32 = dict(dtype=torch.int32, device="cuda")
    g = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        torch.zeros_like(ws), "NHD", use_tensor_cores=tc, use_cuda_graph=True,
        paged_kv_indptr_buffer=torch.zeros(bs + 1, **i32),
        paged_kv_indices_buffer=torch.zeros(bs * n, **i32),
        paged_kv_last_page_len_buffer=torch.ones(bs, **i32))
    g.plan(torch.arange(bs + 1, dtype=torch.int32), torch.zeros(bs, dtype=torch.int32), last,
           hq, hkv, d, 1, **common)  # captured with 1-key requests
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        g.run(q, (k, v), return_lse=True)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = g.run(q, (k, v), return_lse=True)
    g.plan(kv, idx, last, hq, hkv, d, 1, **common)
    graph.replay()
    ref, _ = w.run(q, (k, v), return_lse=True)
    err = float((out.float() - ref.float()).abs().max())
    replay = do_bench(graph.replay, warmup=10, rep=50, return_mode="median")
    gbytes = bs * n * hkv * d * 2 * 2 / 1e9
    return dict(bs=bs, tensor_cores=tc, window=window, eager_us=eager * 1e3,
                graph_us=replay * 1e3, kv_gb=gbytes, graph_vs_eager_err=err)


if __name__ == "__main__":
    for bs in (8, 64):
        for window in (None, 128):
            for tc in (True, False):
                try:
                    print(json.dumps(case(bs, tc, window)), flush=True)
                except Exception as exc:  # noqa: BLE001 - a probe reports what failed
                    print(json.dumps(dict(bs=bs, tensor_cores=tc, window=window,
                                          error=f"{type(exc).__name__}: {exc}"[:300])))
                torch.cuda.empty_cache()
