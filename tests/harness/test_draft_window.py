"""Draft windows apart from K/V retention: `spec.draft_window`, `spec.draft_sink`,
`spec.draft_kv_retention`.

Each field is validated where it is set, the registry refuses what the model or run cannot hold
(with the override that fixes it), `run=plan` shows which draft group reads which window from
which pool, and the conformance oracle follows the window: a backend that ignores it fails.
"""
from __future__ import annotations

import pytest

import swafactory
from swafactory import ConfigError
from swafactory.backend import build as build_module
from swafactory.kvcache.sizing import pool_sizing
from swafactory.registry import CPU

OWN = ["eagle", "eagle3", "nextn", "standalone", "dflash"]


def _cfg(*overrides: str):
    return swafactory.compose(["backend=torch", *overrides])


def _reasons(*overrides: str) -> dict[str, str]:
    """{field: fix} of every reason check gives."""
    return {r.field: r.fix for r in swafactory.check(_cfg(*overrides), CPU)}


@pytest.mark.parametrize("overrides, field, words", [
    (["spec=dflash", "spec.draft_window=4"], "spec.draft_window", "block_size=8"),
    (["spec=eagle", "spec.draft_window=0"], "spec.draft_window", "≥ 1"),
    (["spec=eagle", "spec.draft_sink=4"], "spec.draft_sink", "spec.draft_window is not set"),
    (["spec=eagle", "spec.draft_kv_retention=window"], "spec.draft_kv_retention",
     "spec.draft_window is not set"),
    (["spec=frozen_kv_mtp", "spec.draft_window=8", "spec.draft_kv_retention=window"],
     "spec.draft_kv_retention", "writes none of its own"),
    (["spec=eagle", "spec.draft_window=8", "spec.draft_sink=2", "spec.draft_kv_retention=window"],
     "spec.draft_sink", "sink's 2 keys"),
    (["spec=none", "spec.draft_window=64"], "spec.draft_window", "runs no draft"),
    (["spec.block_size=4"], "spec.block_size", "spec=eagle3 has no block_size"),  # the default
    (["spec=eagle", "spec.draft_kv_retention=half"], "spec.draft_kv_retention", "window"),
])
def test_each_field_is_refused_where_it_is_set(overrides, field, words) -> None:
    with pytest.raises(ConfigError) as info:
        _cfg(*overrides)
    text = str(info.value)
    assert f"`{field}`" in text and words in text, text


def test_the_registry_names_every_reason_and_its_fix() -> None:
    # window retention on an unsplit pool: no SWA slots to keep the draft's K/V on
    got = _reasons("model=gpt_oss_20b", "model.hybrid_pool=false", "spec=eagle", "spec.draft_window=8",
                   "spec.draft_kv_retention=window")
    assert got == {"spec.draft_kv_retention": "spec.draft_kv_retention=full"}
    # a draft window wider than the target's, beside DFlash's split pool: both at once
    got = _reasons("model=gpt_oss_20b", "spec=dflash", "spec.draft_window=256",
                   "spec.draft_kv_retention=window", "spec.draft_pool_split=true")
    assert got == {"spec.draft_window": "spec.draft_window=128",
                   "spec.draft_pool_split": "spec.draft_pool_split=false"}
    # run=generate: a copy of the target keeps each layer's K/V; a distilled head's geometry
    # (tiny's full layers) is not its SWA sub-pool's
    assert _reasons("model=tiny", "run=generate", "spec=eagle", "spec.draft_window=8",
                    "spec.draft_kv_retention=window") == {
        "spec.draft_kv_retention": "spec.draft_weights=distilled"}
    assert _reasons("model=tiny", "run=generate", "spec=eagle", "spec.draft_window=8",
                    "spec.draft_weights=distilled", "spec.draft_kv_retention=window") == {
        "spec.draft_kv_retention": "spec.draft_kv_retention=full"}
    assert not _reasons("model=gpt_oss_20b", "run=generate", "spec=eagle", "spec.draft_window=8",
                        "spec.draft_weights=distilled", "spec.draft_kv_retention=window")


@pytest.mark.parametrize("backend", ["torch", "triton", "flashinfer", "flex"])
def test_a_sink_is_refused_by_a_backend_that_does_not_read_it(backend: str) -> None:
    cfg = swafactory.compose([f"backend={backend}", "spec=eagle", "spec.draft_window=8",
                              "spec.draft_sink=4"])
    refused = [r for r in swafactory.check(cfg, CPU) if r.field == "spec.draft_sink"]
    assert [r.fix for r in refused] == ([] if backend == "torch" else ["spec.draft_sink=0"])


@pytest.mark.parametrize("overrides, words", [
    (["spec=frozen_kv_mtp"], "reads the target's pool"),
    (["spec=dflash", "spec.draft_pool_split=true"], "has a split pool"),
    (["spec=eagle3", "run=generate"], "is a copy of every target layer"),  # draft_weights=target
])
def test_a_sink_is_refused_where_the_target_frees_its_keys(overrides, words) -> None:
    """The sink's keys lie before the window, so the draft's pool must keep them: one on the
    target's SWA slots frees them once they leave the target's window."""
    got = [r for r in swafactory.check(_cfg("model=gpt_oss_20b", "spec.draft_window=8",
                                            "spec.draft_sink=4", *overrides), CPU)
           if r.field == "spec.draft_sink"]
    assert len(got) == 1 and words in got[0].message and got[0].fix == "spec.draft_sink=0", got
    assert "frees the sink's 4 keys" in got[0].message


@pytest.mark.parametrize("retention", ["full", "window"])
def test_the_plan_shows_each_draft_group_its_window_and_pool(retention: str) -> None:
    over = ["model=gemma4", "spec=eagle3", "spec.draft_window=32",
            f"spec.draft_kv_retention={retention}"]
    rows = [r for r in swafactory.plan_summary(_cfg(*over)).rows if r.worker == "draft"]
    assert [r.window for r in rows] == [32]
    plain = pool_sizing(_cfg("model=gemma4", "spec=eagle3")).draft_bytes_per_request
    mine = pool_sizing(_cfg(*over)).draft_bytes_per_request
    if retention == "window":  # on the target's SWA slots, at their geometry: a window's bytes
        assert rows[0].index_space == "swa" and "target's mapping" in rows[0].pool
        assert mine < plain / 3
    else:
        assert rows[0].index_space == "full" and mine == plain
    plan = swafactory.plan_summary(_cfg(*over))
    assert "window 32" in plan.draft_kv


def test_frozen_kv_mtp_narrows_the_bound_layers_windows() -> None:
    rows = [r for r in swafactory.plan_summary(_cfg("model=gemma4", "spec=frozen_kv_mtp",
                                                    "spec.draft_window=32")).rows
            if r.worker == "draft"]
    assert {r.group: r.window for r in rows} == {"swa": 32, "full": 32}


CASES = [(s, "full") for s in [*OWN, "frozen_kv_mtp"]] + [(s, "window") for s in OWN]


@pytest.mark.parametrize("spec, retention", CASES)
def test_conformance_follows_the_draft_window(spec: str, retention: str) -> None:
    r = swafactory.run(_cfg("model=gpt_oss_20b", "workload=smoke", f"spec={spec}",
                            "spec.draft_window=8", f"spec.draft_kv_retention={retention}"))
    assert r.status == "ok", r.mismatch


@pytest.mark.parametrize("spec", ["eagle", "dflash"])
def test_conformance_follows_the_draft_sink(spec: str) -> None:
    r = swafactory.run(_cfg("model=gpt_oss_20b", "workload=smoke", f"spec={spec}",
                            "spec.draft_window=8", "spec.draft_sink=4"))
    assert r.status == "ok", r.mismatch


def test_a_kernel_that_drops_the_sink_fails_the_oracle(monkeypatch) -> None:
    from swafactory.kernels import torch_ref

    monkeypatch.setattr(torch_ref, "in_window", lambda d, k_pos, window, sink=0: d < window)
    r = swafactory.run(_cfg("model=gpt_oss_20b", "workload=smoke", "spec=eagle",
                            "spec.draft_window=8", "spec.draft_sink=4"))
    assert r.status == "failed" and r.mismatch is not None and "draft" in str(r.mismatch), r.mismatch


def test_a_backend_that_ignores_the_draft_window_fails_the_oracle(monkeypatch) -> None:
    real = build_module.runner_windows
    monkeypatch.setattr(build_module, "runner_windows",
                        lambda cfg, view, **kw: real(cfg, view, draft_window=False))
    r = swafactory.run(_cfg("model=gpt_oss_20b", "workload=smoke", "spec=eagle",
                            "spec.draft_window=8"))
    assert r.status == "failed" and r.mismatch is not None and "draft" in str(r.mismatch), r.mismatch
