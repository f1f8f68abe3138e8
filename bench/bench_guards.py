"""The guards' cost: a step's cycle time with guards on (the default) against guards off.

For each case (model:bs, decode at ctx tokens, `common.setup`'s pools: every layer, bf16, pages
shuffled, out-of-window SWA slots evicted) one backend is timed with ``backend.guards`` True and
False, interleaved round by round (a shared host drifts within seconds):

* **eager**: ``init_forward_metadata(batch)`` + ``forward(q, k, v, layer)`` of every layer;
* **graph**: the bucket of ``bs`` requests captured once (the step of every layer's ``forward``
  in one CUDA graph, as an engine captures its own), then per step
  ``init_forward_metadata_replay`` + replay, for the full batch and for ``bs - 1`` requests
  (one padding row: the padding guard has a row to check).

Guards add no host sync: their device checks are raised at ``backend.raise_pending()``, called
here after each timing (it must raise nothing). Times are ``triton.testing.do_bench`` medians;
``host us`` is the median host time of one guarded planning call, and of one whole cycle (issue
time, not waited on: the device drained before each), against unguarded: in a host-bound step
(GPT-OSS at bs 8) the guards' cost is their host time. Target: cycle overhead <= 3 %.

    python3 bench/bench_guards.py --out $OUT [--cases gemma4:64,gpt_oss_20b:8] [--ctx 8192]

Writes OUT/guards-<gpu>.md and .json (<gpu>: h200, h100 or gpu, from the device's name); prints
the table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from common import card_tag

VARIANTS = ("eager", "graph", "graph_padded")


def _host_us(fn, n: int = 30) -> float:
    """Median host wall time (us) of ``fn``'s call, the device drained before each call."""
    import torch

    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(ts)


def one_case(model: str, bs: int, a, do_bench) -> list[dict]:
    """Rows of one case: per variant, guards on and off (ms), overhead, planning host us."""
    import torch

    from common import batch_of, capture, setup, step_inputs

    cfg, pool, alloc, slots, backend = setup(model, bs, a.ctx, 1, backend_name=a.backend)
    batch = batch_of("decode", slots, alloc, bs, a.ctx)
    small = batch_of("decode", slots, alloc, bs - 1, a.ctx) if bs > 1 else batch
    qs, ks, vs, sinks = step_inputs(cfg, pool, batch.total_q)
    L = len(qs)

    def layers():
        for layer in range(L):
            out = backend.forward(qs[layer], ks[layer], vs[layer], layer, sinks=sinks)
        return out

    def eager():
        backend.init_forward_metadata(batch)
        return layers()

    eager()
    backend.raise_pending()
    backend.init_cuda_graph_state(bs, 1, max(r.prefix_len + r.nodes for r in batch.reqs))
    backend.init_forward_metadata_capture(bs, 1, "decode")
    graph, _ = capture(layers)

    def replay(b):
        def cycle():
            backend.init_forward_metadata_replay(b, bs, 1)
            graph.replay()
        return cycle

    cycles = {"eager": (eager, lambda: backend.init_forward_metadata(batch)),
              "graph": (replay(batch), lambda: backend.init_forward_metadata_replay(batch, bs, 1)),
              "graph_padded": (replay(small),
                               lambda: backend.init_forward_metadata_replay(small, bs, 1))}
    rows = []
    for var in VARIANTS:
        cycle, planning = cycles[var]
        times = {True: [], False: []}
        host = {}
        for _ in range(a.rounds):
            for guards in (False, True):
                backend.guards = guards
                cycle()  # the first cycle of the setting (a plan with or without checks)
                times[guards].append(do_bench(cycle, warmup=5, rep=a.rep, return_mode="median"))
                backend.raise_pending()  # guards found nothing (a clean batch)
        for guards in (False, True):
            backend.guards = guards
            host[guards] = _host_us(planning)
            backend.raise_pending()
            host[guards, "cycle"] = _host_us(cycle)  # the whole cycle's issue time
            backend.raise_pending()
        backend.guards = True
        ratios = [on / off for on, off in zip(times[True], times[False])]
        rows.append(dict(model=model, bs=bs, ctx=a.ctx, backend=a.backend, variant=var,
                         off_ms=statistics.median(times[False]),
                         on_ms=statistics.median(times[True]),
                         overhead_pct=100 * (statistics.median(ratios) - 1),
                         overhead_range_pct=[100 * (min(ratios) - 1), 100 * (max(ratios) - 1)],
                         planning_host_us_off=host[False], planning_host_us_on=host[True],
                         cycle_host_us_off=host[False, "cycle"],
                         cycle_host_us_on=host[True, "cycle"]))
        print(json.dumps(rows[-1]), flush=True)
    del graph
    torch.cuda.synchronize()
    return rows


def render(rows: list[dict], meta: dict) -> str:
    lines = [f"# Guards on against guards off ({card_tag(meta['gpu']).upper()})", "",
             f"Commit `{meta['commit']}`; {meta['gpu']}; torch {meta['torch']}; backend "
             f"{meta['backend']}; decode, ctx {meta['ctx']}, every layer of the model; medians of "
             f"{meta['rounds']} interleaved rounds. Target: overhead <= 3 %.", "",
             f"    {meta['command']}", "",
             "| model | bs | cycle | guards off ms | guards on ms | overhead % (range) "
             "| planning host us off | on | cycle host us off | on |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['bs']} | error: {r['error'][:150]} | | | | | | | |")
            continue
        lo, hi = r["overhead_range_pct"]
        lines.append(f"| {r['model']} | {r['bs']} | {r['variant']} | {r['off_ms']:.3f} | "
                     f"{r['on_ms']:.3f} | {r['overhead_pct']:+.1f} ({lo:+.1f} to {hi:+.1f}) | "
                     f"{r['planning_host_us_off']:.0f} | {r['planning_host_us_on']:.0f} | "
                     f"{r.get('cycle_host_us_off', float('nan')):.0f} | "
                     f"{r.get('cycle_host_us_on', float('nan')):.0f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for guards-<gpu>.md and .json")
    ap.add_argument("--cases", default="gemma4:64,gpt_oss_20b:8", help="model:bs,...")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--backend", default="flashinfer")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rep", type=int, default=40, help="do_bench's rep (ms) per timing")
    ap.add_argument("--commit", default="unknown")
    a = ap.parse_args()

    import torch
    from triton.testing import do_bench

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(commit=a.commit, gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                backend=a.backend, ctx=a.ctx, rounds=a.rounds,
                command=f"python3 bench/bench_guards.py --out $OUT --cases {a.cases} "
                        f"--ctx {a.ctx} --backend {a.backend} --rounds {a.rounds} --rep {a.rep}")
    rows = []
    for case in a.cases.split(","):
        model, bs = case.split(":")
        try:
            rows += one_case(model, int(bs), a, do_bench)
        except Exception as exc:  # noqa: BLE001 - a case's failure is a row
            rows.append(dict(model=model, bs=int(bs), error=f"{type(exc).__name__}: {exc}"[:300]))
            print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
        (out / f"guards-{card_tag(meta['gpu'])}.json").write_text(
            json.dumps(dict(meta=meta, rows=rows), indent=1))
    table = render(rows, meta)
    (out / f"guards-{card_tag(meta['gpu'])}.md").write_text(table)
    print(table)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
