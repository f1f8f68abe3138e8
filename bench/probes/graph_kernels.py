"""Which kernels does a captured factory step replay, and how long does each take? (GPU host)

For each case (model:mode:bs[:override,...]) it builds `common.setup`'s pools and batch, captures
the whole step through the backend's graph contract (as `common.graph_case` does), times
the replay (do_bench median) and profiles 10 replays with the torch profiler: per kernel name,
calls and device µs per replay, grouped by the layer group whose step it is. The floor is the
K/V bytes the step reads over a copy measured in the same run.

    python3 bench/probes/graph_kernels.py OUT gpt_oss_20b:decode:8 gemma4:verify_chain8:64
    python3 bench/probes/graph_kernels.py OUT gemma4:verify_chain8:64:backend.groups.full=triton

Writes OUT/probe-graph-kernels.json and prints a table per case.
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/
import common as bf  # noqa: E402


def one(spec: str, do_bench, bw: float, eager: bool) -> dict:
    model, mode, bs, *ov = spec.split(":")
    bs, ctx, nodes = int(bs), 8192, bf.MODES[mode]
    name = next((o.split("=", 1)[1] for o in ov if o.startswith("backend=")), "flashinfer")
    ov = [o for o in ov if not o.startswith("backend=")]
    cfg, pool, alloc, slots, backend = bf.setup(model, bs, ctx, nodes, backend_name=name,
                                                overrides=(*bf.SPEC_OF.get(mode, ()), *ov))
    batch = bf.batch_of(mode, slots, alloc, bs, ctx)
    plan = backend.init_forward_metadata(batch)
    qs, ks, vs, sinks = bf.step_inputs(cfg, pool, batch.total_q)
    L = len(qs)

    def step():
        for layer in range(L):
            out = backend.forward(qs[layer], ks[layer], vs[layer], layer, sinks=sinks)
        return out

    if eager:  # the kernels of an eager forward (no capture), after the plan
        run = step
    else:
        backend.init_cuda_graph_state(bs, nodes, ctx + nodes)
        backend.init_forward_metadata_capture(bs, nodes, batch.mode)
        g, _ = bf.capture(step)
        backend.init_forward_metadata_replay(batch, bs, nodes)
        run = g.replay
    ms = do_bench(run, warmup=10, rep=100, return_mode="median")
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    n = 10
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            run()
        torch.cuda.synchronize()
    kernels = defaultdict(lambda: [0, 0.0])
    evs = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    per = len(evs) // n  # one replay's kernels in order, with the gap before each (µs)
    order = [dict(name=e.name[:40], us=round(e.time_range.elapsed_us(), 2),
                  gap=round(e.time_range.start - evs[i - 1].time_range.end, 2) if i else 0.0)
             for i, e in enumerate(evs[per * (n // 2):per * (n // 2 + 1)], start=per * (n // 2))]
    for e in evs:
        if True:
            k = kernels[e.name[:90]]
            k[0] += 1
            k[1] += e.time_range.elapsed_us()
    rows = sorted(((name, c / n, us / n) for name, (c, us) in kernels.items()),
                  key=lambda r: -r[2])
    floor = bf.kv_bytes_read(plan, pool) / bw * 1e3
    return dict(case=spec, eager=eager, step_ms=ms, floor_ms=floor, layers=L,
                kernel_us_sum=sum(r[2] for r in rows) / 1e3,
                kernels=[dict(name=a, calls=b, us=c) for a, b, c in rows], order=order)


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[1].startswith("-"):  # the usage; nothing run, nothing made
        print(__doc__)
        sys.exit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    from triton.testing import do_bench

    bw = bf.copy_bandwidth(do_bench)
    res = []
    for spec in sys.argv[2:]:
        eager = spec.endswith(":eager")
        spec = spec.removesuffix(":eager")
        try:
            r = one(spec, do_bench, bw, eager)
        except Exception as e:  # noqa: BLE001 - a case's failure is a row
            r = dict(case=spec, error=f"{type(e).__name__}: {e}"[:300])
        res.append(r)
        print(f"\n## {spec}{' (eager)' if eager else ''}")
        if "error" in r:
            print(r["error"])
            continue
        print(f"step {r['step_ms']:.3f} ms, floor {r['floor_ms']:.3f} ms "
              f"({r['step_ms'] / r['floor_ms']:.2f}x), kernels {r['kernel_us_sum']:.3f} ms")
        for k in r["kernels"][:14]:
            print(f"  {k['us']:9.1f} us  {k['calls']:5.1f}x  {k['name']}")
        print("  one replay in order (us, gap before):",
              " ".join(f"{o['us']:.1f}/{o['gap']:.1f}" for o in r["order"]))
        torch.cuda.empty_cache()
    (out / "probe-graph-kernels.json").write_text(json.dumps(dict(copy_tbs=bw / 1e12, rows=res),
                                                             indent=1))


if __name__ == "__main__":
    main()
