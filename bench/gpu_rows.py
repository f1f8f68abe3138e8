"""The GPU conformance record: the harness jobs that ran on the GPU host, compacted.

`bench/results/gpu-conformance.json` keeps, per combination (backend, model, spec, workload and
overrides), the latest row and the latest ok, refused and out-of-memory rows: every row the grid,
the table and `missing` read. `add` reads the jobs of returned sweep folders, writes all of a
folder's rows to its own `rows.jsonl` (raw rows stay in the bench's output folder, not in git;
git history keeps the old `bench/results/gpu-conformance-rows.jsonl`) and merges them into the
compact record; `render` rewrites the generated parts of `bench/results/gpu-conformance.md`
(between its `<!-- grid -->` and `<!-- rows -->` markers) from the record, so the document never
disagrees with the reports.

    python bench/gpu_rows.py add --commit 1da1d66 DIR [DIR ...]   # sweep folders (gpu.sh matrix)
    python bench/gpu_rows.py render
    python bench/gpu_rows.py missing [--workload serve]   # sweeps still to run, as script knobs
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "bench/results/gpu-conformance.json"
DOC = ROOT / "bench/results/gpu-conformance.md"
BACKENDS = ["flashinfer", "flash_attn", "triton", "torch", "flex"]
MODELS = ["gemma4", "gpt_oss_20b", "mistral_7b"]
SPECS = ["none", "eagle", "eagle3", "nextn", "frozen_kv_mtp", "dflash"]


def _short_error(text: str) -> str:
    if "out of memory" in text:
        return "CUDA out of memory in the harness (too many parallel runs on one GPU)"
    if "NoValidChoicesError" in text:
        return "InductorError: NoValidChoicesError lowering flex_attention (compiled, dynamic shapes)"
    return text.splitlines()[0][:200] if text else "-"


def row_of(result: dict, sweep: str, commit: str) -> dict:
    """One record row from a job's result.json."""
    extra = [o for o in result["overrides"]
             if not o.split("=")[0] in ("backend", "spec", "model", "workload")]
    rep = result.get("report") or {}
    if result["status"] == "ok":
        acc = rep.get("accept_len")
        details = (f"{rep['passed']:,}/{rep['checks']:,} checks, max rel err "
                   f"{rep['max_rel_err']:.1e}, peak SWA {100 * rep['peak_swa_use']:.1f}%, accept "
                   f"{'-' if acc is None else f'{acc:.2f}'}, {rep['steps']} steps, "
                   f"{rep['wall_s']:.0f} s")
        if rep.get("peak_device_bytes"):
            details += f", peak GPU memory {rep['peak_device_bytes'] / 2**30:.1f} GiB"
        if rep.get("parts", {}).get("cuda_graphs"):
            details += f", graphs: {rep['parts']['cuda_graphs']}"
    elif result["status"] == "refused":
        details = " ".join(r.lstrip("- ") for r in result["reasons"])
    else:
        m = rep.get("mismatch") or {}
        details = (f"{m.get('check', '-')} check, {m.get('worker', '-')}/{m.get('mode', '-')}: "
                   + _short_error(m.get("error") or result.get("error") or ""))
    return {"backend": result["backend"], "spec": result["spec"], "model": result["model"],
            "workload": result["workload"], "extra": " ".join(extra), "status": result["status"],
            "details": details, "sweep": sweep, "commit": commit}


def add(dirs: list[str], commit: str) -> int:
    rows = []
    for d in map(Path, dirs):
        start = len(rows)
        for f in sorted(d.glob("*/result.json"), key=lambda p: int(p.parent.name)
                        if p.parent.name.isdigit() else 0):
            rows.append(row_of(json.loads(f.read_text()), d.name, commit))
        for ov in sorted(d.glob("*/.hydra/overrides.yaml")):
            if not (ov.parent.parent / "result.json").exists():  # killed at the call's limit
                kv = dict(line[2:].split("=", 1) for line in ov.read_text().splitlines()
                          if line.startswith("- "))
                rows.append({"backend": kv.get("backend"), "spec": kv.get("spec"),
                             "model": kv.get("model"), "workload": kv.get("workload", "serve"),
                             "extra": "", "status": "unfinished",
                             "details": "stopped at the device call's time limit",
                             "sweep": d.name, "commit": commit})
        with (d / "rows.jsonl").open("a") as f:  # the raw rows, in the sweep's own folder
            for r in rows[start:]:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    save(compact(load() + rows))
    return len(rows)


def compact(rows: list[dict]) -> list[dict]:
    """Per combination, its latest row and its latest ok, refused and out-of-memory rows, in the
    order brought back: the grid, the table and `missing` read the same from these as from every
    row."""
    keep: dict[tuple, dict[str, int]] = {}
    for i, r in enumerate(rows):
        k = keep.setdefault((r["backend"], r["model"], r["spec"], r["workload"], r["extra"]), {})
        k["last"] = i
        if r["status"] in ("ok", "refused"):
            k[r["status"]] = i
        if "out of memory" in r["details"]:
            k["oom"] = i
    return [rows[i] for i in sorted({i for k in keep.values() for i in k.values()})]


def load() -> list[dict]:
    return json.loads(RECORD.read_text()) if RECORD.exists() else []


def save(rows: list[dict]) -> None:
    RECORD.write_text("[\n" + ",\n".join(json.dumps(r, ensure_ascii=False) for r in rows)
                      + "\n]\n")


def _cell_state(rows: list[dict]) -> str:
    if any(r["status"] == "ok" for r in rows):
        return "ok" + ("+g" if any(r["status"] == "ok" and "cuda_graph" in r["extra"]
                                   for r in rows) else "")
    if not rows:
        return "-"
    if any("out of memory" in r["details"] for r in rows):
        return "OOM"
    return rows[-1]["status"]


def _plain(r: dict) -> bool:
    """A row of the combination as shipped: fp8 KV, per-group kernels (`backend.groups`) and other
    page sizes are other combinations, listed with their overrides in the table, never counted
    in the grid."""
    return not any(k in r["extra"] for k in ("backend.kv_dtype", "backend.groups",
                                             "backend.page_size"))


def grid(rows: list[dict]) -> str:
    rows = [r for r in rows if _plain(r)]
    out = ["| backend | model | " + " | ".join(SPECS) + " |",
           "|---|---|" + "---|" * len(SPECS)]
    for b in BACKENDS:
        for m in MODELS:
            cells = []
            for s in SPECS:
                mine = [r for r in rows if (r["backend"], r["model"], r["spec"]) == (b, m, s)]
                refused = [r for r in mine if r["status"] == "refused"]
                if refused and not any(r["status"] == "ok" for r in mine):
                    cells.append("refused")
                    continue
                by = {w: [r for r in mine if r["workload"] == w] for w in ("smoke", "serve")}
                cells.append(f"{_cell_state(by['smoke'])} / {_cell_state(by['serve'])}")
            out.append(f"| {b} | {m} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def latest(rows: list[dict]) -> list[dict]:
    """The last row brought back of each combination (backend, model, spec, workload and
    overrides): what the record's table shows."""
    last = {}
    for r in rows:
        last[(r["backend"], r["model"], r["spec"], r["workload"], r["extra"])] = r
    return list(last.values())


def table(rows: list[dict]) -> str:
    key = {b: i for i, b in enumerate(BACKENDS)}
    rows = sorted(latest(rows), key=lambda r: (key.get(r["backend"], 9), MODELS.index(r["model"])
                                       if r["model"] in MODELS else 9,
                                       SPECS.index(r["spec"]) if r["spec"] in SPECS else 9,
                                       r["workload"], r["extra"]))
    out = ["| backend | model | spec | workload | result | details | commit |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        wl = r["workload"] + (f", {r['extra']}" if r["extra"] else "")
        details = r["details"].replace("|", "\\|")
        out.append(f"| {r['backend']} | {r['model']} | {r['spec']} | {wl} | **{r['status']}** | "
                   f"{details} | {r['commit']} |")
    return "\n".join(out)


def _h200_reasons(backend: str, spec: str, model: str, workload: str) -> list:
    """The registry's reasons to refuse a shipped combination on an H200 ([] = accepted)."""
    from swafactory.registry.check import check
    from swafactory.registry.device import H200
    from swafactory.registry.matrix import shipped_config

    return check(shipped_config(backend, spec, model, workload=workload), H200)


def refusals() -> str:
    """The registry's verdict for an H200, with its full reasons, for every refused combination
    of the matrix (what `python -m swafactory … ` prints there before allocating anything)."""
    groups: dict[tuple[str, str, str], list[str]] = {}
    for b in BACKENDS:
        for m in MODELS:
            for s in SPECS:
                reasons = _h200_reasons(b, s, m, "serve")
                if reasons:
                    text = "<br>".join(str(r).replace("|", "\\|") for r in reasons)
                    groups.setdefault((b, m, text), []).append(s)
    out = ["| backend | model | specs | reasons (registry, H200) |", "|---|---|---|---|"]
    for (b, m, text), specs in groups.items():
        specs_cell = "all six" if len(specs) == len(SPECS) else ", ".join(specs)
        out.append(f"| {b} | {m} | {specs_cell} | {text} |")
    return "\n".join(out)


def missing(workload: str) -> list[str]:
    """Per backend and model, the accepted specs (H200 registry verdict) with no ok row yet, as
    `bench/gpu.sh OUT matrix` knobs."""
    done = {(r["backend"], r["model"], r["spec"]) for r in load()
            if r["status"] == "ok" and r["workload"] == workload}
    out = []
    for b in BACKENDS:
        for m in MODELS:
            specs = [s for s in SPECS if (b, m, s) not in done
                     and not _h200_reasons(b, s, m, workload)]
            if specs:
                out.append(f"BACKENDS={b} MODELS={m} SPECS={','.join(specs)} WORKLOAD={workload}")
    return out


def render() -> None:
    rows = load()
    text = DOC.read_text()
    for name, body in (("grid", grid(rows)), ("refused", refusals()), ("rows", table(rows))):
        pat = re.compile(rf"<!-- {name} -->\n.*?<!-- /{name} -->", re.S)
        if not pat.search(text):
            sys.exit(f"{DOC}: no <!-- {name} --> … <!-- /{name} --> markers")
        text = pat.sub(lambda m, n=name, b=body: f"<!-- {n} -->\n{b}\n<!-- /{n} -->", text)
    DOC.write_text(text)
    print(f"rendered {len(rows)} rows into {DOC.relative_to(ROOT)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("add")
    a.add_argument("--commit", required=True)
    a.add_argument("dirs", nargs="+")
    sub.add_parser("render")
    mi = sub.add_parser("missing")
    mi.add_argument("--workload", default="serve")
    args = ap.parse_args()
    if args.cmd == "missing":
        lines = missing(args.workload)
        print("\n".join(lines) if lines else f"every accepted combination has an ok {args.workload} row")
    elif args.cmd == "add":
        print(f"added {add(args.dirs, args.commit)} rows to {RECORD.relative_to(ROOT)}")
    else:
        render()


if __name__ == "__main__":
    main()
