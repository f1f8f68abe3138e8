"""A captured graph replays only the route it captured (run=generate on CPU, graphs emulated).

The engine files each graph under `backend.graph_key` (mode, requests, tokens) and captures every
bucket × mode its spec meets at start-up. The CPU emulation replays a graph over the buffers its
capture bound (`graphs.EmulatedGraph`), so a graph replayed for another mode's batch computes
from tables that replay never refilled, as on a GPU. The fault ``graph_key_without_mode`` files
graphs by shape alone: with the guards off the self-speculating EAGLE copy's accept length
collapses while the output stays lossless (its users' symptom); with them on, the replay's route
check names the bucket, both modes and both routes before anything runs.
"""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import swafactory  # noqa: E402
from swafactory.engine.run import run_generate  # noqa: E402
from swafactory.engine.runner import BUCKETS  # noqa: E402
from swafactory.serving.speculative import graph_modes  # noqa: E402

SMALL = ["run=generate", "backend=torch", "model=tiny", "spec=eagle", "backend.cuda_graph=true",
         "workload.num_requests=2", "workload.seed=1", "workload.max_running_requests=2",
         "workload.prompt_over_window=[4,20]", "workload.output_len=[5,7]",
         "workload.chunk_size=16", "run.hidden_size=32", "run.intermediate_size=32",
         "run.vocab_size=128", "model.sliding_window=16"]


def _gen(*overrides: str):
    return run_generate(swafactory.compose([*SMALL, *overrides]))


def test_each_mode_replays_its_own_graph_captured_at_start_up() -> None:
    r = _gen()
    assert r.status == "ok" and r.lossless is True, (r.caught_by, r.error)
    assert r.accept_len == r.ideal_accept_len  # a copy drafts what the target verifies
    cfg = swafactory.compose(SMALL)
    held = [n for n in BUCKETS if n <= 2]  # up to the bucket of max_running_requests
    for role in ("target", "draft"):
        use = r.cuda_graphs[role]
        # every capture happened at start-up (one per bucket × mode), none later in the loop
        assert use["captures"] == len(graph_modes(cfg.spec, role)) * len(held), (role, use)
        assert use["replays"] > 0, (role, use)


def test_graphs_keyed_by_shape_alone_collapse_the_accept_length_with_the_guards_off() -> None:
    # what a user sees without the attention oracle: a lower accept length, lossless output
    r = _gen("faults=graph_key_without_mode", "run.guards=false", "run.oracle=false")
    assert r.fault_acted["graph_key_without_mode"] > 0
    assert r.lossless is True  # the target's verify still decides every token
    assert r.status == "failed" and r.caught_by == "acceptance", (r.caught_by, r.error)
    assert r.accept_len < r.ideal_accept_len - 1, (r.accept_len, r.ideal_accept_len)
    # the oracle watches the emulated replays: it names the aliased draft pass first
    seen = _gen("faults=graph_key_without_mode", "run.guards=false", "run.oracle=true")
    assert seen.status == "failed" and seen.caught_by == "oracle", (seen.caught_by, seen.error)
    assert "draft draft_decode" in str(seen.error), seen.error


def test_the_replay_route_check_names_both_modes_with_the_guards_on() -> None:
    r = _gen("faults=graph_key_without_mode")
    assert r.status == "failed" and r.caught_by == "space", (r.caught_by, r.error)
    msg = str(r.error)
    assert "GraphRouteError" in msg and "draft_extend" in msg and "draft_decode" in msg, msg
    assert "torch: decode" in msg and "torch: verify" in msg, msg
