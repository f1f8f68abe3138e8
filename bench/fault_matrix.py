"""The fault matrix: every fault × backend × guards on / off, with what caught it or what it showed.

    # CPU (torch; add triton for the interpreted kernels: minutes a run)
    python3 bench/fault_matrix.py --out bench/results --commit C
    python3 bench/fault_matrix.py --backends torch,triton --out bench/results --commit C
    # the GPU host (bench/gpu.sh evidence's `matrix` part runs this)
    python3 bench/fault_matrix.py --backends flashinfer,triton --device cuda --out OUT --commit C

Each fault runs on its documented launch line (the `# Launch:` line of `conf/faults/<name>.yaml`,
its backend replaced): guards on, as the tests run it, the row names the check that caught it.
Guards off, the same overrides through ``run=generate run.guards=false run.oracle=false``, as an
engine that embedded only the kernels would run: the row names the run check that failed (the
target's logits against transformers' eager, the draft's, lossless, acceptance, a kernel's
error) or that it passed, and gives the accept length beside its clean twin's where there is
one. A refusal (a fault whose needs the backend or the run cannot meet) is a row too. Writes
OUT/fault-matrix-<cpu|h100|h200|gpu>.{json,md}, one line per run as it ends.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["launch_overrides", "guards_off", "run_one", "render", "main"]

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "# Launch: python -m swafactory "


def launch_overrides(fault: str) -> list[str]:
    """The overrides of ``fault``'s documented launch line."""
    from swafactory.config.paths import conf_dir

    text = (conf_dir() / "faults" / f"{fault}.yaml").read_text()
    line = next(x for x in text.splitlines() if x.startswith(PREFIX))
    return shlex.split(line[len(PREFIX):])


def _with(over: list[str], key: str, value: str) -> list[str]:
    return [o for o in over if not o.startswith(f"{key}=")] + [f"{key}={value}"]


def guards_off(over: list[str]) -> list[str]:
    """A launch line as an engine runs it: run=generate, no guards, no attention oracle (a
    GPT-OSS launch at 4 layers: the generator's hidden size serves its heads; a window-retained
    draft of random weights: a copy of the target cannot retain one)."""
    out = _with(_with(_with(over, "run", "generate"), "run.guards", "false"), "run.oracle", "false")
    if "model=gpt_oss_20b" in out and not any(o.startswith("run.num_layers=") for o in out):
        out.append("run.num_layers=4")
    if "spec.draft_kv_retention=window" in out and not any(
            o.startswith("spec.draft_weights=") for o in out):
        out.append("spec.draft_weights=random")  # a copy of the target cannot retain a window
    return out


def run_one(fault: str, backend: str, guards: bool, device: str) -> dict:
    """One run's row: status, the check that failed, the error's head, accept lengths."""
    import swafactory
    from swafactory.engine.run import run_generate
    from swafactory.errors import CapacityError, ConfigError

    over = _with(launch_overrides(fault), "backend", backend) + [f"workload.device={device}"]
    if backend == "triton" and device == "cpu" and not any(
            o.startswith("backend.kv_dtype=") for o in over):
        over.append("backend.kv_dtype=float16")  # the interpreter's bfloat16 dots are wrong
    if not guards:
        over = guards_off(over)
    row = {"fault": fault, "backend": backend, "guards": guards, "overrides": over}
    t = time.perf_counter()
    try:
        cfg = swafactory.compose(over)
        if cfg.run.mode == "generate":
            r = run_generate(cfg)
            row.update(status=r.status, caught_by=r.caught_by, acted=r.fault_acted.get(fault, 0),
                       accept=r.accept_len, clean=r.accept_len_clean,
                       detail=(r.error or next((c.detail for c in r.checks
                                                if c.status == "failed"), "") or "")[:160])
        else:
            r = swafactory.run(cfg)
            m = r.mismatch
            row.update(status=r.status, caught_by=None if m is None else m.check,
                       acted=r.fault_acted.get(fault, 0),
                       detail="" if m is None else f"{m.mode}: {m.error}"[:160])
    except (ConfigError, CapacityError) as exc:
        row.update(status="refused", detail=str(exc).splitlines()[-1].strip()[:160])
    except Exception as exc:  # noqa: BLE001 - a crash is this row's symptom
        row.update(status="error", caught_by="crash", detail=f"{type(exc).__name__}: {exc}"[:160])
    row["job_s"] = round(time.perf_counter() - t, 1)
    return row


def _cell(r: dict | None) -> str:
    if r is None:
        return "-"
    if r["status"] == "refused":
        return "refused"
    if r["status"] in ("ok", "inert"):
        return f"**{r['status']}**" + (f", accept {r['accept']:.2f}" if r.get("accept") else "")
    acc = "" if not r.get("accept") else (
        f", accept {r['accept']:.2f}" + (f" / {r['clean']:.2f}" if r.get("clean") else ""))
    return f"{r.get('caught_by') or r['status']}{acc}"


def render(rows: list[dict], meta: dict) -> str:
    """The record's markdown: a row per fault, a column per backend × guards."""
    cols = [(b, g) for b in meta["backends"] for g in (True, False)]
    at = {(r["fault"], r["backend"], r["guards"]): r for r in rows}
    faults = sorted({r["fault"] for r in rows})
    head = " | ".join(f"{b}, guards {'on' if g else 'off'}" for b, g in cols)
    out = [f"# Fault matrix ({meta['card']})", "",
           f"Commit `{meta['commit']}`, {meta['date']}, {meta['card']}. `{meta['command']}`.",
           "Each fault on its launch line; guards off: the same overrides through `run=generate "
           "run.guards=false run.oracle=false`. A cell names the check that caught the run (or "
           "`crash`), with the accept length against its clean twin's where there is one; "
           "**ok** or **inert** is a fault that was not caught there.", "",
           f"| fault | {head} |", "|---|" + "---|" * len(cols)]
    for f in faults:
        out.append(f"| `{f}` | " + " | ".join(_cell(at.get((f, b, g))) for b, g in cols) + " |")
    missed = [r for r in rows if r["status"] in ("ok", "inert") and r["guards"]]
    out += ["", f"{len(rows)} runs; guards on, not caught: "
            + (", ".join(f"`{r['fault']}` ({r['backend']})" for r in missed) or "none") + "."]
    return "\n".join(out) + "\n"


def _card(device: str) -> str:
    if device == "cpu":
        return "cpu"
    import torch

    name = torch.cuda.get_device_name().lower()
    return "h200" if "h200" in name else "h100" if "h100" in name else "gpu"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", default="torch", help="comma-separated backend keys")
    ap.add_argument("--faults", default="all", help="comma-separated fault keys, or all")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--commit", default=None)
    ap.add_argument("--guards", default="on,off", help="on, off or on,off")
    a = ap.parse_args(argv)
    if a.device == "cpu":  # triton's kernels on CPU tensors: its interpreter, set before import
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from swafactory.config.paths import group_options

    faults = [f for f in group_options("faults") if f != "none"] if a.faults == "all" \
        else a.faults.split(",")
    backends = a.backends.split(",")
    commit = a.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                        capture_output=True, text=True).stdout.strip()
    out, card = Path(a.out), _card(a.device)
    out.mkdir(parents=True, exist_ok=True)
    rows_path = out / f"fault-matrix-{card}.jsonl"
    rows = []
    for f in faults:
        for b in backends:
            for g in [x == "on" for x in a.guards.split(",")]:
                row = run_one(f, b, g, a.device)
                rows.append(row)
                with rows_path.open("a") as fh:
                    fh.write(json.dumps(row) + "\n")
                print(f"{f:40s} {b:10s} guards {'on ' if g else 'off'} {_cell(row):40s} "
                      f"({row['job_s']} s)", flush=True)
    meta = {"commit": commit, "date": datetime.date.today().isoformat(), "card": card,
            "backends": backends, "command": "python3 bench/fault_matrix.py "
            + " ".join(shlex.quote(x) for x in (argv if argv is not None else sys.argv[1:]))}
    (out / f"fault-matrix-{card}.json").write_text(json.dumps({"meta": meta, "rows": [
        {k: v for k, v in r.items() if k != "overrides"} for r in rows]}, indent=1) + "\n")
    (out / f"fault-matrix-{card}.md").write_text(render(rows, meta))
    rows_path.unlink()
    print(f"wrote {out}/fault-matrix-{card}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
