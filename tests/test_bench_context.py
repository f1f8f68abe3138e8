"""bench/bench_context.py: accept length against context, windowed against full draft attention.
Its smallest run writes one row per family x window x context, and the record's statement of
where windowing pays is computed from those rows (`crossover`), not written by hand."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import bench_context as bc  # noqa: E402

CTXS = [64, 128, 256, 512]
pytestmark = pytest.mark.xdist_group("distill")  # the trained target and drafts: one worker


def _rows(full: list[float], win: list[float], label: str = "lag+8") -> list[dict]:
    return [{"model": "tiny", "family": "dflash", "window": w, "draft_window": dw, "context": c,
             "status": "ok", "accept": a}
            for w, dw, accs in (("full", None, full), (label, 32, win))
            for c, a in zip(CTXS, accs)]


def test_the_crossover_is_read_from_the_rows() -> None:
    full = [8.0, 6.0, 3.0, 1.2]
    cases = [  # windowed accept lengths -> (pays from, never behind from), None: never pays
        ([8.0, 5.0, 3.5, 2.5], (256, 256)),
        ([8.0, 6.0, 3.5, 2.5], (256, 64)),    # a tie is never behind, but not ahead
        ([8.0, 7.0, 2.0, 2.5], (512, 512)),   # ahead at 128, behind at 256: pays from 512 only
        ([8.0, 7.0, 3.5, 1.0], None),         # behind at the largest context
        (full, None),                          # equal everywhere: never ahead
    ]
    for win, want in cases:
        rows = _rows(full, win)
        best = bc.crossover(rows)["tiny dflash"]["best"]
        got = None if best is None else (best["from"], best["ge"])
        assert got == want, (win, best)
        line = bc.verdict(bc.crossover(rows), rows)[0]
        assert ("did not pay within contexts 64-512" in line) is (want is None), line
        if want:
            assert line.startswith(f"tiny dflash: windowing pays from context {want[0]} "
                                   "(window lag+8"), line
    rows = _rows(full, [8.0, 5.0, 3.5, 2.5])
    rows[-1].update(status="error", accept=None)  # a row that did not finish is left out
    assert bc.crossover(rows)["tiny dflash"]["best"]["at"] == 256


def test_the_smallest_run_writes_its_rows_and_a_statement_from_them(tmp_path: Path) -> None:
    assert bc.main(["--out", str(tmp_path), "--families", "eagle3", "--contexts", "64",
                    "--draft-windows", "lag+8", "--device", "cpu", "--requests", "1",
                    "--new", "8", "--commit", "test"]) == 0
    rec = json.loads((tmp_path / "accept-context-cpu.json").read_text())
    rows = rec["rows"]
    assert [(r["window"], r["draft_window"], r["context"]) for r in rows] == [
        ("full", None, 64), ("lag+8", 32, 64)]
    for r in rows:
        assert r["status"] == "ok" and r["accept"] >= 1, r
        assert r["windows_used"] == [r["draft_window"]], r  # the plan narrowed the draft so
        assert len(r["accept_per_request"]) == 1 and r["accept_steps"][0]
    assert rec["meta"]["crossover"] == bc.crossover(rows)
    md = (tmp_path / "accept-context-cpu.md").read_text()
    for line in bc.verdict(bc.crossover(rows), rows):
        assert f"- {line}" in md
    assert "Commit `test`" in md and "cpu" in md
    assert (tmp_path / "accept-context-cpu.png").stat().st_size > 0
