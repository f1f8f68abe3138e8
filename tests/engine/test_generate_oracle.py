"""run=generate with run.oracle=true: the attention rows of every pass against the fp32 oracle.

Every shipped spec (conf/spec/*.yaml) runs clean with the oracle on, and the checks really ran
for each pass the spec has: target extend, decode or verify; draft decode and draft extend
(a FROZEN_KV draft only decodes, over the target's histories), eager and through emulated graph
replays. A planted wrong output (a window fault with the guards off, a perturbed draft layer)
fails the run with `OracleMismatch` naming runner, mode and layer.
Shapes are test_generate.py's: short prompts past a 16-token window, a few tokens out.
"""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

import swafactory  # noqa: E402
from swafactory.engine import run as run_mod  # noqa: E402
from swafactory.engine.run import run_generate  # noqa: E402

CONF = Path(__file__).resolve().parents[2] / "conf"
SPECS = sorted(p.stem for p in (CONF / "spec").glob("*.yaml"))  # every shipped spec
SMALL = ["run=generate", "backend=torch", "model=tiny", "workload.num_requests=2",
         "workload.seed=1", "workload.max_running_requests=2", "workload.prompt_over_window=[4,20]",
         "workload.output_len=[5,7]", "workload.chunk_size=16", "run.hidden_size=32",
         "run.intermediate_size=32", "run.vocab_size=128", "run.oracle=true",
         "run.oracle_rate=1.0"]  # the watch's own tests check every pass


@pytest.fixture
def watches(monkeypatch):
    """The watch of each generation `run_generate` starts (the main run's first)."""
    got, real = [], run_mod.attach_oracle

    def spy(parts, gen):
        w = real(parts, gen)
        got.append(w)
        return w

    monkeypatch.setattr(run_mod, "attach_oracle", spy)
    return got


def _passes(cfg) -> set[tuple[str, str]]:
    """(runner, mode) of every pass the config's spec runs, from its fields."""
    s = cfg.spec
    if s.algorithm == "none":
        return {("target", "extend"), ("target", "decode")}
    out = {("target", "extend"), ("target", "target_verify"), ("draft", "draft_decode")}
    return out | ({("draft", "draft_extend")} if s.draft_kv == "own_pool" else set())


def _check_ran(watch, cfg) -> None:
    """Every pass of the spec was checked (eager or replayed), each checked target pass at
    every layer, within tolerance; the first of each runner × mode × eager/replay always."""
    assert not watch.off, watch.off
    for runner, mode in _passes(cfg):
        keys = [(runner, mode, how) for how in ("eager", "replay")]
        assert sum(watch.forwards[k] for k in keys) > 0, (runner, mode, watch.summary())
        for key in keys:
            if not watch.passes[key]:
                continue
            assert watch.forwards[key] > 0 and watch.layer_checks[key] >= watch.forwards[key]
            if runner == "target":
                assert watch.layer_checks[key] == watch.forwards[key] * cfg.run.num_layers
            assert watch.max_err[key] <= watch.tolerance, (key, watch.summary())


@pytest.mark.parametrize("spec", SPECS)
def test_every_spec_checks_every_pass_against_the_oracle(spec: str, watches) -> None:
    cfg = swafactory.compose([*SMALL, f"spec={spec}"])
    r = run_generate(cfg)
    assert r.status == "ok", (r.caught_by, r.error, r.checks)
    _check_ran(watches[0], cfg)
    assert not any(how == "replay" for _, _, how in watches[0].passes)
    # the reference runs (spec=none for lossless) are watched too
    assert all(w is not None and not w.off for w in watches)
    # and the report says what it checked: ok with the passes, not "skipped"
    got = {c.name: c for c in r.checks}["oracle"]
    assert got.status == "ok" and "passes within tolerance" in got.detail, got
    assert "target target_verify eager" in got.detail or spec == "none", got.detail


def test_the_report_says_skipped_when_the_oracle_is_off() -> None:
    r = run_generate(swafactory.compose([*SMALL, "spec=eagle", "run.oracle=false"]))
    assert r.status == "ok", (r.caught_by, r.checks)
    assert {c.name: c for c in r.checks}["oracle"].status == "skipped"


@pytest.mark.parametrize("spec", ["eagle3", "frozen_kv_mtp", "dflash"])
def test_graph_replays_are_checked_from_their_tensors(spec: str, watches) -> None:
    """backend.cuda_graph=true on CPU: verify and draft passes replay emulated graphs (a
    FROZEN_KV draft's prefix-only steps run eagerly); each replay's rows are recorded and
    checked from the tensors kept under its graph's key, as after a CUDA replay. With
    oracle_rate < 1 only some passes are checked, the first of each kind always."""
    cfg = swafactory.compose([*SMALL, f"spec={spec}", "backend.cuda_graph=true",
                              "run.oracle_rate=0.5"])
    r = run_generate(cfg)
    assert r.status == "ok", (r.caught_by, r.error, r.checks)
    w = watches[0]
    _check_ran(w, cfg)
    assert r.cuda_graphs["target"]["replays"] > 0
    assert w.forwards[("target", "target_verify", "replay")] > 0, w.summary()
    if cfg.spec.draft_kv == "own_pool":  # a FROZEN_KV draft's prefix-only steps run eagerly
        assert w.forwards[("draft", "draft_decode", "replay")] > 0, w.summary()
    assert all(w.forwards[k] <= w.passes[k] for k in w.passes)
    assert sum(w.passes.values()) > sum(w.forwards.values()), w.summary()  # sampled


def test_a_window_fault_fails_the_oracle_with_the_guards_off(watches) -> None:
    r = run_generate(swafactory.compose([*SMALL, "spec=none", "faults=plan_without_window",
                                         "run.guards=false"]))
    assert r.status == "failed", (r.caught_by, r.checks)
    assert r.error.startswith("OracleMismatch: oracle: target extend layer "), r.error
    assert "(swa)" in r.error, r.error  # the sliding layers, which lost their window


def test_a_tree_fault_fails_the_oracle_at_the_first_tree_pass(watches) -> None:
    """The self-speculating copy drafts the same tree the target verifies: its tree levels meet
    the fault first."""
    r = run_generate(swafactory.compose([*SMALL, "spec=eagle3", "faults=tree_mask_not_rebased",
                                         "run.guards=false"]))
    assert r.status == "failed", (r.caught_by, r.checks)
    assert "oracle: draft draft_decode layer " in r.error, r.error


@pytest.mark.parametrize(("runner", "mode", "graphs"), [
    ("draft", "draft_decode", False), ("draft", "draft_extend", False),
    ("target", "target_verify", False), ("target", "target_verify", True)])
def test_a_perturbed_layer_fails_the_oracle(monkeypatch, runner: str, mode: str,
                                            graphs: bool) -> None:
    """One layer's output off by 1% in one runner's passes of one mode (eager, or inside an
    emulated graph replay): caught in that pass, at that layer."""
    real, hit = run_mod.attach_oracle, []

    def perturb(parts, gen):
        b = getattr(parts, runner).backend
        inner = b.forward

        def forward(q, k, v, layer_id, batch=None, save_kv=True, sinks=None):
            o = inner(q, k, v, layer_id, batch=batch, save_kv=save_kv, sinks=sinks)
            if layer_id == 2 and b.plan.mode == mode:
                hit.append(layer_id)
                return o * 1.01
            return o

        if not hit:  # the main run only
            b.forward = forward
        return real(parts, gen)

    monkeypatch.setattr(run_mod, "attach_oracle", perturb)
    r = run_generate(swafactory.compose([*SMALL, "spec=eagle",
                                         f"backend.cuda_graph={str(graphs).lower()}"]))
    assert hit and r.status == "failed", (r.caught_by, r.checks)
    how = " (graph replay)" if graphs else ""
    assert f"oracle: {runner} {mode}{how} layer 2 " in r.error, r.error


def test_the_flag_is_off_by_default_and_on_where_the_suites_say(monkeypatch) -> None:
    """Off for users; SWAFACTORY_ORACLE=true (the test and GPU suites) turns it on, an override
    wins, and a bad value or rate is refused by name."""
    monkeypatch.delenv("SWAFACTORY_ORACLE", raising=False)
    monkeypatch.delenv("SWAFACTORY_ORACLE_RATE", raising=False)
    cfg = swafactory.compose(["run=generate"])
    assert cfg.run.oracle is False and cfg.run.oracle_rate == 1.0
    monkeypatch.setenv("SWAFACTORY_ORACLE_RATE", "0.25")  # the test suite's sampling
    assert swafactory.compose(["run=generate"]).run.oracle_rate == 0.25
    monkeypatch.setenv("SWAFACTORY_ORACLE", "true")
    assert swafactory.compose(["run=generate"]).run.oracle is True
    assert swafactory.compose(["run=generate", "run.oracle=false"]).run.oracle is False
    with pytest.raises(swafactory.ConfigError, match="run.oracle_rate"):
        swafactory.compose(["run=generate", "run.oracle_rate=0"])
    monkeypatch.setenv("SWAFACTORY_ORACLE", "sometimes")
    with pytest.raises(swafactory.ConfigError, match="run.oracle"):
        swafactory.compose(["run=generate"])


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["eagle3", "dflash"])
def test_cuda_graph_replays_are_checked(spec: str, watches) -> None:
    """On a GPU a replay calls no forward in Python: its rows come from the tensors its capture
    registered (the runner's start-up capture inside `harness.watch.capture_io`)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    # the torch backend replays graphs only as the CPU emulation: a CUDA capture is triton's
    cfg = swafactory.compose([*SMALL, f"spec={spec}", "workload.device=cuda", "backend=triton",
                              "backend.cuda_graph=true"])
    r = run_generate(cfg)
    assert r.status == "ok", (r.caught_by, r.error, r.checks)
    _check_ran(watches[0], cfg)
    assert watches[0].forwards[("target", "target_verify", "replay")] > 0
