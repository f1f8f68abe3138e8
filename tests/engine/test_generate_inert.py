"""run=generate counts the times its fault acted, like the conformance run: a fault that acted
is caught (exit 1) with its count in report.json; one that never acted ends `inert` (exit 3),
never ok, and a sweep's matrix.md shows it as its own outcome."""
from __future__ import annotations

import json
import os

import pytest

from cli_process import run_cli

pytest.importorskip("transformers")

import swafactory  # noqa: E402
from swafactory.engine.run import run_generate  # noqa: E402
from swafactory.errors import EXIT_INERT  # noqa: E402
from swafactory.harness.callback import build_matrix  # noqa: E402

SMALL = ["run=generate", "backend=torch", "model=tiny", "workload.num_requests=2",
         "workload.seed=1", "workload.max_running_requests=2", "workload.prompt_over_window=[4,20]",
         "workload.output_len=[5,7]", "workload.chunk_size=16", "run.hidden_size=32",
         "run.intermediate_size=32", "run.vocab_size=128"]


def test_a_fault_that_acted_is_counted_and_caught() -> None:
    r = run_generate(swafactory.compose([*SMALL, "faults=window_off_by_one", "run.guards=false"]))
    assert r.status == "failed" and r.inert is None, r.checks
    assert r.fault_acted["window_off_by_one"] > 0


def test_a_fault_that_never_acted_is_inert_not_ok(tmp_path) -> None:
    """A self-draft accepts every token: the fault that leaks rejected drafts' slots has nothing
    to change, so the run proves nothing and must not end ok."""
    out = run_cli([*SMALL, "spec=eagle", "faults=leak_rejected_draft_slots",
                   f"hydra.run.dir={tmp_path}"], timeout=300, cwd=tmp_path,
                  env={**os.environ, "COLUMNS": "140"})
    assert out.returncode == EXIT_INERT, out.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["status"] == "inert" and report["fault_acted"] == {
        "leak_rejected_draft_slots": 0}
    assert "leak_rejected_draft_slots never acted: no draft token was rejected" in report["inert"]
    assert "generate INERT: leak_rejected_draft_slots never acted" in out.stderr
    assert json.loads((tmp_path / "result.json").read_text())["status"] == "inert"
    md = build_matrix(tmp_path)
    assert "1 inert" in md and "| **inert** |" in md and "no draft token was rejected" in md
