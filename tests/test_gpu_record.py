"""The GPU conformance document is generated from its record: it must not drift from it."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _gpu_rows():
    spec = importlib.util.spec_from_file_location("gpu_rows", ROOT / "bench/gpu_rows.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_conformance_doc_shows_the_record_as_rendered() -> None:
    g = _gpu_rows()
    rows = g.load()
    assert rows, "the record is empty"
    keys = {"backend", "spec", "model", "workload", "extra", "status", "details", "sweep",
            "commit"}
    assert all(set(r) == keys for r in rows)
    assert {r["status"] for r in rows} <= {"ok", "failed", "refused", "unfinished"}
    doc = g.DOC.read_text()
    assert g.grid(rows) in doc and g.table(rows) in doc and g.refusals() in doc, (
        "bench/results/gpu-conformance.md is stale: run `python bench/gpu_rows.py render`")
    # the table shows each combination once, its latest row (the record also keeps its latest
    # ok, refused and out-of-memory rows, which the grid and `missing` read)
    body = g.table(rows).splitlines()[2:]
    combos = {(r["backend"], r["model"], r["spec"], r["workload"], r["extra"]) for r in rows}
    assert len(body) == len(combos) <= len(rows)


def test_the_record_is_compact() -> None:
    """bench/results keeps the compact record: raw rows stay in each sweep's folder (`add` writes
    them there), and compacting keeps what the grid, the table and `missing` read."""
    g = _gpu_rows()
    rows = g.load()
    assert g.compact(rows) == rows
    assert not (ROOT / "bench/results/gpu-conformance-rows.jsonl").exists()
    older = [dict(r, status="failed", details="stopped") for r in rows[:20]]
    assert g.grid(g.compact(older + rows)) == g.grid(older + rows)
    assert g.table(g.compact(older + rows)) == g.table(older + rows)


def test_no_recorded_gpu_run_failed_an_oracle_check() -> None:
    """The record's claim, kept true: failures are memory, lowering or time, never the oracle."""
    rows = _gpu_rows().load()
    assert not [r for r in rows if r["status"] == "failed"
                and r["details"].startswith(("oracle check", "nan check"))]


@pytest.mark.parametrize("workload", ["smoke", "serve"])
def test_every_combination_the_registry_accepts_on_an_h200_has_an_ok_row(workload: str) -> None:
    """Accepting a combination on the H200 (a new backend, a lifted refusal) needs GPU evidence
    on both workloads: `python bench/gpu_rows.py missing --workload W` lists what lacks it."""
    assert _gpu_rows().missing(workload) == []
