"""bench/bench_prefill.py (a GPU bench) answers ``--help`` on any machine and makes nothing, and
refuses a call without ``--out``."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "bench_prefill.py"


def test_help_prints_usage_and_makes_nothing(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(SCRIPT), "--help"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: bench_prefill.py") and "--out" in r.stdout
    assert "--chunks" in r.stdout and "--prefixes" in r.stdout
    assert list(tmp_path.iterdir()) == []


def test_out_is_required(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(SCRIPT)], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "--out" in r.stderr
    assert list(tmp_path.iterdir()) == []
