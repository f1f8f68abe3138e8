"""fp8 e4m3 against bf16 KV: the whole decode step through the factory, per backend (H200).

    python3 bench/bench_fp8.py --out $OUT --backends flashinfer,triton,flashinfer+triton [--bs 64]

(``A+B``: kernel A on the SWA layers, B on the full ones, through ``backend.groups.full``).
For each (model, backend, batch size) the same requests are built twice, once per KV dtype (the
pools filled with random K/V; fp8 with the harness's per-layer scales), and one decode cycle is
timed each way: ``init_forward_metadata`` + ``forward`` over every layer (the K/V write, which
quantizes for fp8, included), after warm-up and ``gc.freeze()``. The floor is the K/V bytes the
step reads (an SWA layer only its window) over the copy bandwidth measured in the same run. A
combination the registry refuses (FlashInfer's fp8 at Gemma 4's D = 512 on SM90) is a row with
the reason. Writes OUT/fp8-h200.md and .json.
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
from pathlib import Path

import torch

from common import (batch_of, case_args, kv_bytes_read, setup, step_cycle, step_inputs,
                    table_head, variant_rows)

__all__ = ["DTYPES", "one_dtype", "render"]

DTYPES = ("bfloat16", "fp8_e4m3")


def one_dtype(model: str, backend_name: str, bs: int, ctx: int, dtype: str, do_bench,
              bw: float) -> dict:
    """The decode cycle of one KV dtype: ms, floor ms, K/V GB read."""
    from swafactory.errors import ConfigError
    from swafactory.harness.kv_quant import set_harness_scales

    swa, _, full = backend_name.partition("+")  # "flashinfer+triton": a kernel per group
    groups = (f"backend.groups.full={full}",) if full else ()
    try:
        cfg, pool, alloc, slots, backend = setup(model, bs, ctx, 1, backend_name=swa,
                                                 overrides=(f"backend.kv_dtype={dtype}", *groups))
    except ConfigError as e:
        return {"error": "refused: " + "; ".join(r.message for r in e.reasons)}
    set_harness_scales(pool)
    batch = batch_of("decode", slots, alloc, bs, ctx)
    plan = backend.init_forward_metadata(batch)
    qs, ks, vs, sinks = step_inputs(cfg, pool, batch.total_q)
    cycle = step_cycle(backend, batch, qs, ks, vs, sinks)
    cycle()
    gc.collect()
    gc.freeze()
    try:
        ms = do_bench(cycle, warmup=5, rep=40, return_mode="median")
        kv_bytes = kv_bytes_read(plan, pool)
    finally:
        del backend, pool, alloc, slots, qs, ks, vs, cycle
        gc.unfreeze()
        torch.cuda.empty_cache()
    return {"ms": ms, "floor_ms": kv_bytes / bw * 1e3, "kv_gb": kv_bytes / 1e9}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", default="flashinfer,triton",
                    help="comma-separated; A+B: kernel A on the SWA layers, B on the full ones")
    case_args(ap, models="gemma4", bs="64")
    a = ap.parse_args()
    rows, bw = variant_rows(a, a.backends, DTYPES, lambda m, b, bs, dt, do_bench, bw: one_dtype(
        m, b, bs, a.ctx, dt, do_bench, bw))
    meta = dict(commit=a.commit, gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                python=platform.python_version(), copy_tbs=bw / 1e12, ctx=a.ctx,
                command=f"python3 bench/bench_fp8.py --out $OUT --backends {a.backends} "
                        f"--models {a.models} --bs {a.bs} --ctx {a.ctx}")
    print(render(rows, meta, Path(a.out)))
    return 0


def render(rows: list[dict], meta: dict, out: Path) -> str:
    lines = [*table_head("fp8 e4m3 against bf16 KV, decode through the factory (H200)", meta),
             "| model | backend | bs | bf16 cycle ms | fp8 cycle ms | bf16 / fp8 | bf16 floor ms "
             "| fp8 floor ms | fp8 / its floor | fp8 K/V GB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    notes = []  # a refusal's whole reason, below the table (a cell would cut it)
    for r in rows:
        b, f = r.get("bfloat16", {}), r.get("fp8_e4m3", {})
        cells = []
        for dtype, x in (("bf16", b), ("fp8", f)):
            if "ms" in x:
                cells.append(f"{x['ms']:.2f}")
            elif "error" in x:
                notes.append(f"- {r['model']} × {r['backend']}, {dtype}: {x['error']}")
                cells.append(f"not run ({len(notes)}, below)")
            else:
                cells.append("-")
        speed = f"{b['ms'] / f['ms']:.2f}×" if "ms" in b and "ms" in f else "-"
        fl = [f"{x['floor_ms']:.2f}" if "ms" in x else "-" for x in (b, f)]
        eff = f"{f['ms'] / f['floor_ms']:.2f}×" if "ms" in f else "-"
        gb = f"{f['kv_gb']:.2f}" if "ms" in f else "-"
        lines.append(f"| {r['model']} | {r['backend']} | {r['bs']} | {cells[0]} | {cells[1]} | "
                     f"{speed} | {fl[0]} | {fl[1]} | {eff} | {gb} |")
    lines += ["", "cycle: `init_forward_metadata` + `forward` over every layer (the K/V write, "
              "quantizing for fp8, included), `do_bench` median after `gc.freeze()`; floor: the "
              "K/V bytes the step reads over the copy bandwidth."]
    if notes:
        lines += ["", "Not run:", "", *notes]
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8-h200.md").write_text(text)
    (out / "fp8-h200.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    _plot(rows, out / "fp8-h200.png")
    return text


def _plot(rows: list[dict], path: Path) -> None:
    """Bars per (model, backend, bs): bf16 and fp8 cycle, each beside its floor."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    done = [r for r in rows if "ms" in r.get("bfloat16", {}) or "ms" in r.get("fp8_e4m3", {})]
    if not done:
        return
    fig, ax = plt.subplots(figsize=(max(4, 1.6 * len(done)), 3.2))
    w = 0.2
    for i, r in enumerate(done):
        for j, (dt, color) in enumerate((("bfloat16", "tab:blue"), ("fp8_e4m3", "tab:orange"))):
            x = r.get(dt, {})
            if "ms" in x:
                ax.bar(i + (2 * j - 1.5) * w, x["ms"], w, color=color,
                       label=f"{dt} cycle" if i == 0 else None)
                ax.bar(i + (2 * j - 0.5) * w, x["floor_ms"], w, color=color, alpha=0.35,
                       label=f"{dt} floor" if i == 0 else None)
    ax.set_xticks(range(len(done)), [f"{r['model']}\n{r['backend']} bs{r['bs']}" for r in done],
                  fontsize=7)
    ax.set_ylabel("ms per decode step")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
