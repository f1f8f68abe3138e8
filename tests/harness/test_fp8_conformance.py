"""fp8 KV through the main job: each draft family passes against the dequantized oracle, the error
against the unrounded K/V is reported beside it, and every fault is still caught by its check."""
from __future__ import annotations

import pytest

import swafactory
from test_conformance import FAULT_OVERRIDES, FAULTS

FP8 = ("backend=torch", "workload=smoke", "model=gpt_oss_20b", "backend.kv_dtype=fp8_e4m3")


@pytest.mark.parametrize("spec", ["none", "eagle3", "frozen_kv_mtp", "dflash"])
def test_each_draft_family_passes_against_the_dequantized_oracle(spec: str) -> None:
    """An own-pool draft (eagle3), a FROZEN_KV draft reading the target's fp8 layers, a DFlash
    block, and no draft (the chain-draft specs share eagle3's pools and paths)."""
    r = swafactory.run(swafactory.compose([*FP8, f"spec={spec}"]))
    assert r.status == "ok", r.mismatch
    assert r.max_rel_err <= r.tolerance
    # the pool rounded what it stored: against the unrounded K/V the outputs are further off
    # (GPT-OSS, scale D^-0.5: a few percent), and the run says so
    assert r.kv_quant_error is not None and r.max_rel_err < r.kv_quant_error < 0.5


def test_bf16_runs_report_no_fp8_error() -> None:
    r = swafactory.run(swafactory.compose([*FP8[:3], "backend.kv_dtype=bfloat16", "spec=none"]))
    assert r.status == "ok" and r.kv_quant_error is None


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_each_fault_is_still_caught_with_fp8_kv(fault: str) -> None:
    spec, check = FAULTS[fault]
    extra = [o for o in FAULT_OVERRIDES.get(fault, ()) if not o.startswith("backend.kv_dtype")]
    r = swafactory.run(swafactory.compose([*FP8, f"spec={spec}", f"faults={fault}", *extra]))
    assert r.status == "failed" and r.mismatch.check == check, r.mismatch
