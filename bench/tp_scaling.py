"""The tensor-parallel scaling record, from the sweep folders `bench/gpu.sh OUT tp` packs.

    tar xzf tp.tgz -C /tmp/tp && python bench/tp_scaling.py /tmp/tp/*

Reads every job's result.json (or report.json, where a job wrote no result.json) under the given
folders and writes bench/results/tp-scaling.md and .json (and .png when matplotlib is there): one
row per (backend, spec, model, tp) of the sweep: ok, refused or failed with the job's reason, or
that it did not finish or did not run. Reports are read as plain JSON, so a report of an older or
newer harness still renders (a figure it lacks shows as "-").
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench/results/tp-scaling"
BACKENDS = ["flashinfer", "triton"]
SPECS = ["none", "eagle3", "frozen_kv_mtp", "dflash"]
MODELS = ["gemma4", "gpt_oss_20b"]
TPS = [1, 2]
ISSUE_COMMAND = ("python -m swafactory -m backend=flashinfer,triton spec=none,eagle3,frozen_kv_mtp,"
                 "dflash model=gemma4,gpt_oss_20b workload=serve parallel.tp=1,2")
FIRST_USE = "first_use_s"
"""The report's seconds in first-use forwards (rank 0's at tp > 1): JIT compiles, autotuning,
NCCL set-up; kept out of the steady-state per-step figures."""

Key = tuple  # (backend, spec, model, tp)


@dataclass
class Job:
    key: Key
    status: str
    """ok, refused, failed, or "did not finish" (started, no result.json)."""
    result: dict
    """The job's result.json (a JobResult); for a report.json alone, {"report": …}."""
    path: Path


def _overrides(job: Path) -> dict[str, str]:
    f = job / ".hydra/overrides.yaml"
    lines = f.read_text().splitlines() if f.exists() else []
    return dict(x[2:].strip().split("=", 1) for x in lines if x.startswith("- ") and "=" in x)


def _tp(overrides: list[str] | dict) -> int:
    ov = overrides if isinstance(overrides, dict) else dict(o.split("=", 1) for o in overrides
                                                            if "=" in o)
    return int(ov.get("parallel.tp", 1))


def _job(d: Path, workload: str) -> Job | None:
    """The job in folder ``d`` (None when it is of another workload or names no combination)."""
    ov = _overrides(d)
    if (d / "result.json").exists():
        try:
            res = json.loads((d / "result.json").read_text())
            if res.get("workload", workload) != workload:
                return None
            return Job((res["backend"], res["spec"], res["model"], _tp(res["overrides"])),
                       res["status"], res, d)
        except (ValueError, KeyError) as exc:
            res = {"error": f"unreadable result.json: {exc}"}
    else:
        res = {}
        if (d / "report.json").exists():  # written just before result.json
            res = {"report": json.loads((d / "report.json").read_text())}
    if not {"backend", "spec", "model"} <= ov.keys() or ov.get("workload", workload) != workload:
        return None
    key = (ov["backend"], ov["spec"], ov["model"], _tp(ov))
    if "report" in res:
        return Job(key, res["report"]["status"], res, d)
    return Job(key, "failed" if "error" in res else "did not finish", res, d)


def find_jobs(dirs: list[Path], workload: str = "serve") -> dict[Key, list[Job]]:
    """Every job under ``dirs``, by combination (a job run again appears once per attempt)."""
    out: dict[Key, list[Job]] = {}
    seen: set[tuple] = set()
    for d in dirs:
        folders = {p.parent for p in d.rglob("result.json")} | {p.parent for p in d.rglob(
            "report.json")} | {p.parent.parent for p in d.rglob(".hydra/overrides.yaml")}
        for f in sorted(folders):
            # the same job in two calls' tarballs (each packs every sweep so far) counts once
            ident = (f.parent.parent.name, f.parent.name, f.name, (f / "result.json").exists())
            job = None if ident in seen else _job(f, workload)
            seen.add(ident)
            if job is not None:
                out.setdefault(job.key, []).append(job)
    return out


def _chosen(jobs: list[Job]) -> Job:
    """A finished attempt over an unfinished one; among equals the last found."""
    return max(enumerate(jobs), key=lambda ij: (ij[1].status != "did not finish", ij[0]))[1]


_ERROR = re.compile(r"^(\w+\.)*\w*(Error|Exception|Interrupt)\b.*")


def _unfinished(job: Path) -> str:
    """Why a started job wrote no result.json, from its call's timeline.txt and the sweep's log."""
    sweep, run = job.parent.name, job.parent.parent
    where = f"job {job.name} of {sweep}"
    timeline = run / "timeline.txt"
    ends = [x for x in timeline.read_text().splitlines() if f" end {sweep} " in x] \
        if timeline.exists() else []
    code = re.search(r"exit (\d+)", ends[-1])[1] if ends else None
    if code in ("124", "137"):
        return f"stopped at the call's deadline ({where})"
    log = run / f"{sweep}.log"
    errors = [x for x in log.read_text(errors="replace").splitlines() if _ERROR.match(x)] \
        if log.exists() else []
    why = f"; last error in {sweep}.log: {errors[-1][:240]}" if errors else ""
    if code is None:
        return f"started, no result.json; no end of the sweep in a timeline ({where}){why}"
    return f"crashed: the sweep exited {code} ({where}){why}"


def _reason(job: Job) -> str:
    res, rep = job.result, job.result.get("report") or {}
    if job.status == "refused":
        return "; ".join(r.lstrip("- ").strip() for r in res.get("reasons", []))
    if job.status == "did not finish":
        return _unfinished(job.path)
    if res.get("error"):
        return res["error"].strip().splitlines()[-1][:300]
    m = rep.get("mismatch") or {}
    if m:
        return (f"{m.get('check')} check: step {m.get('step')}, {m.get('worker')}/{m.get('mode')},"
                f" layer {m.get('layer')} ({m.get('group')}): {m.get('error')}")
    return f"{rep.get('passed', 0):,}/{rep.get('checks', 0):,} checks passed, no mismatch recorded"


def commit_of(job: Path) -> str:
    """The commit a job ran at: the nearest ``commit.txt`` above it (each call's run folder), or
    its ``host.txt``'s ``commit:`` line."""
    for d in (job, *job.parents):
        if (d / "commit.txt").exists():
            return (d / "commit.txt").read_text().strip() or "unknown"
        if (d / "host.txt").exists():
            for line in (d / "host.txt").read_text().splitlines():
                if line.startswith("commit:"):
                    return line.split(":", 1)[1].strip() or "unknown"
    return "unknown"


def row(key: Key, jobs: list[Job]) -> dict:
    """One row: the chosen attempt's status and, for a report, its per-step figures (ms)."""
    b, s, m, tp = key
    r: dict = {"backend": b, "spec": s, "model": m, "tp": tp, "attempts": len(jobs)}
    if not jobs:
        return r | {"status": "did not run", "reason": "no job for it in the folders read"}
    job = _chosen(jobs)
    rep = job.result.get("report") or {}
    r |= {"status": job.status, "reason": "" if job.status == "ok" else _reason(job),
          "job": str(job.path), "commit": commit_of(job.path)}
    if rep:
        r |= {"checks": rep["checks"], "mismatches": rep["checks"] - rep["passed"],
              "steps": rep.get("steps"), "wall_s": rep.get("wall_s"),
              "first_use_s": rep.get(FIRST_USE), "steady_steps": rep.get("steady_steps")}
    if job.status != "ok" or not rep:  # a stopped run's timings describe part of a run
        return r
    ranks = rep.get("rank_attention_ms") or [rep["attention_ms_per_step"]]
    gather, planning = rep.get("gather_ms_per_step", 0.0), rep["planning_ms_per_step"]
    return r | {"attention_ms_per_rank": ranks, "attention_ms": max(ranks), "gather_ms": gather,
                "planning_ms": planning, "step_ms": max(ranks) + gather + planning}


def rows_for(jobs: dict[Key, list[Job]], grid: list[Key]) -> list[dict]:
    """Every grid row (and any other combination found), with its ratios to the same tp=1 row."""
    order = {k: i for i, k in enumerate(grid)}
    keys = sorted(set(grid) | set(jobs), key=lambda k: (order.get(k, len(order)), k))
    rows = [row(k, jobs.get(k, [])) for k in keys]
    base = {(r["backend"], r["spec"], r["model"]): r for r in rows if r["tp"] == 1}
    for r in rows:
        one = base.get((r["backend"], r["spec"], r["model"]), {})
        for f in ("step_ms", "attention_ms"):
            if r.get(f) is not None and one.get(f):
                r[f.replace("_ms", "_vs_tp1")] = r[f] / one[f]
    return rows


def grid_of(backends, specs, models, tps) -> list[Key]:
    """The sweep's combinations, tp=1 beside tp=2 for each (model, spec, backend)."""
    return [(b, s, m, t) for m in models for s in specs for b in backends for t in tps]


_EVENT = re.compile(r"^\+(\d+) s (start|end) (\S+) gpus=([\d,]+)")


def timeline_overlaps(path: Path) -> list[str]:
    """Sweeps of one timeline.txt that ran at the same time on one GPU (the warm-up excepted)."""
    spans: dict[str, list] = {}
    last = 0
    for line in path.read_text().splitlines():
        if m := _EVENT.match(line):
            t, what, name, gpus = int(m[1]), m[2], m[3], m[4].split(",")
            last = max(last, t)
            if name != "warm":
                spans.setdefault(name, [t, None, gpus])[1 if what == "end" else 0] = t
    out = []
    items = sorted(spans.items())
    for i, (a, (s1, e1, g1)) in enumerate(items):
        for b, (s2, e2, g2) in items[i + 1:]:
            e1_, e2_ = last + 1 if e1 is None else e1, last + 1 if e2 is None else e2
            if set(g1) & set(g2) and s1 < e2_ and s2 < e1_:
                out.append(f"{a} and {b} on GPU {','.join(sorted(set(g1) & set(g2)))}")
    return out


def meta_of(dirs: list[Path], jobs: dict[Key, list[Job]], commit: str | None) -> dict:
    hosts = []
    for f in sorted(p for d in dirs for p in d.rglob("host.txt")):
        h = dict(x.split(": ", 1) for x in f.read_text().splitlines() if ": " in x)
        gpus = [g.strip() for g in h.get("gpus", "").split(";") if g.strip()]
        if gpus:  # "NVIDIA H200, 143771 MiB;NVIDIA H200, 143771 MiB" → "2 × NVIDIA H200, …"
            h["gpus"] = ", ".join(f"{gpus.count(g)} × {g}" for g in dict.fromkeys(gpus))
        hosts.append(h)
    keys = ("gpus", "driver", "python", "torch", "triton", "flashinfer")  # not cpus: the 2026-11-30 calls recorded nproc, which honours OMP_NUM_THREADS=2
    machines = sorted({"; ".join(f"{k} {h[k]}" for k in keys if h.get(k)) for h in hosts})
    devices = sorted({(j.result.get("report") or {}).get("device", "") for js in jobs.values()
                      for j in js} - {""})
    commits = [commit] if commit else sorted({h["commit"] for h in hosts if h.get("commit")})
    commands = list(dict.fromkeys(c for d in dirs for f in sorted(d.rglob("commands.txt"))
                                  for c in f.read_text().splitlines() if c.strip()))
    timelines = sorted(p for d in dirs for p in d.rglob("timeline.txt"))
    return {"machine": machines or devices or ["unknown (no host.txt)"], "devices": devices,
            "commit": commits or ["unknown"], "dates": sorted({h["date"] for h in hosts
                                                              if h.get("date")}),
            "commands": commands, "timelines": len(timelines),
            "overlaps": [f"{p.parent.name}: {o}" for p in timelines for o in timeline_overlaps(p)]}


def _f(x, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(rows: list[dict], meta: dict) -> str:
    ok = [r for r in rows if r["status"] == "ok"]
    bad = sum(r.get("mismatches") or 0 for r in rows)
    counts = {st: sum(r["status"] == st for r in rows) for st in dict.fromkeys(
        ["ok", "refused", "failed", "did not finish", "did not run", *(r["status"] for r in rows)])}
    fair = (f"checked in {meta['timelines']} timeline(s): no two sweeps overlapped on a GPU"
            if meta["timelines"] and not meta["overlaps"] else
            "OVERLAPS FOUND: " + "; ".join(meta["overlaps"]) if meta["overlaps"] else
            "not checked: no timeline.txt")
    out = [
        "# Tensor parallelism on two H200s: scaling", "",
        "Generated by `python bench/tp_scaling.py DIR...` from each job's result.json "
        "(`bench/gpu.sh OUT tp` runs the sweep); do not edit by hand.", "",
        f"- **Machine**: {'<br>'.join(meta['machine'])}",
        f"- **Commit**: {', '.join(f'`{c}`' for c in meta['commit'])}; "
        f"**date**: {', '.join(meta['dates']) or 'unknown'}",
        f"- **Command**: the scaling sweep, `{ISSUE_COMMAND}`, run as the multiruns listed at the "
        "end (NVLink multicast off: `NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 "
        "NVSHMEM_DISABLE_NVLS=1`).",
        "- **One process per GPU**: tp=1 jobs ran in two serial lanes pinned with "
        "`CUDA_VISIBLE_DEVICES=0` and `=1`, tp=2 jobs (two ranks, one per GPU) one at a time "
        "after them, so no GPU time-sliced between harness processes (CUDA events would count "
        f"the other process's kernels); {fair}. FlashInfer's JIT warm-up "
        "(`tests/backends/flashinfer_warm.py`) ran in the background during the first triton "
        "jobs: compiles on the host CPU and one tiny kernel per variant on GPU 0.",
        f"- **Result**: {len(ok)} of {len(rows)} rows ok"
        + "".join(f", {n} {st}" for st, n in counts.items() if n and st != "ok")
        + f"; {bad} mismatches in all. Where rows ran at more than one commit, the `commit` "
        "column says which (its run folder's commit.txt).", "",
        "Times are ms per scheduler step, steady state: averaged over the steps with no "
        "first-use forward (how many: `steps (steady)`). The seconds spent in first-use forwards "
        f"(JIT compiles, autotuning, NCCL set-up) are the report's `{FIRST_USE}` (rank 0's), in "
        "`first use s`.",
        "- *attention per rank*: `rank_attention_ms` (tp=1: the run's `attention_ms_per_step`);",
        "- *gather*: `gather_ms_per_step`, rank 0's all-gather of the outputs (0 at tp=1);",
        "- *planning*: `planning_ms_per_step`, rank 0's metadata planning (host time);",
        "- *step* = the slowest rank's attention + gather + planning. It is the attention "
        "path's share of a step, not the harness's whole step (the oracle checks, the scheduler "
        "and the pools' bookkeeping are left out);",
        "- *vs tp=1*: this row's step (attention) over the same backend, spec and model at tp=1;",
        "- *mismatches* = checks - passed (0 expected).", "",
        "| backend | spec | model | tp | status | mismatches | checks | attention per rank | "
        "gather | planning | step | step vs tp=1 | attention vs tp=1 | steps (steady) | "
        "first use s | wall s | commit |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        status = f"**{r['status']}**" + (f": {_cell(r['reason'])}" if r.get("reason") else "")
        ranks = r.get("attention_ms_per_rank")
        out.append("| " + " | ".join([
            r["backend"], r["spec"], r["model"], str(r["tp"]), status,
            _f(r.get("mismatches"), "{:,}"), _f(r.get("checks"), "{:,}"),
            " / ".join(f"{x:.2f}" for x in ranks) if ranks else "-", _f(r.get("gather_ms")),
            _f(r.get("planning_ms")), _f(r.get("step_ms")), _f(r.get("step_vs_tp1"), "{:.2f}×"),
            _f(r.get("attention_vs_tp1"), "{:.2f}×"),
            _f(r.get("steps"), "{:,}") + (f" ({r['steady_steps']:,})"
                                          if r.get("steady_steps") is not None else ""),
            _f(r.get("first_use_s"), "{:.1f}"),
            _f(r.get("wall_s"), "{:.0f}"), r.get("commit", "-")]) + " |")
    out += ["", "Multiruns (`bench/gpu.sh OUT tp`, each call's `commands.txt`):", "", "```",
            *(meta["commands"] or ["(no commands.txt found)"]), "```"]
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: Path) -> bool:
    """Stacked bars (attention, gather, planning) per combination, tp=1 beside tp=2."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    models = sorted({r["model"] for r in rows}, key=lambda m: (m not in MODELS, m))
    tps = sorted({r["tp"] for r in rows})
    fig, axes = plt.subplots(len(models), 1, figsize=(12, 3.6 * len(models)), squeeze=False)
    for ax, model in zip(axes[:, 0], models):
        combos = sorted({(r["spec"], r["backend"]) for r in rows if r["model"] == model},
                        key=lambda sb: (SPECS.index(sb[0]) if sb[0] in SPECS else 9, sb))
        by = {(r["spec"], r["backend"], r["tp"]): r for r in rows if r["model"] == model}
        width = 0.8 / len(tps)
        for j, tp in enumerate(tps):
            xs = [i + (j - (len(tps) - 1) / 2) * width for i in range(len(combos))]
            bottom = [0.0] * len(combos)
            for part, color in (("attention_ms", "tab:blue"), ("gather_ms", "tab:orange"),
                                ("planning_ms", "tab:green")):
                hs = [by.get((*c, tp), {}).get(part) or 0.0 for c in combos]
                ax.bar(xs, hs, width, bottom=bottom, color=color, alpha=1 - 0.35 * j,
                       label=f"{part[:-3]} tp={tp}")
                bottom = [a + h for a, h in zip(bottom, hs)]
            for x, c, top in zip(xs, combos, bottom):
                r = by.get((*c, tp), {})
                if r.get("step_ms") is None:  # refused, failed or missing: say so on the axis
                    ax.text(x, 0, f"tp={tp}: {r.get('status', 'did not run')}", rotation=90,
                            ha="center", va="bottom", fontsize=6, color="grey")
                elif tp != 1 and r.get("step_vs_tp1"):
                    ax.text(x, top, f"{r['step_vs_tp1']:.2f}×", ha="center", va="bottom",
                            fontsize=7)
        ax.set_xticks(range(len(combos)), [f"{s}\n{b}" for s, b in combos], fontsize=8)
        ax.set_ylabel("ms per step")
        ax.set_title(f"{model}: attention path per step, tp=1 vs tp=2 (label: step vs tp=1)")
        ax.legend(fontsize=7, ncol=len(tps))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dirs", nargs="+", type=Path, help="unpacked sweep folders")
    p.add_argument("--commit", help="the commit that ran (default: from each call's host.txt)")
    p.add_argument("--out", type=Path, default=OUT, help="path stem of the .md/.json/.png")
    p.add_argument("--workload", default="serve")
    for name, default in (("backends", BACKENDS), ("specs", SPECS), ("models", MODELS)):
        p.add_argument(f"--{name}", default=",".join(default), help="comma list")
    p.add_argument("--tps", default="1,2", help="comma list")
    a = p.parse_args(argv)
    missing = [str(d) for d in a.dirs if not d.is_dir()]
    if missing:
        p.error(f"not a folder: {', '.join(missing)} (unpack tp_scaling.tgz first)")
    grid = grid_of(a.backends.split(","), a.specs.split(","), a.models.split(","),
                   [int(t) for t in a.tps.split(",")])
    jobs = find_jobs(a.dirs, a.workload)
    rows = rows_for(jobs, grid)
    meta = meta_of(a.dirs, jobs, a.commit)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".md").write_text(markdown(rows, meta))
    a.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    for r in rows:
        print(f"{r['backend']:11} {r['spec']:14} {r['model']:12} tp={r['tp']} {r['status']:12} "
              f"step {_f(r.get('step_ms')):>8} ms  vs tp=1 {_f(r.get('step_vs_tp1'), '{:.2f}x'):>6}"
              f"  mismatches {_f(r.get('mismatches'), '{:,}')}")
    drawn = plot(rows, a.out.with_suffix(".png"))
    print(f"wrote {a.out.with_suffix('.md')}, .json" + (", .png" if drawn else
                                                         " (no matplotlib: no plot)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
