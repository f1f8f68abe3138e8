"""The factory against raw FlashInfer on the same pools and indices, and both against the floor.

For each (model, mode, batch size) it builds the model's real pools (every layer, bf16, the
allocator's pages shuffled), opens ``bs`` requests of ``ctx`` tokens, evicts their out-of-window
SWA slots, and fills the pools with random K/V. Then one step, three ways:

* **factory cycle**: ``backend.init_forward_metadata(batch)`` + ``backend.forward(q, k, v, l)``
  for every layer (the public API an engine calls; it writes each layer's new K/V);
* **raw cycle**: FlashInfer wrappers an engine would hold, planned once per layer group from the
  factory's own tables (the same indices; the same custom mask for verify), then per layer the
  K/V write (``index_put``) and ``wrapper.run``; sinks by the same exact LSE epilogue
  (`sink_epilogue`, launched as an engine calling a Triton kernel would: ``kernel[grid](…)``;
  the factory's adapters launch the same kernel through its compiled handle,
  `swafactory.kernels.triton_launch`);
* **floor**: the K/V bytes the step must read (every group's index list, so an SWA layer counts
  only its window, × its layers) over a device copy measured in the same run.

Planning is the host wall time of ``init_forward_metadata`` alone. The outputs of the last layer
must agree (max |factory - raw|, reported; bit-identical is expected where the calls are the
same). Times are ``triton.testing.do_bench`` medians after warm-up.

    python3 bench/bench_factory.py --out $OUT [--models gemma4,gpt_oss_20b] [--modes ...] [--bs ...]
        [--ctx 8192[,32768,...]] [--triton] [--auto]

``--triton`` times the same step through ``backend=triton``; ``--auto`` through ``backend=auto``
tuned on this GPU at each case's geometry (its cycle against the best fixed one, its first
tuning's seconds, its choices). Verify modes run under their spec (`common.SPEC_OF`: a chain
spec's graph buckets are causal, a tree spec's masked).

The same cases with fp8 K/V or other page sizes: bench/bench_fp8.py, bench/bench_pages.py.

Writes OUT/factory-<card>.md, .json and .png (<card>: h200, h100 or gpu, from the device's name;
the plot: step time against batch size for factory, raw and floor, and planning time).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import statistics
import time
from pathlib import Path

import torch

from common import (LN2, MODES, SPEC_OF, batch_of, card_tag, config_of, copy_bandwidth,
                    graph_case, host_ms, kv_bytes_read, setup, step_cycle, step_inputs)

__all__ = ["Raw", "one_case", "render"]


def triton_cycle(cfg, pool, batch, qs, ks, vs, sinks, factory_out, do_bench) -> dict:
    """The same step through ``backend=triton`` on the same pools (our Triton kernels: the
    goal's "our Triton verify against FlashInfer's custom-mask verify"): cycle time and the
    largest difference from the flashinfer factory's last-layer output."""
    import swafactory

    tcfg = config_of(cfg.model.name, "triton")
    tb = swafactory.build_backend(tcfg, pools=pool)
    cycle = step_cycle(tb, batch, qs, ks, vs, sinks)

    diff = float((cycle().float() - factory_out.float()).abs().max())
    out = dict(triton_ms=do_bench(cycle, warmup=5, rep=40, return_mode="median"),
               triton_diff=diff)
    if batch.mode == "decode":  # its graphs replay decode buckets (kernels/triton/adapter.py)
        g = graph_case(tb, batch, qs, ks, vs, sinks, cycle, do_bench)
        out.update({f"triton_{k}": v for k, v in g.items()})
        apart = swafactory.build_backend(tcfg, pools=pool)  # the K/V stored by index_copy_
        apart.adapter.fuses_writes = False
        g = graph_case(apart, batch, qs, ks, vs, sinks, cycle, do_bench)
        out.update({f"triton_apart_{k}": v for k, v in g.items()})
    return out


AUTO_WORKLOAD = ("workload.chunk_size=8192", "workload.output_len=[1024,1024]")
"""The serving mix auto is tuned for (its passes' weights, `registry.tuning.pass_weights`):
prompts of the case's context in 8K chunks, 1024 tokens generated per request."""


def auto_cycle(model: str, mode: str, bs: int, ctx: int, pool, batch, qs, ks, vs, sinks,
               factory_out, do_bench, cache_dir: Path) -> dict:
    """The same step through ``backend=auto`` tuned on this GPU at the case's geometry (each
    group's family and each pass's kernel by measured speed, `swafactory.backend.timing`), on the same
    pools: its cycle, its graph replay, the tuning's seconds (the first tuning of this geometry,
    or the cached one) and the choices."""
    import swafactory
    from swafactory.backend.timing import autotuned
    from swafactory.registry.tuning import TuneCache
    from swafactory.registry.device import detect_device

    asked = swafactory.compose([f"model={model}", "backend=auto", "spec=none",  # not validated:
                                "workload=smoke", "workload.device=cuda",
                                *SPEC_OF.get(mode, ()),  # validate
                                f"workload.max_running_requests={bs}",  # would fix auto
                                f"workload.context_len={ctx}", *AUTO_WORKLOAD])
    device = detect_device("cuda")
    tuned, tuning = autotuned(asked, device, TuneCache(cache_dir / "autotune.json"))
    cfg = swafactory.validate(tuned, device)
    ab = swafactory.build_backend(cfg, pools=pool)
    cycle = step_cycle(ab, batch, qs, ks, vs, sinks)
    out = dict(auto_ms=do_bench(cycle, warmup=5, rep=40, return_mode="median"),
               auto_diff=float((cycle().float() - factory_out.float()).abs().max()),
               auto_tune_s=None if tuning is None else tuning.tune_s,
               auto_cached=None if tuning is None else tuning.cached,
               auto_choices=[] if tuning is None else tuning.lines(),
               auto_costliest=[] if tuning is None else tuning.costliest())
    g = graph_case(ab, batch, qs, ks, vs, sinks, cycle, do_bench)
    out.update({f"auto_{k}": v for k, v in g.items()})
    return out


class Raw:
    """FlashInfer wrappers as an engine holds them: one per layer group, planned per step."""

    def __init__(self, cfg, pool, plan, decode: bool) -> None:
        import flashinfer

        from swafactory.kernels.flashinfer import custom_mask

        self.ws = torch.zeros(512 * 2**20, dtype=torch.uint8, device="cuda")
        self.groups = {}
        for key, gp in plan.groups.items():
            t = gp.tables
            w = (flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.ws, "NHD",
                                                               use_tensor_cores=True)
                 if decode else flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.ws, "NHD"))
            self.groups[key] = dict(
                w=w, window=gp.window, qo=t.qo_indptr.cpu().int(), kv=t.kv_indptr.cpu().int(),
                idx=t.kv_indices.tensor.int(), last=torch.ones(t.qo_indptr.numel() - 1,
                                                               dtype=torch.int32),
                mask=None if decode else custom_mask(t, gp.window),
                write=gp.write_locs.tensor.long())
        self.cfg, self.pool, self.plan, self.decode = cfg, pool, plan, decode

    def plan_all(self, hq: int) -> None:
        m = self.cfg.model
        for key, g in self.groups.items():
            geo = m.swa if key.startswith("swa") else (m.full or m.swa)
            scale = m.softmax_scale or geo.head_dim ** -0.5
            common = dict(q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
                          sm_scale=scale, logits_soft_cap=m.logit_softcap)
            wl = -1 if g["window"] is None else g["window"] - 1
            if self.decode:
                g["w"].plan(g["kv"], g["idx"], g["last"], hq, geo.num_kv_heads, geo.head_dim,
                            1, window_left=wl, **common)
            else:
                g["w"].plan(g["qo"], g["kv"], g["idx"], g["last"], hq, geo.num_kv_heads,
                            geo.head_dim, 1, custom_mask=g["mask"], window_left=-1, **common)

    def layer(self, layer: int, q, k, v, sinks=None):
        from swafactory.kernels.triton.sinks import sink_epilogue

        g = self.groups[self.plan.layer_groups[layer]]
        k_buf, v_buf, _ = self.pool.get_kv(layer)
        k_buf[g["write"]] = k
        v_buf[g["write"]] = v
        if sinks is None:
            return g["w"].run(q, (k_buf.unsqueeze(1), v_buf.unsqueeze(1)))
        o, lse = g["w"].run(q, (k_buf.unsqueeze(1), v_buf.unsqueeze(1)), return_lse=True)
        return sink_epilogue(o, lse, sinks, lse_scale=LN2)  # the same one-kernel epilogue


def one_case(model: str, mode: str, bs: int, ctx: int, do_bench, bw: float,
             triton: bool = False, rounds: int = 5, auto: Path | None = None) -> dict:
    nodes = MODES[mode]
    cfg, pool, alloc, slots, backend = setup(model, bs, ctx, nodes,
                                             overrides=SPEC_OF.get(mode, ()))
    m = cfg.model
    batch = batch_of(mode, slots, alloc, bs, ctx)
    plan = backend.init_forward_metadata(batch)
    L = m.num_layers
    qs, ks, vs, sinks = step_inputs(cfg, pool, batch.total_q)

    factory = step_cycle(backend, batch, qs, ks, vs, sinks)
    raw = Raw(cfg, pool, plan, decode=nodes == 1)

    def raw_cycle():
        raw.plan_all(m.num_attention_heads)
        for layer in range(L):
            out = raw.layer(layer, qs[layer], ks[layer], vs[layer], sinks)
        return out

    diff = float((factory().float() - raw_cycle().float()).abs().max())
    planning_unfrozen = host_ms(lambda: backend.init_forward_metadata(batch), 30)
    # What engines do after warm-up (vLLM's freeze_gc_heap, sglang's freeze_gc): the startup
    # heap leaves the collector's generations, so a step's young objects no longer trigger
    # collections that walk it. Both cycles are timed under it.
    gc.collect()
    gc.freeze()
    # Interleaved rounds: a shared host's speed drifts within seconds (raw's Gemma 4 bs-8 cycle
    # was 4.3 ms on one call and 8.2 on another), so each round times both cycles back to back
    # and the ratio is the median of the rounds' ratios.
    pairs = [(do_bench(factory, warmup=5, rep=40, return_mode="median"),
              do_bench(raw_cycle, warmup=5, rep=40, return_mode="median"))
             for _ in range(rounds)]
    t_f = statistics.median(f for f, _ in pairs)
    t_r = statistics.median(r for _, r in pairs)
    ratios = sorted(f / r for f, r in pairs)
    graph = graph_case(backend, batch, qs, ks, vs, sinks, factory, do_bench)
    tri = {}
    if triton:  # the same step through our Triton kernels (a decode cycle with no FlashInfer plan)
        tri = triton_cycle(cfg, pool, batch, qs, ks, vs, sinks, factory(), do_bench)
        tri["triton_vs_factory"] = tri["triton_ms"] / t_f
    if auto is not None:  # backend=auto, tuned here; its cache under ``auto``
        tri.update(auto_cycle(model, mode, bs, ctx, pool, batch, qs, ks, vs, sinks, factory(),
                              do_bench, auto))
        best = min(t_f, tri.get("triton_ms", math.inf))
        tri["auto_vs_best"] = tri["auto_ms"] / best
    planning = host_ms(lambda: backend.init_forward_metadata(batch), 30)
    kv_bytes = kv_bytes_read(plan, pool)
    floor = kv_bytes / bw * 1e3  # the step reads at most as fast as a copy moves bytes
    del backend, pool, alloc, slots, raw, qs, ks, vs, factory
    gc.unfreeze()  # the case's objects may be collected again
    torch.cuda.empty_cache()
    return dict(model=model, mode=mode, bs=bs, ctx=ctx, layers=L, factory_ms=t_f, raw_ms=t_r,
                ratio=statistics.median(ratios), ratio_range=(ratios[0], ratios[-1]),
                rounds=rounds, planning_ms=planning, planning_unfrozen_ms=planning_unfrozen,
                floor_ms=floor,
                kv_gb=kv_bytes / 1e9, factory_vs_floor=t_f / floor, max_abs_diff=diff,
                **graph, graph_vs_floor=graph.get("replay_ms", math.nan) / floor, **tri)


def _spread(r: dict) -> str:
    """" (lo–hi)" of the rounds' ratios, where there were several."""
    lo, hi = r.get("ratio_range", (None, None))
    return "" if lo is None or r.get("rounds", 1) < 2 else f" ({lo:.2f}–{hi:.2f})"


def render(rows: list[dict], meta: dict, out: Path) -> str:
    lines = [f"# The factory against raw FlashInfer ({card_tag(meta['gpu']).upper()})", "",
             f"Commit `{meta['commit']}`; {meta['gpu']}; torch {meta['torch']}, flashinfer "
             f"{meta['flashinfer']}; copy bandwidth {meta['copy_tbs']:.2f} TB/s (read + write). "
             f"bf16, ctx {meta['ctx']} (a batch whose pools do not fit the GPU runs at the largest "
             "power-of-two ctx that does: the ctx column), every layer of the model.", "",
             f"    {meta['command']}", "",
             "| model | mode | bs | ctx | factory cycle ms | raw cycle ms | factory / raw | planning ms "
             "| floor ms | factory / floor | graph replay ms | replay / floor | graph cycle ms "
             "| K/V GB | max abs diff (eager, graph) | triton cycle ms | triton / factory "
             "| triton / raw | planning ms, GC not frozen |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['mode']} | {r['bs']} | {r.get('ctx', '')} | "
                         f"error: {r['error'][:120]} | | | | | | | | | | | | | | |")
            continue
        lines.append(f"| {r['model']} | {r['mode']} | {r['bs']} | {r['ctx']} | "
                     f"{r['factory_ms']:.2f} | "
                     f"{r['raw_ms']:.2f} | {r['ratio']:.2f}×{_spread(r)} | {r['planning_ms']:.2f} | "
                     f"{r['floor_ms']:.2f} | {r['factory_vs_floor']:.2f}× | "
                     + (f"{r['replay_ms']:.2f} | {r['graph_vs_floor']:.2f}× | "
                        f"{r['graph_cycle_ms']:.2f} | " if "replay_ms" in r else
                        f"graph: {r.get('graph_error', '-')[:80]} | | | ")
                     + f"{r['kv_gb']:.2f} | {r['max_abs_diff']:.1e}, "
                     f"{r.get('graph_diff', math.nan):.1e} |"
                     + (f" {r['triton_ms']:.2f} | {r['triton_vs_factory']:.2f}× | "
                        f"{r['triton_ms'] / r['raw_ms']:.2f}× |"
                        if "triton_ms" in r else " | | |")
                     + f" {r.get('planning_unfrozen_ms', math.nan):.2f} |")
    lines += ["", "factory / raw: the median over interleaved rounds (each times both cycles, "
              "back to back) of the rounds' ratios, their range in brackets; the cycle columns "
              "are the rounds' medians. "
              "factory cycle: `init_forward_metadata` + `forward` over every layer (K/V write "
              "included); raw cycle: the FlashInfer wrappers' `plan` per layer group + per layer "
              "the K/V write and `run`, on the same pools and indices (sinks: the same "
              "epilogue kernel, through Triton's `kernel[grid]` dispatch where the factory "
              "launches it through its compiled handle); planning: host wall time "
              "of `init_forward_metadata` alone (median of 30, synchronized); every time but the "
              "last column is taken after `gc.freeze()`, as engines freeze their startup heap "
              "after warm-up (planning with the GC not frozen: its own column); floor: the K/V "
              "bytes the step reads over the copy bandwidth (bytes read + written per second "
              "by a device copy); graph replay: the whole step (every layer's K/V write and "
              "attention) captured once through `init_forward_metadata_capture`, replayed after "
              "`init_forward_metadata_replay` (graph cycle: both); triton cycle (``--triton``): "
              "the same cycle through `backend=triton` on the same pools."]
    lines += verify_over_decode(rows, meta)
    lines += auto_rows(rows)
    lines += triton_graphs(rows)
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"factory-{card_tag(meta['gpu'])}"
    stem.with_suffix(".md").write_text(text)
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    _plot(rows, stem.with_suffix(".png"))
    return text


def triton_graphs(rows: list[dict]) -> list[str]:
    """Decode through ``backend=triton`` captured as an engine captures its step (``--triton``):
    its graph replay over the floor, with the K/V written by the decode kernel and, beside it,
    stored apart (two ``index_copy_`` per layer), and the flashinfer factory's replay."""
    rs = [r for r in rows if "triton_replay_ms" in r or "triton_graph_error" in r]
    if not rs:
        return []
    lines = ["", "Decode through `backend=triton` as an engine captures it (graph replay of every "
             "layer's K/V write and attention), against the floor of the same run:", "",
             "| model | bs | floor ms | triton replay ms (K/V written by the kernel) | / floor | "
             "K/V stored apart, replay ms | / floor | flashinfer factory replay ms | / floor | "
             "max abs diff (graph vs eager) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rs:
        f = r["floor_ms"]

        def cell(key: str) -> str:
            v = r.get(key)
            return f"{v:.3f} | {v / f:.2f}×" if v is not None else \
                f"{r.get(key.replace('replay_ms', 'graph_error'), '-')[:60]} |"

        lines.append(f"| {r['model']} | {r['bs']} | {f:.3f} | {cell('triton_replay_ms')} | "
                     f"{cell('triton_apart_replay_ms')} | {cell('replay_ms')} | "
                     f"{r.get('triton_graph_diff', math.nan):.1e} |")
    return lines


def auto_rows(rows: list[dict]) -> list[str]:
    """``--auto``: backend=auto's cycle against the best fixed backend of the same run, its
    first tuning's cost, and what it chose."""
    rs = [r for r in rows if "auto_ms" in r]
    if not rs:
        return []
    lines = ["", "`backend=auto` tuned on this GPU at each case's geometry, for a serving mix of "
             "the case's context prefilled in 8K chunks and 1024 tokens generated per request "
             "(target: within 3 % of the best fixed choice; the first tuning ≤ 30 s):", "",
             "| model | mode | bs | auto cycle ms | best fixed ms | auto / best | auto replay ms "
             "| tuning s | choices |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rs:
        best = min(r["factory_ms"], r.get("triton_ms", math.inf))
        tune = ("-" if r.get("auto_tune_s") is None else
                f"{r['auto_tune_s']:.1f}" + (" (cached)" if r.get("auto_cached") else
                                             "".join(f"<br>{c}" for c in
                                                     r.get("auto_costliest", [])[:2])))
        lines.append(f"| {r['model']} | {r['mode']} | {r['bs']} | {r['auto_ms']:.2f} | "
                     f"{best:.2f} | {r['auto_vs_best']:.2f}× | "
                     f"{r.get('auto_replay_ms', math.nan):.2f} | {tune} | "
                     f"{'; '.join(r.get('auto_choices', []))[:300]} |")
    return lines


def verify_over_decode(rows: list[dict], meta: dict) -> list[str]:
    """The verify goal: each verify/draft cycle over the decode cycle of the same model
    and batch, both through the factory, from the same run."""
    dec = {(r["model"], r["bs"], r["ctx"]): r["factory_ms"] for r in rows
           if r.get("mode") == "decode" and "factory_ms" in r}
    out = [(r["model"], r["bs"], r["mode"], r["factory_ms"], dec[(r["model"], r["bs"], r["ctx"])])
           for r in rows if r.get("mode") != "decode" and "factory_ms" in r
           and (r["model"], r["bs"], r["ctx"]) in dec]
    if not out:
        return []
    lines = ["", f"Each mode's factory cycle over the decode cycle (same model, bs, run). "
             f"Head-dim-512 verify tiles: {meta.get('verify_tile', 'unknown')}.", "",
             "| model | bs | mode | factory cycle ms | decode cycle ms | / decode |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {m} | {bs} | {mode} | {f:.2f} | {d:.2f} | {f / d:.2f}× |"
              for m, bs, mode, f, d in out]
    return lines


def _plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ok = [r for r in rows if "error" not in r]
    keys = sorted({(r["model"], r["mode"]) for r in ok})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for model, mode in keys:
        rs = sorted((r for r in ok if (r["model"], r["mode"]) == (model, mode)),
                    key=lambda r: r["bs"])
        bs = [r["bs"] for r in rs]
        line, = axes[0].plot(bs, [r["factory_ms"] for r in rs], marker="o",
                             label=f"{model} {mode} factory")
        axes[0].plot(bs, [r["raw_ms"] for r in rs], ls="--", color=line.get_color(),
                     label="raw")
        axes[0].plot(bs, [r["floor_ms"] for r in rs], ls=":", color=line.get_color(),
                     label="floor")
        axes[1].plot(bs, [r["planning_ms"] for r in rs], marker="o", label=f"{model} {mode}")
    for ax, title in zip(axes, ("step (all layers) ms", "planning ms (host)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_title(title)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=55)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="gemma4,gpt_oss_20b")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--bs", default="1,8,64,256")
    ap.add_argument("--ctx", default="8192",
                    help="context tokens per request, a comma list (long context: 32768,131072)")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--rounds", type=int, default=5,
                    help="interleaved factory/raw timings per case; the ratio is their median")
    ap.add_argument("--deadline", type=float, default=420.0, help="seconds: no case starts later")
    ap.add_argument("--triton", action="store_true",
                    help="also time backend=triton on every step (decode, verify, draft)")
    ap.add_argument("--auto", action="store_true",
                    help="also time backend=auto, tuned on this GPU at each case's geometry "
                         "(its first tuning's seconds; the cache in OUT/autotune)")
    a = ap.parse_args()
    import flashinfer
    from triton.testing import do_bench

    t0 = time.perf_counter()
    bw = copy_bandwidth(do_bench)
    rows = []
    cases = [(model, mode, bs, c) for c in (int(x) for x in a.ctx.split(","))
             for model in a.models.split(",") for mode in a.modes.split(",")
             for bs in (int(x) for x in a.bs.split(","))]
    for model, mode, bs, ctx in cases:
        if time.perf_counter() - t0 > a.deadline:
            rows.append(dict(model=model, mode=mode, bs=bs, ctx=ctx,
                             error="not run: deadline"))
            continue
        while True:  # a batch whose pools do not fit runs at the largest ctx that does
            oom = None
            try:
                r = one_case(model, mode, bs, ctx, do_bench, bw, a.triton, a.rounds,
                             Path(a.out) / "autotune" if a.auto else None)
            except torch.cuda.OutOfMemoryError as exc:
                oom = str(exc).split(". ")[0]
            except Exception as exc:  # noqa: BLE001 - a case's failure is a row
                r = dict(model=model, mode=mode, bs=bs, ctx=ctx,
                         error=f"{type(exc).__name__}: {exc}")
            # the failed case's frames are gone once its exception is: free them now
            gc.unfreeze()
            gc.collect()
            torch.cuda.empty_cache()
            if oom is None:
                break
            if ctx > 1024:
                ctx //= 2
                continue
            r = dict(model=model, mode=mode, bs=bs, ctx=ctx,
                     error=f"does not fit one GPU even at ctx {ctx}: {oom}")
            break
        rows.append(r)
        print(json.dumps(r), flush=True)
    from swafactory.kernels.cuda.launch import cuda_kernels_available

    tile = ("our CUDA kernel (kernels/cuda/verify_d512.cu)"
            if cuda_kernels_available(torch.device("cuda")) else
            "the Triton tile (the CUDA kernel is off: SWAFACTORY_CUDA_KERNELS=0 or no nvcc)")
    meta = dict(commit=a.commit, gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                verify_tile=tile,
                flashinfer=flashinfer.__version__, python=platform.python_version(),
                copy_tbs=bw / 1e12, ctx=a.ctx,
                command=f"python3 bench/bench_factory.py --out $OUT --models {a.models} "
                        f"--modes {a.modes} --bs {a.bs} --ctx {a.ctx} --rounds {a.rounds}"
                        + (" --triton" if a.triton else "") + (" --auto" if a.auto else ""))
    print(render(rows, meta, Path(a.out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
