"""A captured graph replayed for another forward mode: the accept length it costs.

The distilled DFlash draft (block 16) on the pretrained GPT-OSS-20b target, guards off, eager
against CUDA graphs, on ``--backend`` (flashinfer by default). A DFlash block's draft_decode
runs the masked prefill and its draft_extend the causal one, both in bucket (bs, 16): an engine
that files graphs by shape alone replays one mode's captured kernels over the other mode's
tables (``faults=graph_key_without_mode``, or a checkout that keyed graphs so). A row per
(variant, graphs): status, accept length, lossless, and the spec steps whose accept lengths
differ from the eager row of the same variant. Prints a table, writes JSON and a plot.

    python3 bench/probes/graph_routes.py --out DIR [--variant NAME=OVERRIDE,...] [--commit C]

The default variants: ``clean`` and ``shape_keyed`` (the fault). Trained models are cached
(``SWAFACTORY_CACHE_DIR``), so later variants reuse the first's target and draft.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common
from common import card_tag  # noqa: E402

BASE = ["model=gpt_oss_20b", "run=generate", "workload=smoke", "run.guards=false", "run.target_weights=pretrained",
        "spec=dflash", "spec.block_size=16", "spec.num_draft_tokens=16",
        "spec.draft_weights=distilled", "workload.chunk_size=64",
        "workload.swa_full_tokens_ratio=1"]
VARIANTS = {"clean": [], "shape_keyed": ["faults=graph_key_without_mode"]}


def _run(overrides: list[str]) -> dict:
    import swafactory
    from swafactory.engine.run import run_generate

    t0 = time.time()
    try:
        r = run_generate(swafactory.compose(overrides), progress=sys.stderr)
    except Exception as exc:  # noqa: BLE001 - the row says what stopped it
        return {"status": "error", "error": repr(exc)[:400], "s": round(time.time() - t0, 1)}
    return {"status": r.status, "caught_by": r.caught_by, "lossless": r.lossless,
            "accept": r.accept_len, "most": r.max_accept_len, "acted": r.fault_acted,
            "graphs": r.cuda_graphs, "error": None if r.error is None else str(r.error)[:300],
            "steps": {q.rid: q.accept_lengths for q in r.requests},
            "s": round(time.time() - t0, 1)}


def _differ(eager: dict, graphs: dict) -> list[str]:
    """``request:step`` of every spec step whose accept length differs between the two rows."""
    out = []
    for rid, acc in (graphs.get("steps") or {}).items():
        ref = (eager.get("steps") or {}).get(rid, [])
        out += [f"{rid}:{i}" for i, (a, b) in enumerate(zip(acc, ref)) if a != b]
    return out


def _table(rows: list[dict], meta: dict) -> str:
    head = (f"# Graph routes: DFlash block 16, GPT-OSS-20b ({meta['device']})\n\n"
            f"Commit `{meta['commit']}`, {meta['date']}. `python3 bench/probes/graph_routes.py "
            f"{meta['argv']}`\n\n| variant | graphs | status | caught by | accept | of | lossless "
            "| steps differing from eager | s |\n|---|---|---|---|---|---|---|---|---|\n")
    f = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    return head + "".join(
        f"| {r['variant']} | {r['graphs']} | {r['status']} | {r.get('caught_by') or '-'} | "
        f"{f(r.get('accept'))} | {r.get('most') or '-'} | {r.get('lossless')} | "
        f"{len(r.get('differ', []))} | {r['s']} |\n" for r in rows)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    names = [f"{r['variant']}\n{'graphs' if r['graphs'] else 'eager'}" for r in rows]
    ax.bar(names, [r.get("accept") or 0 for r in rows], color=["C0" if not r["graphs"] else "C1"
                                                               for r in rows])
    ax.set_ylabel("mean accept length")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--backend", default="flashinfer")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=OVERRIDE[,OVERRIDE...] (default: clean and shape_keyed)")
    ap.add_argument("--commit", default="unknown")
    a = ap.parse_args(argv)
    variants = dict(VARIANTS) if not a.variant else {
        v.split("=", 1)[0]: [o for o in v.split("=", 1)[1].split(",") if o] for v in a.variant}
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    meta = {"device": dev, "commit": a.commit, "date": datetime.date.today().isoformat(),
            "argv": " ".join(sys.argv[1:] if argv is None else argv)}
    a.out.mkdir(parents=True, exist_ok=True)
    stem = a.out / f"graph-routes-{card_tag(dev)}"
    rows = []
    for name, extra in variants.items():
        eager = None
        for graphs in (False, True):
            # a graph-keying fault cannot act eagerly (it is refused there): its eager twin
            # is the same run without the fault, the reference its replays are compared with
            over = extra if graphs else [o for o in extra if not o.startswith("faults=")]
            row = {"variant": name, "graphs": graphs, **_run(
                [*BASE, f"backend={a.backend}", f"backend.cuda_graph={str(graphs).lower()}",
                 f"workload.device={'cuda' if dev != 'cpu' else 'cpu'}", *over])}
            if eager is None:
                eager = row
            else:
                row["differ"] = _differ(eager, row)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "steps"}), flush=True)
            stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows},
                                                            indent=1))
            stem.with_suffix(".md").write_text(_table(rows, meta))
    _plot(rows, stem.with_suffix(".png"))
    print(stem.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
