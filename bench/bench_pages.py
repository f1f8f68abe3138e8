"""Page size 1 against the pool's own pages (16, 128): the decode step through the factory (H200).

    python3 bench/bench_pages.py --out $OUT --backends flashinfer,flash_attn [--page-sizes 1,16,128]
        [--models gpt_oss_20b] [--bs 64]

For each (model, backend, page size) the same requests are built (every layer, bf16, the
allocator's pages shuffled, out-of-window SWA pages evicted) and two things are timed
(``triton.testing.do_bench`` medians after warm-up and ``gc.freeze()``):

* **cycle**: ``init_forward_metadata`` + ``forward`` over every layer (K/V write included);
* **full layer**: the attention of one full-attention layer alone (``save_kv=False``), and its
  K/V bytes read (the group's key list × Hkv × D × 2 × 2 bytes) per second against the device copy
  bandwidth measured in the same run (read + written bytes of a 1 GiB copy per second): once as
  the wall time of the Python call, and once as its kernels' device time (`device_ms`: the call
  captured in a CUDA graph and replayed), since flash-attn-4's Python interface can take longer
  to launch a decode kernel than the kernel takes to read its K/V.

A page size the registry refuses is a row with the reason. Writes OUT/pages-h200.md, .json, .png.
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
from pathlib import Path

import torch

from common import (batch_of, case_args, device_ms, kv_bytes_read, setup, step_cycle,
                    step_inputs, table_head, variant_rows)

__all__ = ["one_case", "render"]


def one_case(model: str, backend_name: str, bs: int, ctx: int, page: int, do_bench,
             bw: float, device: str = "cuda") -> dict:
    """The decode cycle and one full layer's attention at one page size."""
    from swafactory.errors import ConfigError

    try:
        cfg, pool, alloc, slots, backend = setup(model, bs, ctx, 1, backend_name=backend_name,
                                                 device=device,
                                                 overrides=(f"backend.page_size={page}",))
    except ConfigError as e:
        return {"error": "refused: " + "; ".join(r.message for r in e.reasons)}
    batch = batch_of("decode", slots, alloc, bs, ctx)
    plan = backend.init_forward_metadata(batch)
    qs, ks, vs, sinks = step_inputs(cfg, pool, batch.total_q)
    cycle = step_cycle(backend, batch, qs, ks, vs, sinks)
    cycle()
    full = next((lay for lay, key in plan.layer_groups.items()
                 if plan.groups[key].window is None), None)
    gc.collect()
    gc.freeze()
    try:
        ms = do_bench(cycle, warmup=5, rep=40, return_mode="median")
        r = {"ms": ms, "floor_ms": kv_bytes_read(plan, pool) / bw * 1e3}
        if full is not None:
            backend.init_forward_metadata(batch)
            layer = lambda: backend.forward(qs[full], None, None, full,  # noqa: E731
                                            save_kv=False, sinks=sinks)
            layer()
            lms = do_bench(layer, warmup=10, rep=100, return_mode="median")
            sub = pool.sub_pool(full)
            n = plan.groups[plan.layer_groups[full]].tables.kv_indices.tensor.numel()
            nbytes = n * 2 * sub.num_kv_heads * sub.head_dim * sub.k_bufs[0].element_size()
            r.update(full_layer=full, full_ms=lms, full_gb=nbytes / 1e9,
                     full_of_copy=nbytes / (lms * 1e-3) / bw)
            if device == "cuda":  # the kernels alone, without the Python call's launch time
                dms, how = device_ms(layer, do_bench)
                r.update(full_device_ms=dms, full_device_by=how,
                         full_device_of_copy=nbytes / (dms * 1e-3) / bw)
        runs = getattr(backend.adapter, "runs", None)  # flash_attn: (view page size, tile) → n
        if runs is not None:
            r["views"] = {f"{view} tile {t[0]}x{t[1]}" if t else str(view): n
                          for (view, t), n in runs.items() if view is not None}
        elif hasattr(backend.adapter, "_page"):
            r["views"] = {str(backend.adapter._page): 1}
    finally:
        del backend, pool, alloc, slots, qs, ks, vs, cycle
        gc.unfreeze()
        if device == "cuda":
            torch.cuda.empty_cache()
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", default="flashinfer,flash_attn", help="comma-separated")
    ap.add_argument("--page-sizes", default="1,16,128", help="comma-separated")
    case_args(ap, models="gpt_oss_20b", bs="64")
    a = ap.parse_args()
    sizes = [int(x) for x in a.page_sizes.split(",")]
    rows, bw = variant_rows(a, a.backends, sizes, lambda m, b, bs, page, do_bench, bw: one_case(
        m, b, bs, a.ctx, page, do_bench, bw))
    meta = dict(commit=a.commit, gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                python=platform.python_version(), copy_tbs=bw / 1e12, ctx=a.ctx,
                page_sizes=sizes,
                command=f"python3 bench/bench_pages.py --out $OUT --backends {a.backends} "
                        f"--page-sizes {a.page_sizes} --models {a.models} --bs {a.bs} "
                        f"--ctx {a.ctx}")
    print(render(rows, meta, Path(a.out)))
    return 0


def render(rows: list[dict], meta: dict, out: Path) -> str:
    lines = [*table_head("Page size against the decode step, through the factory (H200)", meta),
             "| model | backend | bs | page | cycle ms | cycle / floor | full layer ms "
             "| full-layer K/V GB | full layer / copy bandwidth | full layer, device ms "
             "| device / copy bandwidth | cache views read |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for page in meta["page_sizes"]:
            x = r.get(str(page), {})
            if "ms" not in x:
                lines.append(f"| {r['model']} | {r['backend']} | {r['bs']} | {page} | "
                             f"{x.get('error', '-')[:200]} | | | | | | | |")
                continue
            full = (f"{x['full_ms']:.3f} | {x['full_gb']:.3f} | {100 * x['full_of_copy']:.0f}% | "
                    + (f"{x['full_device_ms']:.3f} ({x['full_device_by']}) | "
                       f"{100 * x['full_device_of_copy']:.0f}%" if "full_device_ms" in x
                       else "- | -")
                    if "full_ms" in x else "- | - | - | - | -")
            views = ", ".join(f"page {k}: {v}" for k, v in x.get("views", {}).items()) or "-"
            lines.append(f"| {r['model']} | {r['backend']} | {r['bs']} | {page} | {x['ms']:.2f} | "
                         f"{x['ms'] / x['floor_ms']:.2f}× | {full} | {views} |")
    lines += ["", "cycle: `init_forward_metadata` + `forward` over every layer; floor: the K/V "
              "bytes the step reads over the copy bandwidth; full layer: one full-attention "
              "layer's attention alone (no write), wall time of the Python call; full layer, "
              "device: the same layer's kernels alone, captured in a CUDA graph and replayed "
              "(or, where a library cannot be captured, its kernels' time from the torch "
              "profiler), so a library's host launch time is not counted as reading time. "
              "`do_bench` medians after `gc.freeze()`. "
              "cache views read: the page size of each paged run's K/V view (flash_attn's "
              "expanded passes read page size 1; decode has none) and, where flash_attn passed "
              "one to `_flash_attn_fwd`, its tile_mn (none: FA4's default tile)."]
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "pages-h200.md").write_text(text)
    (out / "pages-h200.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    _plot(rows, meta, out / "pages-h200.png")
    return text


def _plot(rows: list[dict], meta: dict, path: Path) -> None:
    """Cycle ms per page size, one line per (model, backend, bs)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for r in rows:
        pts = [(p, r[str(p)]["ms"]) for p in meta["page_sizes"] if "ms" in r.get(str(p), {})]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"{r['model']} {r['backend']} bs{r['bs']}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("page size")
    ax.set_ylabel("ms per decode step")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
