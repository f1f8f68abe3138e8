"""A host that runs two forwards ahead gives bit-identical outputs to the serial run
(`run_ahead.py`: eight forwards of different batches, a long kernel queued before each), for
decode, chain verify, tree verify and draft extend, on flashinfer and triton, guards on and off.

Each (backend, guards) pair runs in its own process: an illegal memory access (what FlashInfer's
reused pinned plan workspace gave before `kernels/flashinfer_staging.py`) ends the process's CUDA
context, and with it the modes after it, which still fails the pair.
Guards on must pass for the same reason as guards off, not because a guard synchronizes, so
both are run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from run_ahead import MODES

SCRIPT = Path(__file__).with_name("run_ahead.py")
ROOT = SCRIPT.parents[2]


@pytest.mark.gpu
@pytest.mark.parametrize("guards", [False, True], ids=["guards_off", "guards_on"])
@pytest.mark.parametrize("backend", ["flashinfer", "triton"])
def test_host_two_forwards_ahead_is_bit_identical(backend: str, guards: bool) -> None:
    """Every mode in one process per (backend, guards): its start-up (imports, kernel builds,
    FlashInfer's layout check) is most of a case's time."""
    pytest.importorskip(backend)
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    modes = sorted(MODES)
    args = [sys.executable, str(SCRIPT), "--backend", backend, "--mode", ",".join(modes),
            "--ahead", "2"]
    r = subprocess.run(args + (["--guards"] if guards else []), capture_output=True, text=True,
                       env=env, timeout=600)
    tail = (r.stdout + r.stderr)[-3000:]
    results = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert r.returncode == 0, f"run-ahead {backend} guards={guards} failed:\n{tail}"
    assert [x["mode"] for x in results] == modes, tail
    for x in results:
        assert x["mismatches"] == 0, x
        assert x["forwards"] == 8 and x["layers"] >= 2
