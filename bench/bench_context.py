"""Speculative accept length against context length: windowed against full draft attention.

    # CPU (model=tiny: window 16, lag 24; the target and drafts cached): 410 s of CPU time,
    # 10.5 min wall measured while other jobs shared the 2 cores
    python3 bench/bench_context.py
    # GPU host, long contexts (GPT-OSS-20b geometry: window 128, lag 136; the target and the
    # drafts train there on first use, in minutes; Gemma 4's target pretrains at 2 s a step):
    python3 bench/bench_context.py --device cuda --models gpt_oss_20b --backend flashinfer \
        --contexts 1024,2048,4096,8192,16384,32768 --draft-windows lag+8,1024,4096

speculators (vLLM project) measured windowed drafts losing accept length below about 8K context
and gaining from about 10K (+40 % at 16-20K). This bench asks the same of a swafactory draft:
each model × draft family × ``spec.draft_window`` (``full``: null, each draft layer keeps its own
window; ``lag+N`` / ``lag-N``: relative to the lag-copy language's lag, W + 8, so one window can
still reach the copied key and one cannot) × context runs ``run=generate`` with a pretrained
target (``run.target_weights=pretrained``) and a distilled draft (``spec.draft_weights=distilled``,
trained without a window; the window narrows its reads at serving time, as vLLM's
``draft_attention_window`` does), guards and oracle off. The context is the prompt's length
(``workload.prompt_over_window`` = [C - W, C - W]); outputs stay short (``--new``). Each row keeps
the mean accept length, each request's, the draft windows the plan gave (``plan_summary``) and how
closely the target's own tokens still follow the language there (``target_follows``). It writes
OUT/accept-context-<cpu|h100|h200|gpu>.{json,md,png}; the .md and the plot say from which context
windowing pays (windowed ahead of full there, and ≥ full at every larger context) per family, or
that it did not.
run=generate's logits checks run transformers' eager forward of each request's whole sequence,
in the model's dtype and in fp64 ([heads, T, T] scores): at GPT-OSS's 64 heads that bounds the
context a GPU can hold (a row past it records the OutOfMemoryError and the lane goes on).
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["FAMILIES", "window_of", "run_row", "crossover", "verdict", "render", "write_json",
           "plot", "main"]

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = {"dflash": ["spec=dflash"], "eagle3": ["spec=eagle3"]}  # the shipped specs as they are


def window_of(text: str, sliding: int | None) -> int | None:
    """``--draft-windows`` entry → ``spec.draft_window``: ``full`` → None, ``lag±N`` → the
    language's lag (W + 8, `language.lag_for`) ± N, else an int."""
    from swafactory.drafts.language import lag_for

    if text == "full":
        return None
    m = re.fullmatch(r"lag([+-]\d+)?", text)
    return lag_for(sliding) + int(m.group(1) or 0) if m else int(text)


def _follows(report, lag: int) -> float | None:
    """The share of generated tokens that repeat the token ``lag`` back: past the contexts the
    target was trained on (3 lags) it may leave the language, and then no draft can follow."""
    hits = n = 0
    for q in report.requests:
        seq, p = q.prompt_ids + q.generated_ids, len(q.prompt_ids)
        hits += sum(seq[i] == seq[i - lag] for i in range(p, len(seq)))
        n += len(seq) - p
    return hits / n if n else None


def run_row(model: str, family: str, label: str, ctx: int, a) -> dict:
    """One ``run=generate`` job at prompt length ``ctx``: its row (a refusal or error is one)."""
    import swafactory
    from swafactory.drafts.language import lag_for
    from swafactory.engine.run import run_generate
    from swafactory.errors import CapacityError, ConfigError

    base = [f"model={model}", f"backend={a.backend}", "run=generate", "workload=smoke",
            "run.guards=false", "run.oracle=false", "run.target_weights=pretrained",
            *FAMILIES[family], "spec.draft_weights=distilled", f"workload.device={a.device}",
            f"workload.num_requests={a.requests}", f"workload.max_running_requests={a.requests}",
            f"workload.output_len=[{a.new},{a.new}]", *a.overrides]
    cfg0 = swafactory.compose(base)
    W = cfg0.model.sliding_window or 0
    dw = window_of(label, cfg0.model.sliding_window)
    over = [*base, f"spec.draft_window={'null' if dw is None else dw}",
            f"workload.prompt_over_window=[{ctx - W},{ctx - W}]"]
    if ctx + a.new + 64 > cfg0.run.max_position_embeddings:  # RoPE tables long enough (GPU lane)
        over.append(f"run.max_position_embeddings={1 << (ctx + a.new + 64 - 1).bit_length()}")
    row = {"model": model, "backend": a.backend, "family": family, "window": label,
           "draft_window": dw, "context": ctx}
    t = time.perf_counter()
    try:
        cfg = swafactory.compose(over)
        row["windows_used"] = list(dict.fromkeys(  # what the plan gives the draft (None: full)
            r.window for r in swafactory.plan_summary(cfg).rows if r.worker == "draft"))
        r = run_generate(cfg, progress=sys.stderr if a.verbose else None)
    except (ConfigError, CapacityError) as exc:
        return {**row, "status": "refused", "detail": str(exc).splitlines()[-1].strip()[:200]}
    except Exception as exc:  # noqa: BLE001 - one job's failure is its row
        return {**row, "status": "error", "detail": f"{type(exc).__name__}: {exc}"[:200]}
    per = [sum(q.accept_lengths) / len(q.accept_lengths) if q.accept_lengths else None
           for q in r.requests]
    return {**row, "status": r.status, "caught_by": r.caught_by, "accept": r.accept_len,
            "accept_per_request": per, "accept_steps": [q.accept_lengths for q in r.requests],
            "most": r.max_accept_len, "lossless": r.lossless,
            "target_follows": _follows(r, lag_for(cfg0.model.sliding_window)),
            "draft_top1": (r.draft_training or {}).get("heldout_top1"),
            "job_s": round(time.perf_counter() - t, 2)}


def crossover(rows: list[dict]) -> dict[str, dict]:
    """``model family`` → where windowing starts to pay: for each window, the smallest context
    at which its accept length is ahead of full's and ≥ full's at every larger measured context
    (``from``; ``ge``: the smallest context from which it is never behind); ``best``: the window
    that pays earliest, None where none does. Rows without an accept length are left out."""
    acc: dict[tuple, dict[int, float]] = {}
    for r in rows:
        if r.get("accept") is not None:
            acc.setdefault((r["model"], r["family"], r["window"]), {})[r["context"]] = r["accept"]
    out: dict[str, dict] = {}
    for (model, family, label), win in acc.items():
        full = acc.get((model, family, "full"))
        entry = out.setdefault(f"{model} {family}", {"windows": {}, "best": None})
        if label == "full" or full is None:
            continue
        ctxs = sorted(set(win) & set(full))
        never_behind = [c for i, c in enumerate(ctxs) if all(win[x] >= full[x] for x in ctxs[i:])]
        ahead = [c for c in never_behind if win[c] > full[c]]
        found = None if not ahead else {
            "from": ahead[0], "ge": never_behind[0], "at": ctxs[-1], "windowed": win[ctxs[-1]],
            "full": full[ctxs[-1]]}
        entry["windows"][label] = found
        if found and (entry["best"] is None or found["from"] < entry["best"]["from"]):
            entry["best"] = {"window": label, **found}
    return out


def verdict(cross: dict[str, dict], rows: list[dict]) -> list[str]:
    """One sentence per model × family, from `crossover`."""
    ctxs = sorted({r["context"] for r in rows})
    span = f"{ctxs[0]}-{ctxs[-1]}" if ctxs else "-"
    lines = []
    for key, e in cross.items():
        b = e["best"]
        if b is None:
            lines.append(f"{key}: windowing did not pay within contexts {span} (no window "
                         "ahead of full at a context and never behind it after).")
            continue
        gain = (b["windowed"] / b["full"] - 1) * 100 if b["full"] else float("inf")
        lines.append(f"{key}: windowing pays from context {b['from']} (window {b['window']} "
                     f"ahead of full there and ≥ full at every larger context; never behind "
                     f"from {b['ge']}; at {b['at']}: {b['windowed']:.2f} vs {b['full']:.2f}, "
                     f"{gain:+.0f} %).")
    return lines


def _f(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def render(rows: list[dict], meta: dict) -> str:
    """The record's markdown: facts, the accept-length table (context × family window), the
    verdicts, and the rows that did not finish ok."""
    cols = list(dict.fromkeys((r["model"], r["family"], r["window"]) for r in rows))
    cell = {(r["model"], r["family"], r["window"], r["context"]): r for r in rows}
    dws: dict[tuple, int | None] = {}
    for r in rows:  # a row that did not run has no window of its own
        if r["status"] != "did not run":
            dws.setdefault((r["model"], r["family"], r["window"]), r["draft_window"])
    head = [f"{m} {f} " + ("full" if w == "full" else f"{w} (window {dws.get((m, f, w), '-')})")
            for m, f, w in cols]
    lines = [f"# Accept length against context: windowed against full draft attention "
             f"({meta['device']})", "",
             f"Commit `{meta['commit']}`, {meta['date']}, {meta['device']}. "
             f"`{('python3 bench/bench_context.py ' + meta['argv']).strip()}`. Pretrained "
             "target (lag-copy language, lag W + 8), distilled drafts (trained without a window; "
             "`spec.draft_window` narrows their reads), guards and oracle off, "
             f"{meta['requests']} requests of a {meta['new']}-token output per cell. Context: "
             "prompt tokens. Cells: mean accept length (tokens committed per spec step); "
             "in brackets where the target's own tokens follow the language less than 0.95 of "
             "the time (`target_follows`).", "",
             "| context | " + " | ".join(head) + " |", "|---" * (len(cols) + 1) + "|"]
    for c in sorted({r["context"] for r in rows}):
        out = []
        for m, f, w in cols:
            r = cell.get((m, f, w, c), {})
            s = _f(r.get("accept")) if r.get("status") == "ok" else r.get("status", "-")
            tf = r.get("target_follows")
            out.append(s + (f" ({tf:.2f})" if tf is not None and tf < 0.95 else ""))
        lines.append(f"| {c} | " + " | ".join(out) + " |")
    lines += ["", "## Where windowing pays", "", *[f"- {v}" for v in meta["verdict"]]]
    bad = [r for r in rows if r.get("status") != "ok"]
    if bad:
        lines += ["", "## Rows not ok", ""] + [
            f"- {r['model']} {r['family']} {r['window']} ctx {r['context']}: {r['status']} "
            f"{r.get('caught_by') or ''} {r.get('detail', '')}".rstrip() for r in bad]
    return "\n".join(lines) + "\n"


def write_json(rows: list[dict], meta: dict, path: Path) -> None:
    """The record's JSON, one row a line (bench/results stays under 1 MB)."""
    path.write_text(f'{{"meta": {json.dumps(meta)}, "rows": [\n'
                    + ",\n".join(json.dumps(r) for r in rows) + "\n]}\n")


def plot(rows: list[dict], meta: dict, path: Path) -> None:
    """Accept length against context (log x), one line per model × family × window."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    labels = list(dict.fromkeys(r["window"] for r in rows))  # a colour per window,
    styles = list(dict.fromkeys((r["model"], r["family"]) for r in rows))  # a dash per family
    for key in dict.fromkeys((r["model"], r["family"], r["window"]) for r in rows):
        pts = sorted((r["context"], r["accept"]) for r in rows if r.get("accept") is not None
                     and (r["model"], r["family"], r["window"]) == key)
        if pts:
            best = (meta["crossover"].get(f"{key[0]} {key[1]}") or {}).get("windows", {})
            pays = best.get(key[2])
            ax.plot(*zip(*pts), marker="os^D"[styles.index(key[:2]) % 4],
                    ls=["-", "--", ":", "-."][styles.index(key[:2]) % 4],
                    color=f"C{labels.index(key[2]) % 10}",
                    label=" ".join(key) + (f" (pays from {pays['from']})" if pays else ""))
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter("{x:.0f}")
    ax.set_xlabel("context (prompt tokens)")
    ax.set_ylabel("mean accept length (tokens per spec step)")
    ax.set_title("\n".join(v.split(" (")[0] for v in meta["verdict"]) or "no rows",
                 fontsize="small")
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=60)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--models", default="tiny", help="comma-separated model keys")
    ap.add_argument("--families", default="dflash,eagle3", help=", ".join(FAMILIES))
    ap.add_argument("--draft-windows", default="lag+8,lag-8",
                    help="windows besides full: ints, or lag±N (lag = W + 8)")
    ap.add_argument("--contexts", default="64,128,256,512,1024", help="prompt tokens")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--requests", type=int, default=2, help="requests per cell")
    ap.add_argument("--new", type=int, default=16, help="output tokens per request")
    ap.add_argument("--deadline", type=float, default=3000.0, help="seconds: no job starts later")
    ap.add_argument("--commit", default=None, help="default: git rev-parse --short HEAD")
    ap.add_argument("--verbose", action="store_true", help="run=generate's progress lines")
    ap.add_argument("overrides", nargs="*", help="more Hydra overrides for every job")
    a = ap.parse_args(argv)
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import card_tag

    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    commit = a.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                        capture_output=True, text=True).stdout.strip() or "unknown"
    meta = {"device": dev, "commit": commit, "date": datetime.date.today().isoformat(),
            "argv": " ".join(sys.argv[1:] if argv is None else argv), "requests": a.requests,
            "new": a.new}
    stem = a.out / f"accept-context-{card_tag(dev)}"
    a.out.mkdir(parents=True, exist_ok=True)
    labels = ["full", *[w for w in a.draft_windows.split(",") if w and w != "full"]]
    rows: list[dict] = []
    meta.update(crossover={}, verdict=[])
    t0 = time.perf_counter()
    for model in a.models.split(","):
        for family in a.families.split(","):
            for label in labels:
                for ctx in (int(c) for c in a.contexts.split(",")):
                    if time.perf_counter() - t0 > a.deadline:
                        rows.append({"model": model, "backend": a.backend, "family": family,
                                     "window": label, "draft_window": None, "context": ctx,
                                     "status": "did not run", "detail": "deadline"})
                        continue
                    rows.append(run_row(model, family, label, ctx, a))
                    r = rows[-1]
                    print(f"{model} {family} window {label} ({r['draft_window']}) ctx {ctx}: "
                          f"{r['status']} accept {_f(r.get('accept'))} "
                          f"follows {_f(r.get('target_follows'))} ({r.get('job_s', 0):.1f} s) "
                          f"{r.get('detail', '')}", flush=True)
                    meta["crossover"] = crossover(rows)  # written after every row: a cut run
                    meta["verdict"] = verdict(meta["crossover"], rows)  # keeps what it measured
                    stem.with_suffix(".md").write_text(render(rows, meta))
                    write_json(rows, meta, stem.with_suffix(".json"))
    plot(rows, meta, stem.with_suffix(".png"))
    print(stem.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
