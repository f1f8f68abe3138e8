"""A host that runs two forwards ahead gives bit-identical outputs to the serial run
(`run_ahead.py`: eight forwards of different batches, a long kernel queued before each), for
decode, chain verify, tree verify and draft extend, on flashinfer and triton, guards on and off.

Each case runs in its own process: an illegal memory access (what FlashInfer's reused pinned
plan workspace gave before `kernels/flashinfer_staging.py`) ends the process's CUDA context.
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
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("backend", ["flashinfer", "triton"])
def test_host_two_forwards_ahead_is_bit_identical(backend: str, mode: str, guards: bool) -> None:
    pytest.importorskip(backend)
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    args = [sys.executable, str(SCRIPT), "--backend", backend, "--mode", mode, "--ahead", "2"]
    r = subprocess.run(args + (["--guards"] if guards else []), capture_output=True, text=True,
                       env=env, timeout=600)
    tail = (r.stdout + r.stderr)[-3000:]
    assert r.returncode == 0, f"run-ahead {backend} {mode} guards={guards} failed:\n{tail}"
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["mismatches"] == 0, result
    assert result["forwards"] == 8 and result["layers"] >= 2
