"""The command line as a user types it: plan output, plan.json, exit codes, no tracebacks."""
from __future__ import annotations

import json
import re

import pytest

from cli_process import run_cli


def test_plan_prints_gemma4_groups_and_writes_plan_json(cli, tmp_path) -> None:
    out = cli("backend=torch", "spec=eagle3", "model=gemma4", "run=plan")
    assert out.returncode == 0, out.stderr
    rows = {tuple(c.strip() for c in line.split("│")[1:-1])[:7] for line in out.stdout.splitlines()
            if line.startswith("│")}
    assert ("target", "swa", "0-4,6-10,12-16,…", "50", "swa", "swa", "16×256") in rows
    assert ("target", "full", "5,11,17,23,29,35,…", "10", "full", "full", "4×512") in rows
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())["plan"]
    assert [(r["group"], r["num_layers"]) for r in plan["rows"]] == [("swa", 50), ("full", 10),
                                                                      ("own", 1)]
    assert plan["hybrid_bytes_per_request"] < plan["full_only_bytes_per_request"]


def test_flash_attn_gemma4_exits_2_with_every_reason(cli) -> None:
    out = cli("backend=flash_attn", "model=gemma4")
    assert out.returncode == 2
    assert "Traceback" not in out.stderr + out.stdout
    assert "head_dim 512" in out.stderr and "needs a CUDA GPU" in out.stderr
    assert "Try: backend=torch" in out.stderr


def test_trtllm_eagle3_exits_2_with_sm100_and_topk(cli) -> None:
    out = cli("backend=trtllm_mha", "spec=eagle3")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "SM100" in out.stderr and re.search(r"topk=\d+ verifies a tree", out.stderr)


def test_typo_in_option_lists_the_options_and_exits_2(cli) -> None:
    out = cli("backend=flashinfr")
    assert out.returncode == 2
    assert "Available options in 'backend'" in out.stderr and "flashinfer" in out.stderr


def test_typo_in_option_says_did_you_mean_before_the_list(cli) -> None:
    out = cli("spec=eagel3", "model=tiny")
    assert out.returncode == 2
    guess = "`spec=eagel3`: no such spec option; did you mean eagle3"
    assert guess in out.stderr and "Available options in 'spec'" in out.stderr
    assert out.stderr.index(guess) < out.stderr.index("Available options in 'spec'")


def test_did_you_mean_checks_each_group_option_and_sweep_value() -> None:
    from swafactory.cli.jobs import did_you_mean

    assert did_you_mean(["spec=eagle3", "model=tiny", "spec.topk=2", "+experiment=x"]) == []
    assert did_you_mean(["backend=torch,trtion"]) == [
        "`backend=trtion`: no such backend option; did you mean triton?"]
    assert "did you mean gemma4 or gemma3_4b?" in did_you_mean(["model=gema4"])[0]  # closest first
    assert did_you_mean(["spec=zzzzzz", "hydra.run.dir=x", "nogroup=eagle3"]) == []


@pytest.mark.parametrize("typo,nearest", [("spec.topkk=2", "spec.topk=2"),
                                           ("modle=tiny", "model=tiny"),
                                           ("+spec.topkk=2", "spec.topk=2")])
def test_a_field_typo_says_did_you_mean_and_not_hydras_append_advice(cli, tmp_path, typo,
                                                                     nearest) -> None:
    """A mistyped field or group gets the nearest valid one, as a mistyped option does; not
    Hydra's "use +" advice, which only moved the error to "unknown field"."""
    out = cli(typo, "run=plan")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    key = typo.partition("=")[0].lstrip("+")
    assert f"- `{key}`: unknown " in out.stderr and f"(got {typo})" in out.stderr
    assert f"did you mean {nearest.partition('=')[0]}? Fix: {nearest}" in out.stderr
    assert "To append" not in out.stderr and "not in struct" not in out.stderr
    assert not (tmp_path / "run" / "plan.json").exists()  # refused before anything ran


def test_bad_field_gets_the_dotted_path(cli) -> None:
    out = cli("spec.topk=0")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "- `spec.topk`: must be ≥ 1, got 0" in out.stderr


def test_console_script_matches_python_m(tmp_path) -> None:
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    exe = shutil.which("swafactory") or str(Path(sys.executable).parent / "swafactory")
    out = subprocess.run([exe, "backend=torch", "model=mistral_7b", "run=plan",
                          f"hydra.run.dir={tmp_path}"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "8×128" in out.stdout and (tmp_path / "plan.json").is_file()


# ---------------------------------------------------------------- sweeps: every job runs
SMALL = ("workload=smoke", "workload.num_requests=2", "workload.prompt_over_window=[4,12]",
         "workload.output_len=[2,4]")  # the old default's four running requests: its refusal text


def _sweep(tmp_path, *overrides: str):
    import os

    sweep = tmp_path / "multirun"
    out = run_cli(["-m", *overrides, f"hydra.sweep.dir={sweep}"], cwd=tmp_path, timeout=300,
                  env={**os.environ, "COLUMNS": "160"})
    return out, sweep


def _results(sweep):
    from swafactory.harness.callback import JobResult

    return {p.parent.name: JobResult.model_validate_json(p.read_text())
            for p in sweep.glob("*/result.json")}


def test_a_sizing_refusal_in_a_sweep_is_a_refused_row_and_the_sweep_goes_on(tmp_path) -> None:
    out, sweep = _sweep(tmp_path, "backend=torch", "model=tiny", "spec=none",
                        "workload.swa_full_tokens_ratio=0.01,auto", *SMALL)
    assert out.returncode == 2, out.stderr[-3000:]  # the worst job was refused
    assert "Traceback" not in out.stderr and "sweep: worst job refused, exit 2" in out.stderr
    res = _results(sweep)
    assert sorted(res) == ["0", "1"]  # both jobs ran
    refused, ok = res["0"], res["1"]
    assert "workload.swa_full_tokens_ratio=0.01" in refused.overrides and refused.status == "refused"
    assert len(refused.reasons) == 1 and refused.reasons[0].startswith(
        "- `workload.swa_full_tokens_ratio`: 0.01 gives each of 4 running requests")
    assert ok.status == "ok" and ok.report.passed == ok.report.checks > 0
    md = (sweep / "matrix.md").read_text()
    assert "1 ok, 1 refused, 0 failed" in md
    rows = [line for line in md.splitlines() if line.startswith("| torch ")]
    assert len(rows) == 2
    assert "**refused** | `workload.swa_full_tokens_ratio=0.01`<br>- `workload." in rows[0]
    assert "**ok** | `workload.swa_full_tokens_ratio=auto`<br>" in rows[1]
    # no terminal: the ok job printed progress lines, step N/M, the last one at the end
    steps = [(int(n), int(m)) for n, m in re.findall(r"serving: step (\d+)/(\d+) ", out.stdout)]
    assert steps[0] == (0, ok.report.steps) and steps[-1] == (ok.report.steps, ok.report.steps)
    # each job's console output, refusal included, is in its job dir's log (docs/sweeps.md)
    refusal = (sweep / "0" / "__main__.log").read_text()
    assert "- `workload.swa_full_tokens_ratio`: 0.01 gives" in refusal
    log = (sweep / "1" / "__main__.log").read_text()
    assert f"serving: step {ok.report.steps}/{ok.report.steps} " in log
    assert f"wrote {sweep / '1' / 'report.json'}" in log


def test_a_single_run_logs_its_console_output_in_the_job_log(cli, tmp_path) -> None:
    out = cli("model=tiny", "backend=torch", *SMALL)
    assert out.returncode == 0, out.stderr[-3000:]
    log = (tmp_path / "run" / "__main__.log").read_text()
    assert log and log == out.stdout  # off a terminal: the same text, line for line
    assert "status" in log and f"wrote {tmp_path / 'run' / 'report.png'}" in log


@pytest.mark.parametrize("overrides,code,counts", [
    (("run=plan", "backend=torch", "model=tiny,gpt_oss_20b"), 0, "2 ok, 0 refused, 0 failed"),
    (("backend=torch", "model=tiny", "spec=none", "faults=window_off_by_one",
      "workload.swa_full_tokens_ratio=0.01,auto", *SMALL), 1, "0 ok, 1 refused, 1 failed"),
], ids=["all-ok", "failed-beats-refused"])
def test_a_sweep_exits_with_its_worst_job(tmp_path, overrides, code, counts) -> None:
    out, sweep = _sweep(tmp_path, *overrides)
    assert out.returncode == code, out.stderr[-3000:]
    assert counts in (sweep / "matrix.md").read_text()
    assert len(_results(sweep)) == 2


def test_a_sizing_refusal_in_a_single_run_exits_2(cli, tmp_path) -> None:
    out = cli("backend=torch", "model=tiny", "spec=none", "workload.swa_full_tokens_ratio=0.01")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "- `workload.swa_full_tokens_ratio`: 0.01 gives each" in out.stderr
    assert "Fix: workload.swa_full_tokens_ratio=auto" in out.stderr
    assert json.loads((tmp_path / "run" / "result.json").read_text())["status"] == "refused"


def _composed(*overrides: str):
    from hydra import compose, initialize_config_dir

    from swafactory.config.paths import conf_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_a_capacity_refusal_before_the_first_forward_is_refused(tmp_path, monkeypatch) -> None:
    from swafactory.cli.jobs import run_cli
    from swafactory.errors import CapacityError
    from swafactory.harness import run as run_module

    def short(*a, **kw):
        raise CapacityError("pool 'target.swa' is short: asked 40, 12 free")

    monkeypatch.setattr(run_module, "build_parts", short)
    cfg = _composed("backend=torch", "model=tiny", "spec=none")
    with pytest.raises(CapacityError):  # a single run: raised, so __main__ exits 2
        run_cli(cfg, tmp_path, overrides=["model=tiny"])
    assert run_cli(cfg, tmp_path, overrides=["model=tiny"], sweep=True) == 0
    res = json.loads((tmp_path / "result.json").read_text())
    assert res["status"] == "refused"
    assert res["reasons"] == ["pool 'target.swa' is short: asked 40, 12 free"]


def test_a_crash_in_a_sweep_job_leaves_a_failed_result(tmp_path, monkeypatch) -> None:
    from swafactory.cli.jobs import run_cli
    from swafactory.harness import run as run_module

    def crash(*a, **kw):
        raise KeyError("boom")

    monkeypatch.setattr(run_module, "run", crash)
    with pytest.raises(KeyError):  # Hydra records the crash; the row says failed, with the error
        run_cli(_composed("backend=torch", "model=tiny"), tmp_path, sweep=True)
    res = json.loads((tmp_path / "result.json").read_text())
    assert (res["status"], res["error"]) == ("failed", "KeyError: 'boom'")


def test_help_opens_with_what_it_does_exit_codes_and_groups(tmp_path) -> None:
    from swafactory.config.paths import GROUPS, group_options

    out = run_cli(["--help"], cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    ours, _, hydra_help = out.stdout.partition("swafactory is powered by Hydra.")
    assert hydra_help and "== Configuration groups ==" in hydra_help  # Hydra's own help follows
    assert ours.startswith("swafactory: builds attention backends")
    assert "Exit codes: 0 ok; 1 conformance failure" in ours and "2 configuration" in ours
    listed = " ".join(ours.split())
    assert "1 if any failed, else 3 if any was inert, else 2 if any was refused, else 0" in listed
    assert "3 inert" in listed  # a run whose fault never acted has its own code
    for group in GROUPS:
        assert f"{group}= {', '.join(group_options(group))}" in listed, group
    assert f"+experiment= {', '.join(group_options('experiment'))}" in listed
