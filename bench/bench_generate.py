"""`run=generate`: every backend × model × spec on the GPU, and drafts that accept under every
fault (CPU or GPU); their records.

    # on the GPU host: bench/gpu.sh OUT generate runs one lane per backend (one process each;
    # a lane runs its jobs one at a time), each lane this:
    python3 bench/gpu_generate.py run --backend flashinfer --rows OUT/rows_flashinfer.jsonl \
        --reports OUT/reports_flashinfer [--deadline S] [OVERRIDE ...]
    # back here
    python bench/gpu_generate.py render ROWS.jsonl ... --commit C --command "…" [--out STEM]

`run` composes ``run=generate backend=B model=M spec=S`` plus the overrides for each model and
spec, calls `swafactory.engine.run_generate` in this one process (transformers and the kernels
load once), and appends one JSON row per job as it ends, so a lane stopped at its deadline keeps
what finished. A refusal (ConfigError, CapacityError) is a row too, with its reasons. `render`
writes bench/results/gpu-generate.md and .json (and .png: accept length per job), or STEM.*.

    python3 bench/bench_generate.py acceptance --out DIR [--models tiny] [--backends torch]
        [--families eagle,dflash,frozen_kv_mtp] [--faults all] [--commit SHA]

`acceptance` runs each model × backend × draft family with ``run.target_weights=pretrained``
(the lag-copy language), ``spec.draft_weights=distilled`` (frozen_kv_mtp: the target's own
weights) and ``run.guards=false`` (an engine with bare kernels), clean and with each fault of the
catalog. A fault run's ``acceptance`` check compares its mean accept length with its clean
twin's (the same config with faults=none, in the same process); each row says whether the fault
acted, what caught it, and both accept lengths. It writes DIR/acceptance-<cpu|h200|h100|gpu>.md,
.json and .png. The first run trains the target and the drafts (cached: docs/cli.md).
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench/results/gpu-generate"
BACKENDS = ["flashinfer", "triton", "flash_attn"]
MODELS = ["gemma4", "gpt_oss_20b", "mistral_7b"]
SPECS = ["none", "eagle", "eagle3", "nextn", "standalone", "frozen_kv_mtp", "dflash"]


def _row(backend: str, model: str, spec: str) -> dict:
    return {"backend": backend, "model": model, "spec": spec}


def run_lane(args: argparse.Namespace) -> int:
    import torch

    import swafactory
    from swafactory.engine.report import write_generate
    from swafactory.engine.run import run_generate
    from swafactory.errors import CapacityError, ConfigError

    t0 = time.perf_counter()
    rows = Path(args.rows)
    rows.parent.mkdir(parents=True, exist_ok=True)
    for model in args.models.split(","):
        for spec in args.specs.split(","):
            left = args.deadline - (time.perf_counter() - t0)
            row = _row(args.backend, model, spec)
            if left < args.min_left:
                row.update(status="did not run", detail=f"lane deadline ({args.deadline} s)")
                _append(rows, row)
                continue
            overrides = ["run=generate", "workload=smoke", f"backend={args.backend}", f"model={model}",
                         f"spec={spec}", *args.overrides]
            row["overrides"] = overrides
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            try:
                report = run_generate(swafactory.compose(overrides))
            except (ConfigError, CapacityError) as exc:
                reasons = [str(r) for r in getattr(exc, "reasons", ())] or [str(exc)]
                row.update(status="refused", detail="; ".join(reasons))
            except Exception as exc:  # noqa: BLE001 - a lane records every job's end
                row.update(status="error", detail=f"{type(exc).__name__}: {exc}",
                           traceback=traceback.format_exc()[-3000:])
            else:
                folder = Path(args.reports) / f"{model}-{spec}"
                write_generate(report, folder)
                checks = {c.name: c.status for c in report.checks}
                row.update(
                    status=report.status, caught_by=report.caught_by, device=report.device,
                    dtype=report.dtype, architecture=report.architecture,
                    transformers=report.transformers,
                    logits_err=report.logits_max_rel_err, logits_tol=report.logits_tolerance,
                    logits_positions=report.logits_positions, lossless=report.lossless,
                    accept_len=report.accept_len, ideal=report.ideal_accept_len,
                    accept_steps=[a for q in report.requests for a in q.accept_lengths],
                    tokens=sum(len(q.generated_ids) for q in report.requests),
                    tokens_per_s=report.tokens_per_s, wall_s=report.wall_s,
                    overlap=report.overlap,
                    tokens_per_s_no_overlap=report.tokens_per_s_no_overlap,
                    reference_s=report.reference_s, checks=checks,
                    details={c.name: c.detail for c in report.checks if c.status != "skipped"},
                    serving=report.serving_model, draft=report.draft)
            row["job_s"] = time.perf_counter() - t
            if torch.cuda.is_available():
                row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            _append(rows, row)
            rate = "" if not row.get("tokens_per_s_no_overlap") else (
                f" tok/s {row['tokens_per_s']:.1f} overlap, "
                f"{row['tokens_per_s_no_overlap']:.1f} without")
            print(f"{args.backend} {model} {spec}: {row['status']} "
                  f"({row['job_s']:.1f} s){rate} {row.get('caught_by') or ''} "
                  f"{row.get('detail', '')}", flush=True)
    return 0


def _append(path: Path, row: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


def _fmt(x, spec: str = ".2e") -> str:
    return "-" if x is None else format(x, spec)


def render(args: argparse.Namespace) -> int:
    rows: dict[tuple, dict] = {}
    for p in args.rows:
        for line in Path(p).read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                rows[(r["backend"], r["model"], r["spec"])] = r  # a later row of a job wins
    ran = {k[0] for k in rows}, {k[1] for k in rows}  # the backends and models the lanes ran
    order = [(b, m, s) for b in BACKENDS for m in MODELS for s in SPECS
             if b in ran[0] and m in ran[1]]
    missing = [k for k in order if k not in rows]
    ok = [r for r in rows.values() if r["status"] == "ok"]
    first = next(iter(ok), {})
    lines = [
        "# run=generate on the H200: HF model definitions on swafactory attention",
        "",
        f"Commit `{args.commit}`; {first.get('device', '-')}; transformers "
        f"{first.get('transformers', '-')}, {first.get('dtype', '-')} weights and KV. "
        "Random weights (`torch.manual_seed(workload.seed)`), the model file's attention "
        "geometry (layer types, heads, head dims, window, sinks, scale) with `run.*` sizes "
        "(hidden size 64, the first 6 layers, vocab 256; Gemma 4's QK-norm weights at "
        "head_dim^-1/4: report.json's `post_init`), `workload=smoke` (4 requests of W + 8…128 "
        "prompt tokens and 6…12 new tokens, 2 running at once). Each job: greedy generation "
        "through the backend, "
        "then transformers' own eager forward of every request's tokens (logits), spec=none on "
        "the same backend (lossless), and for frozen_kv_mtp / dflash the torch backend "
        "(acceptance step by step).",
        "",
        "Commands (`bench/gpu.sh OUT generate`: one bench/gpu_generate.py lane per backend; "
        "each job is "
        "`python -m swafactory run=generate backend=B model=M spec=S`, run in the lane's "
        "process):",
        "",
        f"    {args.command}",
        "",
        f"{len(ok)} ok, {sum(r['status'] == 'failed' for r in rows.values())} failed, "
        f"{sum(r['status'] == 'refused' for r in rows.values())} refused by the registry, "
        f"{sum(r['status'] in ('error', 'did not run') for r in rows.values()) + len(missing)} "
        "did not run or stopped with an error.",
        "",
        "| backend | model | spec | status | logits err (tol) | lossless | accept len (ideal) "
        "| tok/s | job s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for k in order:
        r = rows.get(k)
        if r is None:
            lines.append(f"| {k[0]} | {k[1]} | {k[2]} | not run | - | - | - | - | - |")
            continue
        if r["status"] in ("refused", "error", "did not run"):
            detail = r.get("detail", "").replace("|", "/")[:160]
            lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {r['status']}: {detail} | - | - | - | - "
                         f"| - |")
            continue
        st = r["status"] if r["status"] == "ok" else f"failed ({r.get('caught_by')})"
        ll = {True: "yes", False: "no", None: "-"}[r.get("lossless")]
        acc = "-" if r.get("accept_len") is None else (
            f"{r['accept_len']:.2f} ({_fmt(r.get('ideal'), '.0f')})")
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {st} | {_fmt(r.get('logits_err'))} "
                     f"({_fmt(r.get('logits_tol'), '.0e')}) | {ll} | {acc} "
                     f"| {_fmt(r.get('tokens_per_s'), '.1f')} | {_fmt(r.get('job_s'), '.1f')} |")
    lines += [
        "",
        "tok/s: generated tokens over the main run's wall time, first-use kernel compiles and "
        "the HF model's per-layer Python included, at a scaled hidden size: an end-to-end "
        "figure of this small generator, not a kernel throughput. Lanes that ran at once "
        "shared one GPU.",
        "accept len: tokens committed per spec step (the root plus the accepted drafts); ideal: "
        "a self-speculating copy's (num_steps + 1 for a chain, the verified greedy depth + 1 for "
        "a tree); frozen_kv_mtp and dflash have none and are compared with the torch backend.",
    ]
    lines += [f"\n{n}" for n in args.note]
    excused = [r for r in rows.values() if "excused" in r.get("details", {}).get("acceptance", "")]
    if excused:  # steps below the ideal that a near tie explains, each named
        lines += ["", "## Steps below the ideal, excused as rounding", ""]
        lines += [f"- {r['backend']} {r['model']} {r['spec']}: {r['details']['acceptance']}"
                  for r in excused]
    failed = [r for r in rows.values() if r["status"] == "failed"]
    if failed:
        lines += ["", "## Failed checks", ""]
        for r in failed:
            d = r.get("details", {}).get(r.get("caught_by"), "")
            lines.append(f"- {r['backend']} {r['model']} {r['spec']}: {r.get('caught_by')}: {d}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    # the compact record: one row a line, without the serving config (each job's report has it)
    compact = [json.dumps({k: v for k, v in r.items() if k != "serving"}) for r in rows.values()]
    out.with_suffix(".json").write_text(
        f'{{"commit": {json.dumps(args.commit)}, "command": {json.dumps(args.command)}, '
        f'"rows": [\n' + ",\n".join(compact) + "\n]}\n")
    print("\n".join(lines))
    _plot([rows[k] for k in order if k in rows and rows[k].get("accept_steps")],
          out.with_suffix(".png"))
    return 0


def _plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(11, 4.5))
    for r in rows:
        ax.plot(r["accept_steps"], label=f"{r['backend']} {r['model']} {r['spec']}", lw=1)
    ax.set_xlabel("spec step (every request's, in order)")
    ax.set_ylabel("accept length")
    ax.legend(fontsize=5, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


FAMILIES = {  # spec overrides: 4-step chains, a tree, a DFlash block, FROZEN_KV
    "eagle": ["spec=eagle", "spec.num_steps=4", "spec.num_draft_tokens=5"],
    "eagle3": ["spec=eagle3"],
    "nextn": ["spec=nextn", "spec.num_steps=4", "spec.num_draft_tokens=5"],
    "standalone": ["spec=standalone"],
    "dflash": ["spec=dflash"],
    "frozen_kv_mtp": ["spec=frozen_kv_mtp", "spec.num_steps=4", "spec.num_draft_tokens=5"],
}
SWA_AS_FULL_CHUNK = 64
"""``--swa-as-full``: prefill chunk tokens, small enough that every shipped model's window need
fits its full share, so that the SWA pool can equal the full one."""
SMALL_WINDOW = {"gpt_oss_20b": ["model.sliding_window=16", "run.num_layers=4"]}
"""CPU only: GPT-OSS's 64 query heads make training at its 128-token window take minutes."""


def _one(model: str, backend: str, family: str, fault: str, a) -> dict:
    import swafactory
    from swafactory.engine.run import run_generate
    from swafactory.errors import ConfigError

    over = [f"model={model}", f"backend={backend}", "run=generate", "workload=smoke",
            "run.guards=false",
            "run.target_weights=pretrained", f"faults={fault}", *FAMILIES[family],
            *([] if family == "frozen_kv_mtp" else ["spec.draft_weights=distilled"]),
            *(SMALL_WINDOW.get(model, []) if a.device == "cpu" else []),
            f"workload.device={a.device}", *a.override]
    row = {"model": model, "backend": backend, "family": family, "fault": fault}
    if a.swa_as_full:  # an SWA pool as large as the full one (the draft's own pool's size)
        if not any(o.startswith("workload.chunk_size=") for o in a.override):
            # a request's SWA need counts its prefill chunk: at the default 256 the window's
            # need passed its full share (GPT-OSS, Gemma 4), the pool fell back to `auto`, larger
            # than the draft's, and the fault's slots indexed past the draft pool (H100, 1c30bca)
            over.append(f"workload.chunk_size={SWA_AS_FULL_CHUNK}")
        over.append("workload.swa_full_tokens_ratio=1")
    try:
        try:
            cfg = swafactory.compose(over)
            r = run_generate(cfg, progress=sys.stderr)
        except ConfigError as exc:
            if not (a.swa_as_full and any(r.field == "workload.swa_full_tokens_ratio"
                                          for r in exc.reasons)):
                raise
            # a request's window needs more SWA slots than its full share: `auto` is larger
            # than the full pool, so a pool fault may index past the draft's pool: said below
            row["swa_pool"] = "auto"
            r = run_generate(swafactory.compose(over[:-1]), progress=sys.stderr)
    except ConfigError as exc:
        return {**row, "status": "refused", "detail": str(exc).splitlines()[-1].strip()}
    acc = {c.name: c for c in r.checks}["acceptance"]
    return {**row, "status": r.status, "caught_by": r.caught_by, "acted": r.fault_acted,
            "accept": r.accept_len, "clean": r.accept_len_clean, "most": r.max_accept_len,
            "lossless": r.lossless, "acceptance": acc.status,
            "draft_top1": (r.draft_training or {}).get("heldout_top1"),
            "draft_s": (r.draft_training or {}).get("trained_s"),
            # a draft that cannot learn some prompt lengths, or a target off its rule, shows here
            "draft_worst_loss": max(((r.draft_training or {}).get("loss_by_prompt") or {})
                                    .values(), default=None),
            "target_follows": (r.draft_training or {}).get("target_follows"),
            "target_s": (r.target_training or {}).get("trained_s"),
            "detail": "" if r.status == "ok" else (r.inert or next(
                c.detail for c in r.checks if c.name == r.caught_by))[:160]}


def _f(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _s(x) -> str:
    return "-" if x is None else f"{x:.0f}"


def _render_acceptance(rows: list[dict], meta: dict) -> str:
    lines = [f"# Drafts that accept: accept length under every fault ({meta['device']})", "",
             f"Commit `{meta['commit']}`, {meta['date']}. `python3 bench/bench_generate.py "
             f"{meta['argv']}`. Pretrained target (lag-copy language), distilled drafts "
             "(frozen_kv_mtp: the target's own weights), guards off. *clean twin*: the same "
             "config with faults=none, in the same process. *trained s*: the target's and the "
             "draft's training time when they were trained (a cached model keeps its first).",
             "", "| model | backend | family | fault | status | caught by | accept | clean twin | "
             "at most | draft top-1 | trained s (target, draft) | detail |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['backend']} | {r['family']} | `{r['fault']}` | "
                     f"{r['status']} | {r.get('caught_by') or '-'} | {_f(r.get('accept'))} | "
                     f"{_f(r.get('clean'))} | {r.get('most') or '-'} | "
                     f"{_f(r.get('draft_top1'))} | {_s(r.get('target_s'))}, "
                     f"{_s(r.get('draft_s'))} | {_detail(r)} |")
    return "\n".join(lines) + "\n"


def _detail(r: dict) -> str:
    """A row's detail cell; it says when ``--swa-as-full`` could not make the SWA pool the full
    one's size (a pool fault's slots may then index past the draft's pool)."""
    d = r.get("detail", "").replace("|", "/")
    return ("SWA pool sized `auto`, larger than the draft's pool. " if r.get("swa_pool")
            else "") + d


def plot_acceptance(rows: list[dict], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    shown = [r for r in rows if r.get("accept") is not None][::-1]  # the first row on top
    clean = {(r["model"], r["backend"], r["family"]): r["accept"] for r in shown
             if r["fault"] == "none"}  # the faults=none row of the same config: its clean twin
    fig = Figure(figsize=(10, 0.3 * len(shown) + 1.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ys = range(len(shown))
    ax.barh([y + 0.2 for y in ys], [r["accept"] for r in shown], height=0.4, label="this run")
    ax.barh([y - 0.2 for y in ys], [r["clean"] if r.get("clean") is not None else
                                    clean.get((r["model"], r["backend"], r["family"]), 0)
                                    for r in shown], height=0.4, label="clean twin (faults=none)")
    ax.set_yticks(list(ys), [f"{r['model']} {r['backend']} {r['family']} {r['fault']}"
                             for r in shown], fontsize="small")
    ax.set_xlabel("mean accept length (tokens per spec step)")
    ax.legend(loc="lower right")
    fig.savefig(path, dpi=60)


def _isolated(model: str, backend: str, family: str, fault: str, a) -> dict:
    """One row in its own process: a fault that trips a device-side assert (an out-of-bounds
    index, as a real engine's illegal memory access) ends that process, not the sweep."""
    import subprocess

    cmd = [sys.executable, __file__, "acceptance-row", "--model", model, "--backend", backend,
           "--family", family, "--fault", fault, "--device", a.device,
           *[x for o in a.override for x in ("--override", o)],
           *(["--swa-as-full"] if a.swa_as_full else [])]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, text=True)
    last = done.stdout.strip().splitlines()[-1:] if done.stdout else []
    try:
        return json.loads(last[0])
    except (IndexError, ValueError):
        return {"model": model, "backend": backend, "family": family, "fault": fault,
                "status": "crashed", "detail": f"the row's process exited {done.returncode} "
                "(a device-side assert or a kill: its log is above)"}


def acceptance_row(a: argparse.Namespace) -> int:
    """The ``acceptance-row`` subcommand: one row, its JSON as the last stdout line."""
    try:
        row = _one(a.model, a.backend, a.family, a.fault, a)
    except Exception as exc:  # noqa: BLE001 - one row's crash is its result
        row = {"model": a.model, "backend": a.backend, "family": a.family, "fault": a.fault,
               "status": "error", "detail": f"{type(exc).__name__}: {exc}"[:160]}
    print(json.dumps(row), flush=True)
    return 0


def acceptance(a: argparse.Namespace) -> int:
    import torch

    from swafactory.config.paths import conf_dir

    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    faults = sorted(p.stem for p in (conf_dir() / "faults").glob("*.yaml") if p.stem != "none") \
        if a.faults == "all" else a.faults.split(",")
    dev = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    meta = {"device": dev, "commit": a.commit, "date": datetime.date.today().isoformat(),
            "argv": " ".join(sys.argv[1:])}
    from common import card_tag

    stem = a.out / f"acceptance-{card_tag(dev)}"
    a.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for model in a.models.split(","):
        for backend in a.backends.split(","):
            for family in a.families.split(","):
                for fault in ["none", *faults]:
                    rows.append(_isolated(model, backend, family, fault, a))
                    r = rows[-1]
                    print(f"{model} {backend} {family} {fault}: {r['status']} "
                          f"{r.get('caught_by') or ''} accept {_f(r.get('accept'))} "
                          f"clean {_f(r.get('clean'))}", flush=True)
                    # written after every row: a run stopped at its deadline keeps what ran
                    stem.with_suffix(".md").write_text(_render_acceptance(rows, meta))
                    stem.with_suffix(".json").write_text(json.dumps(
                        {"meta": meta, "rows": rows}, indent=1))
    plot_acceptance(rows, stem.with_suffix(".png"))
    print(stem.with_suffix(".md").read_text())
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one backend's lane on this host")
    r.add_argument("--backend", required=True, choices=BACKENDS + ["torch"])
    r.add_argument("--models", default=",".join(MODELS))
    r.add_argument("--specs", default=",".join(SPECS))
    r.add_argument("--rows", required=True)
    r.add_argument("--reports", required=True)
    r.add_argument("--deadline", type=float, default=480.0, help="seconds for the whole lane")
    r.add_argument("--min-left", type=float, default=20.0)
    r.add_argument("overrides", nargs="*", help="more overrides for every job")
    d = sub.add_parser("render", help="write bench/results/gpu-generate.{md,json,png}")
    d.add_argument("rows", nargs="+")
    d.add_argument("--commit", required=True)
    d.add_argument("--command", required=True)
    d.add_argument("--note", action="append", default=[], help="a paragraph after the table")
    d.add_argument("--out", default=str(OUT), help="path stem of the .md, .json and .png")
    c = sub.add_parser("acceptance", help="distilled drafts, clean and under every fault")
    c.add_argument("--out", type=Path, required=True, help="directory for the record")
    c.add_argument("--models", default="tiny", help="comma-separated model keys")
    c.add_argument("--backends", default="torch", help="comma-separated backend keys")
    c.add_argument("--families", default="eagle,dflash,frozen_kv_mtp", help=", ".join(FAMILIES))
    c.add_argument("--faults", default="all", help="comma-separated fault keys, or all")
    c.add_argument("--device", default="auto", help="workload.device: auto, cpu or cuda")
    c.add_argument("--commit", default="unknown", help="the commit the record names")
    c.add_argument("--override", action="append", default=[], help="one more override")
    c.add_argument("--swa-as-full", action="store_true",
                   help="an SWA pool at least as large as the full one (a GPU record: a pool "
                        "fault's full-space slots then stay in bounds and show as an "
                        "accept-length collapse, not a device-side assert)")
    o = sub.add_parser("acceptance-row", help="one acceptance row (acceptance runs each so)")
    for k in ("model", "backend", "family", "fault", "device"):
        o.add_argument(f"--{k}", required=True)
    o.add_argument("--override", action="append", default=[])
    o.add_argument("--swa-as-full", action="store_true")
    args = ap.parse_args(argv)
    return {"run": run_lane, "render": render, "acceptance": acceptance,
            "acceptance-row": acceptance_row}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
