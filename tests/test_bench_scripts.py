"""The GPU-host scripts in bench/ take OUT (gpu_session.sh: a backend) as their first
argument; `--help` there prints the script's header comment and makes nothing (an empty
`--help` folder once appeared in a checkout's root), and any other option exits 2."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (ROOT / "bench").glob("*.sh")
                 if p.name not in ("gpu_env.sh", "gpu_usage.sh"))


def test_every_out_script_is_covered() -> None:
    assert len(SCRIPTS) >= 10
    assert all("gpu_usage.sh" in p.read_text() for p in SCRIPTS), \
        [p.name for p in SCRIPTS if "gpu_usage.sh" not in p.read_text()]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
@pytest.mark.parametrize("arg, rc", [("--help", 0), ("-h", 0), ("--deadline=5", 2)])
def test_an_option_is_not_an_out_folder(script: Path, arg: str, rc: int, tmp_path: Path) -> None:
    r = subprocess.run(["bash", str(script), arg], cwd=tmp_path, capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == rc, r.stderr
    head = script.read_text().splitlines()[1].lstrip("# ")
    assert r.stdout.startswith(head), r.stdout[:300]
    assert list(tmp_path.iterdir()) == []
    assert (rc == 0) is ("unknown option" not in r.stderr)


def test_bench_guards_help_makes_nothing_and_out_is_required(tmp_path: Path) -> None:
    """bench/bench_guards.py (a GPU bench) answers ``--help`` on any machine and makes nothing;
    a call without ``--out`` exits 2 naming it."""
    import sys

    script = ROOT / "bench" / "bench_guards.py"
    r = subprocess.run([sys.executable, str(script), "--help"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: bench_guards.py") and "--out" in r.stdout
    assert "--cases" in r.stdout and "--ctx" in r.stdout
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "--out" in r.stderr
    assert list(tmp_path.iterdir()) == []
