"""The `conf/experiment/` presets sweep their seed bug through the real CLI, and a sweep runs through
submitit's local executor (the code path of `hydra/launcher=submitit_slurm`).

Each preset sweeps `faults=<seed fault>,none` by itself (`hydra.mode: MULTIRUN` in the preset, no
`-m`). The full presets take about a minute together on one core, so the test runs them with one
short request (CHEAP); the faults still fire and the fixed runs are still checked against the
oracle. `python -m swafactory +experiment=NAME` alone runs the presets' own smoke workload.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from swafactory.config.paths import conf_dir
from swafactory.harness.callback import JobResult

# preset → (fault it sweeps, spec, the check that must catch it: FAULTS in test_conformance.py)
SEEDS = {
    "seed1_eagle3_untranslated_tables": ("skip_spec_translation", "eagle3", "space"),
    "seed2_dflash_allocator_pool": ("allocator_pool_for_own_pool_draft", "dflash", "space"),
    "seed3_frozen_kv_cached_pool": ("pool_cached_at_init", "frozen_kv_mtp", "nan"),
}
CHEAP = ["workload.num_requests=1", "workload.output_len=[4,4]", "workload.prompt_over_window=[2,8]"]


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swafactory", *args], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path, env={**os.environ, "COLUMNS": "160"})


def _rows(md: str) -> list[list[str]]:
    lines = [ln for ln in md.splitlines() if ln.startswith("| ") and not ln.startswith("| backend")]
    return [[c.strip() for c in ln.strip("|").split(" | ")] for ln in lines]


def test_every_preset_is_a_global_sweep_with_its_launch_command() -> None:
    presets = sorted(p.stem for p in (conf_dir() / "experiment").glob("*.yaml"))
    assert presets == sorted(SEEDS), "each preset needs its expected outcome in SEEDS"
    for name, (fault, spec, _) in SEEDS.items():
        path = conf_dir() / "experiment" / f"{name}.yaml"
        text = path.read_text()
        assert text.startswith("# @package _global_\n")
        assert f"python -m swafactory +experiment={name}" in text.split("\n\n")[0]
        cfg = OmegaConf.load(path)
        assert cfg.hydra.mode == "MULTIRUN"
        assert cfg.hydra.sweeper.params.faults == f"{fault},none"
        assert {"override /spec": spec} in OmegaConf.to_container(cfg.defaults)


@pytest.mark.parametrize("preset", sorted(SEEDS))
def test_preset_sweeps_the_fault_and_the_fix(preset: str, tmp_path) -> None:
    fault, spec, check = SEEDS[preset]
    sweep = tmp_path / "sweep"
    out = _cli(tmp_path, f"+experiment={preset}", f"hydra.sweep.dir={sweep}", *CHEAP)
    # the sweep's exit code follows its worst job (the fault row fails): judge by its files
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    results = {}
    for path in sorted(sweep.glob("*/result.json")):
        res = JobResult.model_validate_json(path.read_text())
        results[next(o for o in res.overrides if o.startswith("faults="))] = res
    assert sorted(results) == sorted([f"faults={fault}", "faults=none"]), out.stderr[-3000:]
    bad, good = results[f"faults={fault}"], results["faults=none"]
    assert (bad.backend, bad.spec, bad.workload) == ("torch", spec, "smoke")
    assert bad.status == "failed" and bad.report.fault == fault
    assert bad.report.mismatch.check == check
    assert good.status == "ok" and good.report.fault is None
    assert 0 < good.report.checks == good.report.passed

    md = (sweep / "matrix.md").read_text()
    assert "2 combinations" in md and "1 ok, 0 refused, 1 failed" in md
    rows = {r[4]: r for r in _rows(md)}
    assert sorted(rows) == ["**failed**", "**ok**"]
    assert f"fault `{fault}`" in rows["**failed**"][5]
    assert f"{check} check: " in rows["**failed**"][5]
    assert f"{good.report.checks}/{good.report.checks} checks" in rows["**ok**"][5]


def test_submitit_local_launcher_runs_a_sweep(tmp_path) -> None:
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    sweep = tmp_path / "sweep"
    out = _cli(tmp_path, "-m", "hydra/launcher=submitit_local", "run=plan", "backend=torch",
               "model=tiny,gpt_oss_20b", f"hydra.sweep.dir={sweep}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Submitit 'local' sweep output dir" in out.stdout + out.stderr
    # each job was pickled, run by submitit in its own process, and its result pickled back
    assert len(list((sweep / ".submitit").glob("*/*_result.pkl"))) == 2
    rows = _rows((sweep / "matrix.md").read_text())
    assert [r[:5] for r in rows] == [["torch", "eagle3", "gpt_oss_20b", "smoke", "**ok**"],
                                     ["torch", "eagle3", "tiny", "smoke", "**ok**"]]
    for n in (0, 1):
        plan = json.loads((sweep / str(n) / "plan.json").read_text())["plan"]
        assert plan["rows"], "each job planned its model"
