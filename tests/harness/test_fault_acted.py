"""Every fault counts the times it acted: on its documented launch line (the `# Launch:` line of
its conf/faults file) it acts and is caught; on a workload that gives it nothing to change the
run is `inert` (exit 3), never ok; where the configuration alone cannot feed it, it is refused
(exit 2) before anything runs."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from cli_process import run_cli

import swafactory
from swafactory.config.paths import conf_dir, group_options
from swafactory.errors import EXIT_CONFIG, EXIT_CONFORMANCE, EXIT_INERT
from swafactory.harness.callback import build_matrix
from swafactory.outputs.inert import LACKS
from swafactory.engine.report_model import GenerateReport
from swafactory.harness.report_model import Report

FAULTS = [f for f in group_options("faults") if f != "none"]
PREFIX = "# Launch: python -m swafactory "


def launch_args(fault: str) -> list[str]:
    """The overrides of ``fault``'s documented launch line."""
    lines = [x for x in (conf_dir() / "faults" / f"{fault}.yaml").read_text().splitlines()
             if x.startswith(PREFIX)]
    assert len(lines) == 1, f"conf/faults/{fault}.yaml needs one '{PREFIX}…' line"
    return shlex.split(lines[0][len(PREFIX):])


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return run_cli([*args, f"hydra.run.dir={tmp_path}"], timeout=300, cwd=tmp_path,
                   env={**os.environ, "COLUMNS": "140"})


def test_every_fault_has_a_launch_line_and_an_inert_hint() -> None:
    assert FAULTS and set(LACKS) == set(FAULTS)
    for f in FAULTS:
        assert f"faults={f}" in launch_args(f)


@pytest.mark.parametrize("fault", FAULTS)
def test_the_documented_launch_line_acts_and_is_caught(fault: str, tmp_path) -> None:
    args = launch_args(fault)
    out = _cli(tmp_path, *args)
    assert out.returncode == EXIT_CONFORMANCE, out.stderr[-2000:]
    text = (tmp_path / "report.json").read_text()
    if "run=generate" in args:  # an engine-path fault (the generator's graph keying)
        gen = GenerateReport.model_validate_json(text)
        assert gen.status == "failed" and gen.fault == fault, gen.caught_by
        assert gen.fault_acted.get(fault, 0) > 0, gen.fault_acted
        caught = gen.caught_by
    else:
        report = Report.model_validate_json(text)
        assert report.status == "failed" and report.fault == fault, report.mismatch
        assert report.fault_acted.get(fault, 0) > 0, report.fault_acted
        caught = report.mismatch.check
    assert f"caught by the {caught} check" in out.stderr
    assert json.loads((tmp_path / "result.json").read_text())["status"] == "failed"


def test_a_fault_whose_workload_never_shrinks_a_bucket_is_inert_not_ok(tmp_path) -> None:
    """Two requests at a time: a batch never shrinks inside a graph bucket (2 → bucket 2,
    1 → bucket 1), so graph_pad_stale_swa_loc has nothing to change and the run proves nothing."""
    out = _cli(tmp_path, "faults=graph_pad_stale_swa_loc", "backend.cuda_graph=true",
               "model=tiny", "spec=none", "workload=smoke", "workload.max_running_requests=2")
    assert out.returncode == EXIT_INERT, out.stderr[-2000:]
    report = Report.model_validate_json((tmp_path / "report.json").read_text())
    assert report.status == "inert" and report.mismatch is None
    assert report.fault_acted == {"graph_pad_stale_swa_loc": 0}
    assert "no batch shrank inside a graph bucket; try workload=smoke (four requests at once)" in report.inert
    assert "conformance INERT: graph_pad_stale_swa_loc never acted" in out.stderr
    assert json.loads((tmp_path / "result.json").read_text())["status"] == "inert"
    md = build_matrix(tmp_path)  # a sweep shows inert as its own outcome
    assert "0 ok, 0 refused, 0 failed, 1 inert" in md and "| **inert** |" in md


@pytest.mark.parametrize("args,needs", [
    (["faults=tree_mask_not_rebased", "spec=none"], "tree_mask_not_rebased needs spec.topk > 1"),
    (["faults=skip_spec_translation", "spec=none", "model=tiny"],
     "skip_spec_translation needs spec.topk > 1"),
    (["faults=allocator_pool_for_own_pool_draft", "spec=none", "run=plan"],
     "allocator_pool_for_own_pool_draft needs spec.draft_kv=own_pool"),
], ids=["conformance", "tiny", "plan"])
def test_a_fault_the_configuration_cannot_feed_is_refused_in_every_mode(tmp_path, args,
                                                                        needs) -> None:
    """One rule: where `fault_needs` can tell, a fault that cannot act is refused at
    configuration time (exit 2), naming its needs, not a backend; nothing runs or is planned.
    Inert (exit 3) is left to what the workload decides at run time."""
    out = _cli(tmp_path, *args)
    assert out.returncode == EXIT_CONFIG, out.stderr[-2000:]
    assert needs in out.stderr and "Fix: spec=" in out.stderr
    assert "found no backend" not in out.stderr and "registered backend" not in out.stderr
    assert not (tmp_path / "report.json").exists() and not (tmp_path / "plan.json").exists()
    assert json.loads((tmp_path / "result.json").read_text())["status"] == "refused"


def test_in_process_counts_start_from_zero_per_run() -> None:
    """The counts are cleared per run: a clean run after a faulty one reports no fault."""
    base = ["backend=torch", "model=tiny", "spec=none", "workload=smoke",
            "workload.num_requests=2"]
    bad = swafactory.run(swafactory.compose([*base, "faults=window_off_by_one"]))
    assert bad.status == "failed" and bad.fault_acted["window_off_by_one"] > 0
    clean = swafactory.run(swafactory.compose(base))
    assert clean.status == "ok" and clean.fault_acted == {} and clean.inert is None


def test_auto_says_what_it_chose_and_why() -> None:
    r = swafactory.run(swafactory.compose(["backend=auto", "model=tiny", "spec=none",
                                           "workload=smoke", "workload.num_requests=2"]))
    assert r.backend == "torch"
    assert r.backend_choice == "auto → torch, bf16 KV: no CUDA device"
