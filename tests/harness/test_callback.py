"""matrix.md from per-job result.json files: a fake Hydra app (its own config dir) and, once the CLI
writes result.json, the real `python -m swafactory -m`."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from cli_process import run_cli

from swafactory.harness.callback import JobResult, sweep_status, write_matrix

REASON_HEAD = "- `backend.name`: flash_attn needs a CUDA GPU"
REASON_DIM = "- `model.head_dim`: head_dim 512 > 256 | the kernel's limit"

APP = '''
import os, sys, time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig

from swafactory.harness.callback import JobResult
from swafactory.harness.report_model import Report

HERE = Path(__file__).parent


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def app(cfg):
    hc = HydraConfig.get()
    out = Path(hc.runtime.output_dir)
    if cfg.peers:  # rendezvous: every job waits until `peers` jobs are running at once
        arrived = HERE / "arrived"
        arrived.mkdir(exist_ok=True)
        (arrived / str(os.getpid())).touch()
        deadline = time.monotonic() + 60  # generous: worker processes start slowly on a busy host
        while len(list(arrived.iterdir())) < cfg.peers and time.monotonic() < deadline:
            time.sleep(0.05)
        (out / "rendezvous.txt").write_text(str(len(list(arrived.iterdir()))))
    if cfg.backend == "boom":
        raise RuntimeError("boom: the job crashed before writing result.json")
    common = dict(combination=f"backend={cfg.backend} spec={cfg.spec} model={cfg.model}",
                  overrides=list(hc.overrides.task), backend=cfg.backend, spec=cfg.spec,
                  model=cfg.model, workload=cfg.workload)
    if cfg.backend == "flash_attn":
        res = JobResult(status="refused", reasons=[%(r1)r, %(r2)r], **common)
    elif cfg.backend == "triton":
        res = JobResult(status="failed", report=Report.model_validate_json(
            (HERE / "failed.json").read_text()), **common)
    else:
        res = JobResult(status="ok", report=Report.model_validate_json(
            (HERE / "ok.json").read_text()), **common)
    (out / "result.json").write_text(res.model_dump_json())


if __name__ == "__main__":
    app()
''' % {"r1": REASON_HEAD, "r2": REASON_DIM}

CONFIG = """\
backend: torch
spec: none
model: gemma4
workload: smoke
peers: 0
hydra:
  callbacks:
    matrix:
      _target_: swafactory.harness.callback.MatrixCallback
"""


@pytest.fixture
def fake_app(tmp_path, make_report):
    """Write the fake app; returns run(*overrides) -> (CompletedProcess, sweep dir)."""
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "config.yaml").write_text(CONFIG)
    (tmp_path / "app.py").write_text(APP)
    (tmp_path / "ok.json").write_text(make_report().model_dump_json())
    (tmp_path / "failed.json").write_text(make_report(mismatch=True).model_dump_json())

    def run(*overrides: str, multirun: bool = True) -> tuple[subprocess.CompletedProcess, Path]:
        out_dir = tmp_path / ("multirun" if multirun else "run")
        args = ["-m", *overrides, f"hydra.sweep.dir={out_dir}"] if multirun else \
            [*overrides, f"hydra.run.dir={out_dir}"]
        out = subprocess.run([sys.executable, "app.py", *args],
                             capture_output=True, text=True, cwd=tmp_path, timeout=180)
        return out, out_dir

    return run


def _table_rows(md: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split(" | ")] for line in md.splitlines()
            if line.startswith("| ") and not line.startswith("| backend")]


def test_matrix_has_one_sorted_row_per_combination(fake_app) -> None:
    out, sweep = fake_app("backend=triton,torch,flash_attn", "spec=none,eagle3")
    assert out.returncode == 0, out.stderr
    assert f"wrote {sweep / 'matrix.md'}" in out.stdout
    md = (sweep / "matrix.md").read_text()
    assert "6 combinations" in md and "2 ok, 2 refused, 2 failed" in md
    rows = _table_rows(md)
    assert [r[:5] for r in rows] == [
        ["flash_attn", "eagle3", "gemma4", "smoke", "**refused**"],
        ["flash_attn", "none", "gemma4", "smoke", "**refused**"],
        ["torch", "eagle3", "gemma4", "smoke", "**ok**"],
        ["torch", "none", "gemma4", "smoke", "**ok**"],
        ["triton", "eagle3", "gemma4", "smoke", "**failed**"],
        ["triton", "none", "gemma4", "smoke", "**failed**"]]
    # refused: every reason, one per line; a `|` inside a reason must not split the cell
    assert rows[0][5] == (REASON_HEAD + "<br>" + REASON_DIM.replace("|", "\\|"))
    assert rows[2][5] == "234/234 checks, max rel err 3.3e-06, peak SWA 97.3%, accept 2.47"
    assert rows[4][5] == ("fault `window_off_by_one`<br>oracle check: step 17, target/target_verify, "
                          "layer 5 (swa), request r3: rel err 0.31 > tol 1e-3 at position 4097")
    assert "Jobs without a readable result" not in md


def test_a_crashing_job_still_leaves_a_matrix(fake_app) -> None:
    # Hydra re-raises the crash after the batch and skips on_multirun_end; on_job_end wrote it.
    out, sweep = fake_app("backend=torch,boom")
    assert out.returncode != 0 and "boom: the job crashed" in out.stderr
    md = (sweep / "matrix.md").read_text()
    assert [r[:5] for r in _table_rows(md)] == [["torch", "none", "gemma4", "smoke", "**ok**"]]
    assert "- `1` (backend=boom): no result.json yet (still running, or it crashed" in md


def test_a_single_run_writes_no_matrix(fake_app) -> None:
    out, run_dir = fake_app("backend=torch", multirun=False)
    assert out.returncode == 0, out.stderr
    assert (run_dir / "result.json").is_file() and not (run_dir / "matrix.md").exists()
    assert "matrix.md" not in out.stdout


def test_joblib_launcher_runs_jobs_in_parallel_and_writes_the_matrix(fake_app) -> None:
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    out, sweep = fake_app("hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "peers=2",
                          "backend=torch,flash_attn")
    assert out.returncode == 0, out.stderr
    assert "Joblib.Parallel(n_jobs=2" in out.stdout + out.stderr
    # Each job waited for the other: both were alive at once (serial jobs would see 1 and time out).
    assert sorted((sweep / str(n) / "rendezvous.txt").read_text() for n in (0, 1)) == ["2", "2"]
    rows = _table_rows((sweep / "matrix.md").read_text())
    assert [r[:5] for r in rows] == [["flash_attn", "none", "gemma4", "smoke", "**refused**"],
                                     ["torch", "none", "gemma4", "smoke", "**ok**"]]


def _result(**kw) -> dict:
    base = dict(combination="backend=torch spec=none model=tiny", overrides=["backend=torch"],
                backend="torch", spec="none", model="tiny", workload="smoke")
    return {**base, **kw}


def test_build_matrix_lists_unreadable_files_and_plan_only_jobs(tmp_path) -> None:
    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "result.json").write_text(JobResult(**_result(status="ok")).model_dump_json())
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "result.json").write_text('{"status": "ok"}')
    (tmp_path / "2" / ".hydra").mkdir(parents=True)
    (tmp_path / "2" / ".hydra" / "overrides.yaml").write_text("- backend=triton\n- spec=dflash\n")
    (tmp_path / "3").mkdir()
    (tmp_path / "3" / "result.json").write_text(
        JobResult(**_result(status="failed", error="KeyError: 'x'\nin loop.py")).model_dump_json())
    md = write_matrix(tmp_path).read_text()
    rows = _table_rows(md)
    assert rows[0][4:] == ["**ok**", "planned only (no report)"]
    assert rows[1][4:] == ["**failed**", "error: KeyError: 'x'<br>in loop.py"]
    assert "- `1/result.json`: " in md and "Field required" in md
    assert "- `2` (backend=triton spec=dflash): no result.json" in md
    assert not list(tmp_path.glob(".matrix.*"))  # the temp file was renamed into place


def test_matrix_is_readable_like_every_other_output(tmp_path) -> None:
    old = os.umask(0o022)  # the usual umask: write_text gives 0644; mkstemp alone gives 0600
    try:
        _write(tmp_path / "0", status="ok")
        path = write_matrix(tmp_path)
    finally:
        os.umask(old)
    mode = path.stat().st_mode & 0o777
    assert mode == 0o644 == (tmp_path / "0" / "result.json").stat().st_mode & 0o777, oct(mode)


def _write(d: Path, **kw) -> None:
    d.mkdir(parents=True)
    (d / "result.json").write_text(JobResult(**_result(**kw)).model_dump_json())


@pytest.mark.parametrize("statuses,worst", [
    ([], "ok"), (["ok", "ok"], "ok"), (["ok", "refused"], "refused"),
    (["refused", "ok", "failed"], "failed"), (["failed", "refused"], "failed"),
])
def test_sweep_status_is_the_worst_job(tmp_path, statuses, worst) -> None:
    evidence = {"ok": {}, "refused": {"reasons": ["- `x`: no"]}, "failed": {"error": "E"}}
    for i, st in enumerate(statuses):
        _write(tmp_path / str(i), status=st, **evidence[st])
    assert sweep_status(tmp_path) == worst


def test_a_job_without_a_result_makes_the_sweep_failed(tmp_path) -> None:
    _write(tmp_path / "0", status="ok")
    (tmp_path / "1" / ".hydra").mkdir(parents=True)
    (tmp_path / "1" / ".hydra" / "overrides.yaml").write_text("- backend=boom\n")
    assert sweep_status(tmp_path) == "failed"


def test_rows_of_one_combination_show_the_overrides_that_tell_them_apart(tmp_path) -> None:
    common = ["backend=torch", "workload.num_requests=2"]
    _write(tmp_path / "0", status="refused", reasons=["- `r`: too small"],
           overrides=[*common, "workload.swa_full_tokens_ratio=0.01"])
    _write(tmp_path / "1", status="ok", overrides=[*common, "workload.swa_full_tokens_ratio=auto"])
    _write(tmp_path / "2", status="ok", spec="eagle3", overrides=common)  # unique: no prefix
    rows = _table_rows(write_matrix(tmp_path).read_text())
    assert [r[5] for r in rows] == [
        "planned only (no report)",
        "`workload.swa_full_tokens_ratio=0.01`<br>- `r`: too small",
        "`workload.swa_full_tokens_ratio=auto`<br>planned only (no report)"]


@pytest.mark.parametrize("kw,message", [
    (dict(status="refused"), "needs at least one reason"),
    (dict(status="failed"), "needs the report or the error"),
    (dict(status="ok", extra_field=1), "Extra inputs are not permitted"),
    (dict(status="skipped"), "Input should be 'ok', 'refused', 'inert' or 'failed'"),
        (dict(status="inert"), "needs the report saying which fault never acted"),
])
def test_job_result_refuses_rows_without_evidence(kw, message) -> None:
    with pytest.raises(ValidationError, match=message):
        JobResult.model_validate(_result(**kw))


def test_real_cli_multirun_writes_the_matrix(tmp_path) -> None:
    sweep = tmp_path / "multirun"
    # one short request per job (as test_experiments' CHEAP): the matrix is the point here; the
    # smoke workload itself runs for every spec in test_conformance.py
    cheap = ["workload=smoke", "workload.num_requests=1", "workload.output_len=[4,4]",
             "workload.prompt_over_window=[2,8]"]
    out = run_cli(["-m", "backend=torch,flash_attn", "spec=none,eagle3", "model=gpt_oss_20b",
                   *cheap, f"hydra.sweep.dir={sweep}"], cwd=tmp_path, timeout=600,
                  env={**os.environ, "COLUMNS": "160"})
    assert out.returncode == 2, out.stderr[-3000:]  # the worst job was refused: ok < refused
    rows = {(r[0], r[1], r[4]) for r in _table_rows((sweep / "matrix.md").read_text())}
    assert rows == {("torch", "none", "**ok**"), ("torch", "eagle3", "**ok**"),
                    ("flash_attn", "none", "**refused**"), ("flash_attn", "eagle3", "**refused**")}
    results = [JobResult.model_validate_json(p.read_text()) for p in sweep.rglob("result.json")]
    refused = next(r for r in results if r.status == "refused")
    assert any("needs a CUDA GPU" in x for x in refused.reasons), refused.reasons
    ok = next(r for r in results if r.status == "ok" and r.spec == "eagle3")
    assert ok.combination == "backend=torch spec=eagle3 model=gpt_oss_20b" and ok.workload == "smoke"
    assert ok.report is not None and ok.report.passed == ok.report.checks > 0
