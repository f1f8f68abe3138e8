"""run=generate under a draft window: the draft model attends through it, the oracle and the
draft's eager reference follow it, and a draft model that was not told fails the kernel check."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import swafactory  # noqa: E402
from swafactory.engine.run import run_generate  # noqa: E402
from swafactory.models import build as build_module  # noqa: E402

SMALL = ["run=generate", "backend=torch", "workload.num_requests=2", "workload.seed=1",
         "workload.max_running_requests=2", "workload.prompt_over_window=[4,20]",
         "workload.output_len=[5,7]", "workload.chunk_size=16", "run.hidden_size=32",
         "run.intermediate_size=32", "run.vocab_size=128", "model.sliding_window=16",
         "run.oracle=true", "spec.draft_window=8"]
GPT_OSS = ["model=gpt_oss_20b", "run.num_layers=4"]


@pytest.mark.parametrize("overrides", [
    ["spec=eagle"],  # a copy of the target: no ideal any more, the torch run's steps instead
    ["spec=frozen_kv_mtp"],
    ["spec=dflash"],
    [*GPT_OSS, "spec=standalone", "spec.draft_weights=random", "spec.draft_kv_retention=window"],
    [*GPT_OSS, "spec=dflash", "spec.draft_kv_retention=window"],
], ids=["eagle-copy", "frozen_kv_mtp", "dflash", "standalone-retained", "dflash-retained"])
def test_a_windowed_draft_is_checked_through_its_window(overrides) -> None:
    r = run_generate(swafactory.compose([*SMALL, *overrides]))
    assert r.status == "ok", (r.caught_by, r.error, r.checks)
    checks = {c.name: c for c in r.checks}
    assert checks["oracle"].status == "ok" and "draft" in checks["oracle"].detail
    assert checks["acceptance"].status == "ok" and checks["lossless"].status == "ok"
    assert "draft window 8" in r.draft
    # a writing draft's logits against transformers' eager under the same window (`windowed_eager`)
    reader = "spec=frozen_kv_mtp" in overrides
    assert checks["draft_logits"].status == ("skipped" if reader else "ok"), checks["draft_logits"]


def test_a_draft_model_not_told_its_window_fails_the_kernel_check(monkeypatch) -> None:
    monkeypatch.setattr(build_module, "window_draft", lambda model, w, sink=0: model)
    r = run_generate(swafactory.compose([*SMALL, "spec=dflash"]))
    assert r.status == "failed" and r.caught_by == "kernel", (r.caught_by, r.error)
    assert "plan's window is 8" in r.error


def test_a_draft_sink_is_served_and_checked_and_a_model_not_told_it_fails() -> None:
    """spec.draft_sink: the first keys stay visible beside the draft window; the oracle, the
    draft's eager reference (`windowed_eager`) and the kernel check all follow it."""
    r = run_generate(swafactory.compose([*SMALL, "spec=dflash", "spec.draft_sink=4"]))
    assert r.status == "ok", (r.caught_by, r.error, r.checks)
    checks = {c.name: c for c in r.checks}
    assert checks["draft_logits"].status == "ok" and "draft" in checks["oracle"].detail
    assert "draft window 8 + 4 sink keys" in r.draft


def test_a_draft_model_not_told_its_sink_fails_the_kernel_check(monkeypatch) -> None:
    real = build_module.window_draft
    monkeypatch.setattr(build_module, "window_draft", lambda model, w, sink=0: real(model, w))
    r = run_generate(swafactory.compose([*SMALL, "spec=dflash", "spec.draft_sink=4"]))
    assert r.status == "failed" and r.caught_by == "kernel", (r.caught_by, r.error)
    assert "the plan's 4 (spec.draft_sink)" in r.error


def test_the_draft_logits_reference_reads_the_window_too(monkeypatch) -> None:
    from swafactory.engine import checks as checks_module

    monkeypatch.setattr(checks_module, "eager_name", lambda model: "eager")  # the window dropped
    r = run_generate(swafactory.compose([*SMALL, "spec=dflash"]))
    checks = {c.name: c for c in r.checks}
    assert checks["draft_logits"].status == "failed", checks["draft_logits"]


@pytest.mark.parametrize("fault, extra, check", [
    # rows no accept reaches (a block's later queries): only the draft rows against the twin's
    ("block_window_one_left_bound", [], "acceptance"),
    ("draft_planned_with_group0", [], "draft_logits"),
    ("windowed_draft_admitted_as_full", [*GPT_OSS, "spec.draft_kv_retention=window"], "capacity"),
])
def test_the_draft_window_faults_show_with_the_guards_off(fault: str, extra, check: str) -> None:
    over = [*SMALL, "run.oracle=false", "run.guards=false", "spec=dflash", *extra]
    r = run_generate(swafactory.compose([*over, f"faults={fault}"]))
    assert r.status == "failed" and r.caught_by == check, (r.caught_by, r.error, r.checks)
    assert r.fault_acted[fault] > 0
