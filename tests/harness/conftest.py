"""A hand-built `Report` for the report and matrix tests (no harness run needed)."""
from __future__ import annotations

import pytest

from swafactory.harness.report_model import Mismatch, ModeStats, Report, StepRecord


def build_report(*, mismatch: bool = False, spec: bool = True, steps: int = 40) -> Report:
    """A plausible eagle3 run on gemma4: SWA use climbs past 90%, errors ~1e-6 (0 = unchecked)."""
    history = [StepRecord(step=i, kind="prefill" if i < 3 else "decode", running=min(i + 1, 8),
                          swa_use=min(0.973, 0.1 + 0.03 * i), full_use=min(0.61, 0.05 + 0.01 * i),
                          max_rel_err=0.0 if i % 4 == 1 else 1e-6 * (1 + i % 5),
                          accept_len=(2.0 + 0.5 * (i % 3)) if spec and i >= 3 else None,
                          evicted=i % 3)
               for i in range(steps)]
    verify_passed = 104 if mismatch else 105
    return Report(
        status="failed" if mismatch else "ok", combination="backend=torch spec=eagle3 model=gemma4",
        device="cpu", backend="torch",
        parts={"resolver": "split_swa", "planner": "window_clamped", "kernel": "torch_sdpa",
               "tree": "custom_mask"},
        fault="window_off_by_one" if mismatch else None,
        layers_attended=[0, 1, 5, 6, 7, 11, 59], draft_layers=1, requests=16, steps=steps,
        mode_stats=[
            ModeStats(worker="target", mode="extend", forwards=12, attention_calls=84, checks=84,
                      passed=84, max_rel_err=2.1e-6),
            ModeStats(worker="target", mode="target_verify", forwards=30, attention_calls=210,
                      checks=105, passed=verify_passed, max_rel_err=0.31 if mismatch else 3.3e-6),
            ModeStats(worker="draft", mode="draft_decode", forwards=90, attention_calls=90,
                      checks=45, passed=45, max_rel_err=1.2e-6)],
        checks=234, passed=233 if mismatch else 234, max_rel_err=0.31 if mismatch else 3.3e-6,
        tolerance=1e-3, peak_swa_use=0.973, peak_full_use=0.61, evictions=1234,
        hybrid_bytes=3 * 2**30, full_only_bytes=11 * 2**30, draft_pool_bytes=96 * 2**20,
        accept_len=2.47 if spec else None, attention_ms_per_step=12.345, planning_ms_per_step=0.456,
        tokens_per_s=321.5, wall_s=18.2, history=history,
        mismatch=Mismatch(step=17, worker="target", mode="target_verify", layer=5, group="swa",
                          request="r3", error="rel err 0.31 > tol 1e-3 at position 4097",
                          check="oracle") if mismatch else None)


@pytest.fixture
def make_report():
    return build_report
