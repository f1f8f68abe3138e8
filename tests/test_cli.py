"""The command line as a user types it: plan output, plan.json, exit codes, no tracebacks."""
from __future__ import annotations

import json
import re


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
