"""Host cost of planning one forward on CPU, against batch size.

For each (model, mode, batch size) it builds the model's pools and allocator on CPU (every layer,
the allocator's pages shuffled), opens ``bs`` requests of ``ctx`` committed tokens, evicting
their out-of-window SWA slots as they grow (as bench_factory does), and times
``backend.init_forward_metadata(batch)`` of the torch backend (a fresh batch per call): the
median of ``--reps`` calls after warm-up, the batch sizes interleaved call by call. It also
counts the torch ops one `plan()` issues (a TorchDispatchMode counter; views excluded), per
forward and per layer group (the plan of that group's layers alone).

Planning reads the allocator's tables, never K/V, so the pools are built with 1 KV head of
head_dim 8 (``model.{swa,full}.num_kv_heads=1,head_dim=8``): the real geometry of gemma4 at
bs 256 would not fit a CPU host's memory, and it changes nothing the planner does.

    python bench/bench_planning.py --out OUT [--models gemma4,gpt_oss_20b] [--bs 1,8,64,256]
        [--ctx 512] [--reps 30]

Prints a table with the bs256 / bs8 ratio and writes OUT/planning-cpu.json (and .png when
matplotlib imports). The acceptance line: at bs 256 planning takes ≤ 3× planning at bs 8.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import common
from common import MODES, batch_of

GEOMETRY = ("model.swa.num_kv_heads=1", "model.swa.head_dim=8", "model.full.num_kv_heads=1",
            "model.full.head_dim=8")
# Ops that make no kernel launch on a GPU: views and metadata.
_VIEWS = {"view", "_unsafe_view", "slice", "select", "unbind", "alias", "detach", "lift_fresh",
          "as_strided", "expand", "unsqueeze", "squeeze", "reshape", "t", "split",
          "split_with_sizes", "narrow"}


class OpCounter(TorchDispatchMode):
    """Counts aten ops issued under it: ``total``, ``kernels`` (views excluded) and ``device``
    (kernels that touch a meta tensor, see `count_ops`)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = self.kernels = self.device = 0
        self.device_names: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        self.total += 1
        if name not in _VIEWS:
            self.kernels += 1
            flat = [*args, *(kwargs or {}).values(), *(out if isinstance(out, (tuple, list))
                                                         else (out,))]
            if any(isinstance(t, torch.Tensor) and t.is_meta for t in flat):
                self.device += 1
                self.device_names[name] = self.device_names.get(name, 0) + 1
        return out


def setup(model: str, bs: int, ctx: int, nodes: int, seed: int = 0):
    """`common.setup` on CPU with the torch backend and the small geometry."""
    return common.setup(model, bs, ctx, nodes, seed, backend_name="torch", device="cpu",
                        overrides=GEOMETRY)


def count_ops(backend, batch, plan_fn=None) -> dict:
    """Torch ops of one `plan()` of this forward, per forward and per layer group (the plan of
    that group's layers alone). ``device`` ops are those that would run on the accelerator: the
    plan is run once more with the table and the mapping on the ``meta`` device, and an op that
    touches a meta tensor is a device op (host arithmetic on small CPU tensors is not)."""
    from swafactory.kvcache.locs import SlotMapping
    from swafactory.metadata.batch import ForwardBatch
    from swafactory.resolve.source import KVSource, resolve_kv_source

    if plan_fn is None:
        from swafactory.metadata.plan import plan as plan_fn
    lmap = backend.view.active_pool.layers_mapping
    source = resolve_kv_source(backend.view, backend.cfg.backend.resolver)
    meta_batch = ForwardBatch.of(batch.mode, batch.reqs, batch.req_to_token.to("meta"),
                                 batch.full_id)
    meta_source = source if source is None else KVSource(
        source.pool, SlotMapping(source.mapping.full_id, source.mapping.swa_id,
                                 source.mapping.table.to("meta"), source.mapping.swa_size,
                                 source.mapping.page_size), source.rule)

    def run(mapping, meta: bool = False) -> OpCounter:
        with OpCounter() as c:
            if meta:
                plan_fn(meta_batch, mapping, backend.windows, meta_source)
            else:
                plan_fn(batch, mapping, backend.windows, source)
        return c

    whole, dev = run(lmap), run(lmap, meta=True)
    first = plan_fn(batch, lmap, backend.windows, source)
    per_group = {}
    for key in first.groups:
        layers = {j: v for j, v in lmap.items() if first.layer_groups[j] == key}
        per_group[key] = run(layers, meta=True).device
    return dict(ops=whole.kernels, device_ops=dev.device, device_ops_per_group=per_group,
                op_names=dict(sorted(dev.device_names.items(), key=lambda kv: -kv[1])))


def cases(model: str, mode: str, sizes: list[int], ctx: int, reps: int) -> list[dict]:
    """One row per batch size. The sizes' timings are interleaved (one call of each size per
    round), so load from other jobs on the machine falls on every size alike."""
    worlds = {}
    for bs in sizes:
        cfg, pool, alloc, slots, backend = setup(model, bs, ctx, MODES[mode])
        for _ in range(5):  # first use: lazy imports, allocator warm-up
            backend.init_forward_metadata(batch_of(mode, slots, alloc, bs, ctx))
        worlds[bs] = (alloc, slots, backend)
    times: dict[int, list[float]] = {bs: [] for bs in sizes}
    for _ in range(reps):
        for bs, (alloc, slots, backend) in worlds.items():
            batch = batch_of(mode, slots, alloc, bs, ctx)  # fresh, as an engine's each step
            t0 = time.perf_counter()
            backend.init_forward_metadata(batch)
            times[bs].append((time.perf_counter() - t0) * 1e3)
    rows = []
    for bs, (alloc, slots, backend) in worlds.items():
        plan = backend.plan
        keys = sum(g.tables.kv_indices.tensor.numel() for g in plan.groups.values())
        rows.append(dict(model=model, mode=mode, bs=bs, ctx=ctx,
                         planning_ms=statistics.median(times[bs]), min_ms=min(times[bs]),
                         groups=len(plan.groups), keys=keys,
                         **count_ops(backend, batch_of(mode, slots, alloc, bs, ctx))))
    return rows


def ratios(rows: list[dict], hi: int = 256, lo: int = 8) -> dict[tuple[str, str], float]:
    by = {(r["model"], r["mode"], r["bs"]): r["planning_ms"] for r in rows}
    return {(m, mo): by[(m, mo, hi)] / by[(m, mo, lo)]
            for (m, mo, b) in by if b == hi and (m, mo, lo) in by}


def render(rows: list[dict], meta: dict) -> str:
    bss = sorted({r["bs"] for r in rows})
    head = "| model | mode | " + " | ".join(f"bs {b} ms" for b in bss) + \
        " | bs256/bs8 | device ops/forward | device ops per group alone | all ops/forward |"
    lines = [f"Planning on CPU ({meta['cpu']}, {meta['threads']} threads, torch {meta['torch']}); "
             f"ctx {meta['ctx']}; median of {meta['reps']} `init_forward_metadata` calls (torch "
             "backend); op counts at bs 8 (views excluded; device ops: see `count_ops`).", "",
             head, "|" + "---|" * (head.count("|") - 1)]
    rat = ratios(rows)
    for key in sorted({(r["model"], r["mode"]) for r in rows}):
        rs = {r["bs"]: r for r in rows if (r["model"], r["mode"]) == key}
        ref = rs.get(8) or next(iter(rs.values()))
        cells = [f"{rs[b]['planning_ms']:.3f}" if b in rs else "" for b in bss]
        ratio = f"{rat[key]:.2f}×" if key in rat else ""
        groups = ", ".join(f"{k} {v}" for k, v in ref["device_ops_per_group"].items())
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(cells) +
                     f" | {ratio} | {ref['device_ops']} | {groups} | {ref['ops']} |")
    return "\n".join(lines) + "\n"


def _plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for model, mode in sorted({(r["model"], r["mode"]) for r in rows}):
        rs = sorted((r for r in rows if (r["model"], r["mode"]) == (model, mode)),
                    key=lambda r: r["bs"])
        ax.plot([r["bs"] for r in rs], [r["planning_ms"] for r in rs], marker="o",
                label=f"{model} {mode}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("init_forward_metadata ms (CPU)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="gemma4,gpt_oss_20b")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--bs", default="1,8,64,256")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's "
                    "default); 1 steadies timings on a shared machine")
    ap.add_argument("--label", default="", help="a name for this run in the JSON (e.g. a commit)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    rows = []
    for model in a.models.split(","):
        for mode in a.modes.split(","):
            for r in cases(model, mode, [int(x) for x in a.bs.split(",")], a.ctx, a.reps):
                rows.append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "op_names"}), flush=True)
    meta = dict(label=a.label, cpu=platform.processor() or platform.machine(),
                threads=torch.get_num_threads(), torch=torch.__version__,
                python=platform.python_version(), ctx=a.ctx, reps=a.reps,
                command=f"python bench/bench_planning.py --out OUT --models {a.models} "
                        f"--modes {a.modes} --bs {a.bs} --ctx {a.ctx} --reps {a.reps} "
                        f"--threads {a.threads}")
    text = render(rows, meta)
    print(text)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "planning-cpu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / "planning-cpu.md").write_text(text)
    _plot(rows, out / "planning-cpu.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
