"""Where does the host time of one forward go on the GPU host? Planning (ours, FlashInfer's
plan) and the per-layer loop, factory against raw.

    python3 bench/probes/host_gpu.py OUT [model:bs ...]

(default cases: gemma4:8 gemma4:64 gpt_oss_20b:8 gpt_oss_20b:64)

Prints, per case: init_forward_metadata (synchronized wall, median of 50), the planner alone
(adapter.plan stubbed; with the fused Triton key lists, and with torch ops),
adapter.plan alone, raw FlashInfer plan_all, the layer loop of factory
and raw without planning (do_bench medians), and a cProfile of init_forward_metadata (top 25 by
cumulative time) and of the factory's layer loop. Writes OUT/host-probe.json.
"""
from __future__ import annotations

import cProfile
import gc
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/
from bench_factory import Raw  # noqa: E402
from common import batch_of, host_ms, probe_cases, setup, step_inputs  # noqa: E402


def case(model: str, bs: int, ctx: int = 8192) -> dict:
    from triton.testing import do_bench

    cfg, pool, alloc, slots, backend = setup(model, bs, ctx, 1)
    m = cfg.model
    batch = batch_of("decode", slots, alloc, bs, ctx)
    plan = backend.init_forward_metadata(batch)
    L = m.num_layers
    qs, ks, vs, sinks = step_inputs(cfg, pool, batch.total_q)
    raw = Raw(cfg, pool, plan, decode=True)
    raw.plan_all(m.num_attention_heads)
    gc.collect()  # as bench_factory times: after warm-up the startup heap is frozen
    gc.freeze()
    out = dict(model=model, bs=bs)
    out["init_forward_metadata_ms"] = host_ms(lambda: backend.init_forward_metadata(batch), 50)
    fplan = backend.init_forward_metadata(batch)
    sigs = backend._sigs(backend._pool, fplan)
    out["adapter_plan_ms"] = host_ms(
        lambda: backend.adapter.plan(fplan, backend._pool, sigs=sigs), 50)
    out["raw_plan_all_ms"] = host_ms(lambda: raw.plan_all(m.num_attention_heads), 50)
    real = backend.adapter.plan
    backend.adapter.plan = lambda *a, **k: None
    out["planner_only_ms"] = host_ms(lambda: backend.init_forward_metadata(batch), 50)
    from swafactory.metadata import keys_triton  # the key lists from torch ops instead
    fused = keys_triton.available
    keys_triton.available = lambda: False
    out["planner_only_torch_keys_ms"] = host_ms(lambda: backend.init_forward_metadata(batch), 50)
    keys_triton.available = fused
    backend.adapter.plan = real
    backend.init_forward_metadata(batch)

    def layers():
        for layer in range(L):
            backend.forward(qs[layer], ks[layer], vs[layer], layer, sinks=sinks)

    def raw_layers():
        for layer in range(L):
            raw.layer(layer, qs[layer], ks[layer], vs[layer], sinks)

    out["factory_layers_ms"] = do_bench(layers, warmup=5, rep=40, return_mode="median")
    out["raw_layers_ms"] = do_bench(raw_layers, warmup=5, rep=40, return_mode="median")
    # host-only time of the layer loops (no sync inside): how long Python takes to launch them
    for name, fn in (("factory_layers_host_ms", layers), ("raw_layers_host_ms", raw_layers)):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            fn()
        out[name] = (time.perf_counter() - t0) / 10 * 1e3
        torch.cuda.synchronize()
    s = io.StringIO()
    for what, fn in (("init_forward_metadata", lambda: backend.init_forward_metadata(batch)),
                     ("factory layers", layers)):
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(50):
            fn()
        pr.disable()
        torch.cuda.synchronize()
        s.write(f"### {what}, 50 calls\n")
        pstats.Stats(pr, stream=s).sort_stats("cumtime").print_stats(30)
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
    out["profile"] = s.getvalue()
    gc.unfreeze()
    del backend, pool, alloc, slots, raw
    torch.cuda.empty_cache()
    return out


def main() -> None:
    probe_cases(case, ["gemma4:8", "gemma4:64", "gpt_oss_20b:8", "gpt_oss_20b:64"],
                "host-probe.json", lambda r: {k: v for k, v in r.items() if k != "profile"})


if __name__ == "__main__":
    main()
