"""`run()` as it runs and as it reports: a `Tick` per step whose estimated total is exact without
spec, first-use forwards (where kernels compile) timed apart from the steady-state per-step
figures, and the end-of-run leak accounting wired to the report and the `leak` check."""
from __future__ import annotations

import time
from statistics import mean

import pytest

import swafactory
from swafactory.backend import AttentionBackend
from swafactory.harness import leaks

SMALL = ["backend=torch", "model=tiny", "workload.num_requests=3",
         "workload.prompt_over_window=[4,24]", "workload.output_len=[3,8]"]
COMPILE_S = 2.0
"""A stand-in for a first-use JIT compile: far above any tiny step's attention time."""


def test_steps_estimate_first_use_and_leak_books_of_a_clean_run(monkeypatch) -> None:
    real, seen = AttentionBackend.forward, set()

    def compiles_on_first_call(self, *a, **kw):
        if id(self) not in seen:
            seen.add(id(self))
            time.sleep(COMPILE_S)
        return real(self, *a, **kw)

    monkeypatch.setattr(AttentionBackend, "forward", compiles_on_first_call)
    ticks = []
    r = swafactory.run(swafactory.compose([*SMALL, "spec=none"]), on_progress=ticks.append)
    assert r.status == "ok", r.mismatch
    # a tick before the first step and after each; without spec the estimate replays the
    # scheduler exactly
    assert [t.step for t in ticks] == list(range(r.steps + 1))
    assert {t.est_steps for t in ticks} == {r.steps}
    last = ticks[-1]
    assert (last.finished, last.requests, last.checks, last.passed) == (r.requests, r.requests,
                                                                        r.checks, r.passed)
    assert (last.peak_swa_use, last.peak_full_use) == (r.peak_swa_use, r.peak_full_use)
    assert all(t.compiling is None for t in ticks)  # announced on CUDA only
    # the first forward of each mode is timed apart; the "compile" is in it, not in a step time
    assert set(r.first_use) == {"target/extend", "target/decode"}
    assert r.first_use["target/extend"] >= COMPILE_S
    assert r.first_use_s == pytest.approx(sum(r.first_use.values()))
    firsts = [h for h in r.history if h.first_use_ms > 0]
    assert [h.kind for h in firsts] == ["prefill", "decode"]
    assert sum(h.first_use_ms for h in firsts) == pytest.approx(1000 * r.first_use_s)
    steady = [h for h in r.history if h.first_use_ms == 0]
    assert r.steady_steps == len(steady) == r.steps - 2
    assert max(h.attention_ms for h in steady) < 1000 * COMPILE_S
    assert r.attention_ms_per_step == pytest.approx(mean(h.attention_ms for h in steady))
    assert r.planning_ms_per_step == pytest.approx(mean(h.planning_ms for h in steady))
    # every pool and table counted, none leaked
    assert {"target.full", "target.swa", "req_to_token"} <= set(r.leaked)
    assert set(r.leaked.values()) == {0}


def test_spec_step_estimate_is_close() -> None:
    ticks = []
    r = swafactory.run(swafactory.compose([*SMALL, "spec=eagle3"]), on_progress=ticks.append)
    assert r.status == "ok", r.mismatch
    est = ticks[0].est_steps  # accepted lengths are random: the mean is estimated, not the draw
    assert abs(est - r.steps) <= max(3, r.steps // 4), (est, r.steps)
    # raised when the run goes past it; the last tick carries the real count
    assert all(t.est_steps == max(est, t.step) for t in ticks[:-1])
    assert (ticks[-1].step, ticks[-1].est_steps) == (r.steps, r.steps)


def test_a_leak_at_the_end_fails_the_run_with_the_leak_check(monkeypatch) -> None:
    real = leaks.leaked
    monkeypatch.setattr(leaks, "leaked", lambda parts: {**real(parts), "target.swa": 3})
    r = swafactory.run(swafactory.compose([*SMALL, "spec=none"]))
    assert r.status == "failed" and r.checks == r.passed  # every check passed; the books did not
    assert r.leaked["target.swa"] == 3 and r.leaked["target.full"] == 0
    m = r.mismatch
    assert (m.check, m.step, m.mode) == ("leak", r.steps, "end of run")
    assert m.error == leaks.leak_message(r.leaked) and "target.swa 3 slots" in m.error
