"""Does any part of a step wait for the GPU? (GPU host only)

    python3 bench/probes/sync_wait.py OUT [model:bs ...]      (default gpt_oss_20b:8 gpt_oss_20b:64)

`bench_factory`'s eager cycle measured about planning + the layers' device time (GPT-OSS bs 64 at
cd26e19: 5.59 ms = 1.18 + 4.3), as if the host waited for the GPU before planning, although the
layers' host time alone is shorter than their device time. `torch.cuda.set_sync_debug_mode`
sees only torch's own syncs: a pageable host→device copy, a pinned-memory allocation or a
library's own `cudaStreamSynchronize` are invisible to it. Here each piece of the cycle runs
while the GPU is busy with a `torch.cuda._sleep` of SLEEP_MS: a piece that returns in about
its idle host time does not wait; one that takes SLEEP_MS more does. The CUDA runtime calls of
each waiting piece are listed from the profiler (CPU time per call name). Writes
OUT/sync-wait.json.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/
from bench_factory import Raw  # noqa: E402
from common import batch_of, probe_cases, setup, step_inputs  # noqa: E402

SLEEP_MS = 40.0


def _cycles_per_ms() -> float:
    """Clock cycles of `torch.cuda._sleep` per ms, measured (the SM clock moves)."""
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    torch.cuda._sleep(20_000_000)
    e.record()
    torch.cuda.synchronize()
    return 20_000_000 / s.elapsed_time(e)


def host_wall(fn, busy_cycles: int, n: int = 5) -> float:
    """Median host ms of ``fn`` started while the GPU has ``busy_cycles`` of sleep queued."""
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        if busy_cycles:
            torch.cuda._sleep(busy_cycles)
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    ts.sort()
    return ts[len(ts) // 2]


def runtime_calls(fn, busy_cycles: int) -> list[tuple[str, float, int]]:
    """(name, CPU ms, calls) of the CUDA runtime / aten calls that took the most CPU time while
    ``fn`` ran with the GPU busy: a wait shows as one call of about SLEEP_MS."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(busy_cycles)
        fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()
            if e.key not in ("cudaDeviceSynchronize",)]  # the profile's own closing sync
    rows.sort(key=lambda r: -r[1])
    return rows[:8]


def case(model: str, bs: int, ctx: int = 8192) -> dict:
    cfg, pool, alloc, slots, backend = setup(model, bs, ctx, 1)
    m = cfg.model
    batch = batch_of("decode", slots, alloc, bs, ctx)
    plan = backend.init_forward_metadata(batch)
    qs, ks, vs, sinks = step_inputs(cfg, pool, batch.total_q)
    raw = Raw(cfg, pool, plan, decode=True)
    raw.plan_all(m.num_attention_heads)
    busy = int(SLEEP_MS * _cycles_per_ms())
    sigs = backend._sigs(backend._pool, plan)

    def layers():
        for layer in range(m.num_layers):
            backend.forward(qs[layer], ks[layer], vs[layer], layer, sinks=sinks)

    def raw_layers():
        for layer in range(m.num_layers):
            raw.layer(layer, qs[layer], ks[layer], vs[layer], sinks)

    real = backend.adapter.plan

    def planner_only():
        backend.adapter.plan = lambda *a, **k: None
        try:
            backend.init_forward_metadata(batch)
        finally:
            backend.adapter.plan = real

    def cycle():
        backend.init_forward_metadata(batch)
        layers()

    pieces = {
        "init_forward_metadata": lambda: backend.init_forward_metadata(batch),
        "planner_only": planner_only,
        "adapter_plan": lambda: real(plan, backend._pool, sigs=sigs),
        "raw_plan_all": lambda: raw.plan_all(m.num_attention_heads),
        "factory_cycle": cycle,  # replans: the pieces above leave the adapter on an older plan
        "factory_layers": layers,
        "raw_layers": raw_layers,
    }
    out = dict(model=model, bs=bs, sleep_ms=SLEEP_MS, pieces={})
    for name, fn in pieces.items():
        fn()
        idle, busy_ms = host_wall(fn, 0), host_wall(fn, busy)
        row = dict(idle_ms=round(idle, 3), busy_ms=round(busy_ms, 3),
                   waits=busy_ms - idle > SLEEP_MS / 2)
        if row["waits"] or name in ("init_forward_metadata", "raw_plan_all"):
            row["calls"] = runtime_calls(fn, busy)
        out["pieces"][name] = row
        print(f"{model} bs {bs} {name:22s} idle {idle:8.3f} ms  busy {busy_ms:8.3f} ms"
              f"  {'WAITS' if row['waits'] else 'no wait'}", flush=True)
        for c in row.get("calls", []):
            print(f"      {c[1]:9.3f} ms {c[2]:5d}x  {c[0][:90]}", flush=True)
    del backend, pool, alloc, slots, raw
    torch.cuda.empty_cache()
    return out


def main() -> None:
    probe_cases(case, ["gpt_oss_20b:8", "gpt_oss_20b:64"], "sync-wait.json")


if __name__ == "__main__":
    main()
