"""Drafts that accept, and faults by their symptom: the accept length of distilled drafts on a
pretrained target, clean and under every catalog fault, with the guards off.

For each model × backend × draft family, `run=generate` runs with
``run.target_weights=pretrained`` (the lag-copy language), ``spec.draft_weights=distilled``
(frozen_kv_mtp: the target's own weights), ``run.guards=false`` (an engine with bare kernels),
and each fault of the catalog.
A fault run's ``acceptance`` check compares its mean accept length with its clean twin's (the same
config with faults=none, run in the same process). Each row says whether the fault acted, what
caught it, and both accept lengths.

    python3 bench/bench_acceptance.py --out DIR [--models tiny] [--backends torch]
        [--families eagle,dflash] [--faults all] [--commit SHA]

Runs on a CPU (torch backend) or a GPU; writes DIR/acceptance-<device>.md, .json and .png and
prints the table. The first run trains the target and the drafts (cached: docs/cli.md).
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

FAMILIES = {  # spec overrides: 4-step chains, a tree, a DFlash block, FROZEN_KV
    "eagle": ["spec=eagle", "spec.num_steps=4", "spec.num_draft_tokens=5"],
    "eagle3": ["spec=eagle3"],
    "nextn": ["spec=nextn", "spec.num_steps=4", "spec.num_draft_tokens=5"],
    "standalone": ["spec=standalone"],
    "dflash": ["spec=dflash"],
    "frozen_kv_mtp": ["spec=frozen_kv_mtp", "spec.num_steps=4", "spec.num_draft_tokens=5"],
}
SMALL_WINDOW = {"gpt_oss_20b": ["model.sliding_window=16", "run.num_layers=4"]}
"""CPU only: GPT-OSS's 64 query heads make training at its 128-token window take minutes."""


def one(model: str, backend: str, family: str, fault: str, a) -> dict:
    import swafactory
    from swafactory.engine.run import run_generate
    from swafactory.errors import ConfigError

    over = [f"model={model}", f"backend={backend}", "run=generate", "run.guards=false",
            "run.target_weights=pretrained", f"faults={fault}", *FAMILIES[family],
            *([] if family == "frozen_kv_mtp" else ["spec.draft_weights=distilled"]),
            *(SMALL_WINDOW.get(model, []) if a.device == "cpu" else []),
            f"workload.device={a.device}", *a.override]
    row = {"model": model, "backend": backend, "family": family, "fault": fault}
    try:
        r = run_generate(swafactory.compose(over), progress=sys.stderr)
    except ConfigError as exc:
        return {**row, "status": "refused", "detail": str(exc).splitlines()[-1].strip()}
    acc = {c.name: c for c in r.checks}["acceptance"]
    return {**row, "status": r.status, "caught_by": r.caught_by, "acted": r.fault_acted,
            "accept": r.accept_len, "clean": r.accept_len_clean, "most": r.max_accept_len,
            "lossless": r.lossless, "acceptance": acc.status,
            "draft_top1": (r.draft_training or {}).get("heldout_top1"),
            "draft_s": (r.draft_training or {}).get("trained_s"),
            "detail": "" if r.status == "ok" else (r.inert or next(
                c.detail for c in r.checks if c.name == r.caught_by))[:160]}


def _f(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def render(rows: list[dict], meta: dict) -> str:
    lines = [f"# Drafts that accept: accept length under every fault ({meta['device']})", "",
             f"Commit `{meta['commit']}`, {meta['date']}. `python3 bench/bench_acceptance.py "
             f"{meta['argv']}`. Pretrained target (lag-copy language), distilled drafts "
             "(frozen_kv_mtp: the target's own weights), guards off. *clean twin*: the same "
             "config with faults=none, in the same process.", "",
             "| model | backend | family | fault | status | caught by | accept | clean twin | "
             "at most | draft top-1 | detail |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['backend']} | {r['family']} | `{r['fault']}` | "
                     f"{r['status']} | {r.get('caught_by') or '-'} | {_f(r.get('accept'))} | "
                     f"{_f(r.get('clean'))} | {r.get('most') or '-'} | "
                     f"{_f(r.get('draft_top1'))} | {r.get('detail', '').replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
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
    fig.savefig(path, dpi=80)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="directory for the record")
    ap.add_argument("--models", default="tiny", help="comma-separated model keys")
    ap.add_argument("--backends", default="torch", help="comma-separated backend keys")
    ap.add_argument("--families", default="eagle,dflash,frozen_kv_mtp", help=", ".join(FAMILIES))
    ap.add_argument("--faults", default="all", help="comma-separated fault keys, or all")
    ap.add_argument("--device", default="auto", help="workload.device: auto, cpu or cuda")
    ap.add_argument("--commit", default="unknown", help="the commit the record names")
    ap.add_argument("--override", action="append", default=[], help="one more override")
    a = ap.parse_args()
    import torch

    from swafactory.config.paths import conf_dir

    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    faults = sorted(p.stem for p in (conf_dir() / "faults").glob("*.yaml") if p.stem != "none") \
        if a.faults == "all" else a.faults.split(",")
    rows = []
    for model in a.models.split(","):
        for backend in a.backends.split(","):
            for family in a.families.split(","):
                for fault in ["none", *faults]:
                    rows.append(one(model, backend, family, fault, a))
                    r = rows[-1]
                    print(f"{model} {backend} {family} {fault}: {r['status']} "
                          f"{r.get('caught_by') or ''} accept {_f(r.get('accept'))} "
                          f"clean {_f(r.get('clean'))}", flush=True)
    dev = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    meta = {"device": dev, "commit": a.commit, "date": datetime.date.today().isoformat(),
            "argv": " ".join(sys.argv[1:])}
    tag = "h200" if "H200" in dev else "cpu" if dev == "cpu" else "gpu"
    a.out.mkdir(parents=True, exist_ok=True)
    text = render(rows, meta)
    (a.out / f"acceptance-{tag}.md").write_text(text)
    (a.out / f"acceptance-{tag}.json").write_text(json.dumps({"meta": meta, "rows": rows},
                                                             indent=1))
    plot(rows, a.out / f"acceptance-{tag}.png")
    print(text)


if __name__ == "__main__":
    main()
