"""Per-request spec figures in vLLM's schema (`engine/spec_metrics.py`), in report.json and held
to each other by the `spec_metrics` check: on every spec family they agree with the run's own
accept lengths and tokens, and a planted off-by-one fails the run."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import swafactory  # noqa: E402
import swafactory.engine.run as run_mod  # noqa: E402
from swafactory.engine.report_model import GenerateReport, SpecMetrics  # noqa: E402
from swafactory.engine.run import run_generate  # noqa: E402
from swafactory.engine.spec_metrics import (request_metrics, spec_metrics_check,  # noqa: E402
                                            total_metrics)

SMALL = ["run=generate", "backend=torch", "model=tiny", "workload.num_requests=2",
         "workload.seed=1", "workload.max_running_requests=2", "workload.prompt_over_window=[4,20]",
         "workload.output_len=[5,7]", "workload.chunk_size=16"]
SPECS = {"eagle": ["spec=eagle", "spec.num_steps=3", "spec.num_draft_tokens=4"],
         "eagle3": ["spec=eagle3"],  # a tree
         "dflash": ["spec=dflash"],
         "frozen_kv_mtp": ["spec=frozen_kv_mtp"]}


def _gen(*overrides: str) -> GenerateReport:
    return run_generate(swafactory.compose([*SMALL, *overrides]))


@pytest.mark.parametrize("family", sorted(SPECS))
def test_every_request_carries_figures_that_agree_with_its_run(family: str) -> None:
    r = _gen(*SPECS[family])
    assert r.status == "ok", r.checks
    check = {c.name: c for c in r.checks}["spec_metrics"]
    assert check.status == "ok" and "spec steps" in check.detail, check
    total = r.spec_metrics
    drafted = swafactory.compose([*SMALL, *SPECS[family]]).spec.num_draft_tokens - 1
    for q in r.requests:
        m = q.spec_metrics
        assert m.num_spec_steps == len(q.accept_lengths) > 0
        assert m.acceptance_histogram == q.accept_histogram
        assert m.num_accepted_tokens == sum(q.accept_lengths) - len(q.accept_lengths)
        assert m.num_draft_tokens == drafted * m.num_spec_steps
        assert m.completion_tokens >= q.max_new_tokens == len(q.generated_ids)
        assert m.non_spec_tokens >= 1  # the prefill's token
    assert total.mean_acceptance_length == pytest.approx(r.accept_len)
    assert total.completion_tokens == sum(q.spec_metrics.completion_tokens for q in r.requests)
    assert 0.0 <= total.draft_acceptance_rate <= 1.0


def test_spec_none_has_no_figures() -> None:
    r = _gen("spec=none")
    assert r.spec_metrics is None and all(q.spec_metrics is None for q in r.requests)
    assert {c.name: c for c in r.checks}["spec_metrics"].status == "skipped"


def test_a_planted_off_by_one_fails_the_run(monkeypatch) -> None:
    """The accepted count one too high (a bonus counted as a draft): the run fails, naming the
    relation it broke."""
    def off_by_one(accepts, drafted, completion, non_spec):
        m = request_metrics(accepts, drafted, completion, non_spec)
        return m.model_copy(update={"num_accepted_tokens": m.num_accepted_tokens + 1})

    monkeypatch.setattr(run_mod, "request_metrics", off_by_one)
    r = _gen(*SPECS["eagle"])
    assert r.status == "failed" and r.caught_by == "spec_metrics", r.checks
    detail = {c.name: c for c in r.checks}["spec_metrics"].detail
    assert "request 0: accepted" in detail and "bonus" in detail, detail


@pytest.mark.parametrize("field, delta, says", [
    ("acceptance_histogram", [0, 1], "the histogram sums to"),
    ("mean_acceptance_length", 0.5, "accept length"),
    ("non_spec_tokens", 1, "accepted"),
    ("num_draft_tokens", -9, "accepted of"),
])
def test_each_relation_fails_on_its_own_error(field: str, delta, says: str) -> None:
    accepts = [3, 1, 4]
    good = request_metrics(accepts, 3, completion=9, non_spec=1)
    assert spec_metrics_check([(0, accepts, good)], total_metrics([good])).status == "ok"
    value = getattr(good, field)
    bad = good.model_copy(update={field: [a + b for a, b in zip(value, delta + [0] * len(value))]
                                  if isinstance(value, list) else value + delta})
    got = spec_metrics_check([(0, accepts, bad)], total_metrics([good]))
    assert got.status == "failed" and says in got.detail, got.detail


def test_the_totals_are_the_requests_sums() -> None:
    a = request_metrics([2, 3], 4, completion=6, non_spec=1)
    b = request_metrics([1], 4, completion=2, non_spec=1)
    t = total_metrics([a, b])
    assert (t.num_spec_steps, t.num_draft_tokens, t.num_accepted_tokens) == (3, 12, 3)
    assert t.mean_acceptance_length == pytest.approx(6 / 3) and t.draft_acceptance_rate == 0.25
    assert t.acceptance_histogram == [0, 1, 1, 1]
    wrong = t.model_copy(update={"num_spec_steps": 4, "acceptance_histogram": [0, 2, 1, 1]})
    got = spec_metrics_check([(0, [2, 3], a), (1, [1], b)], wrong)
    assert got.status == "failed" and "not the requests' sum" in got.detail
    assert isinstance(t, SpecMetrics)
