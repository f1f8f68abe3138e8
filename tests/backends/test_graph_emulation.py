"""The CPU graph emulation replays what was captured, never what is planned now.

`graphs.EmulatedGraph` keeps the backend's binding at capture (the capture plan, its write slots,
the torch reference's static tables of the bucket's pass) and a replay runs the step over it.
So a replay whose planning left a buffer unrefilled computes from stale tables, and a graph
captured for one mode's route cannot serve another's, on CPU as on a GPU.
"""
from __future__ import annotations

import pytest
import torch

import swafactory.kernels.torch_ref as torch_ref
from swafactory.graphs.state import GraphRouteError
from swafactory.graphs.replay import GraphedAttention
from swafactory.metadata import ForwardBatch
from test_backends_vs_oracle import make_world


def _decode_world():
    world, cfg = make_world("tiny", 1)
    W = cfg.model.sliding_window
    lens = [W + 3, W + 7, 5]
    for rid, n in enumerate(lens):
        world.open(rid)
    world.forward("extend", [world.req(r, 0, n) for r, n in enumerate(lens)], [0])
    # each request's last prompt token queried again: its K/V is there, nothing is written
    reqs = [world.req(r, n - 1, 1) for r, n in enumerate(lens)]
    sub = world.pool.sub_pool(0)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(len(lens), world.backend.q_heads, sub.head_dim, generator=g)
    return world, reqs, q


def _batch(world, reqs, mode="decode") -> ForwardBatch:
    return ForwardBatch.of(mode, reqs, world.slots.req_to_token.table, world.alloc.full_id)


def _eager(world, batch, q) -> torch.Tensor:
    world.backend.init_forward_metadata(batch)
    return world.backend.forward(q, None, None, 0, save_kv=False)


def test_a_replay_equals_eager_over_the_tables_its_planning_refilled() -> None:
    world, reqs, q = _decode_world()
    batch = _batch(world, reqs)
    eager = _eager(world, batch, q)
    graphed = GraphedAttention(world.backend, {0: tuple(q.shape[1:])}, tokens=1,
                               dtype=q.dtype, buckets=(4,))
    assert graphed.capture_all({0: q}) == 1
    out = graphed.forward(batch, {0: q})[0]
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-6)


def test_a_replay_whose_planning_skips_a_refill_reads_the_stale_tables(monkeypatch) -> None:
    """The emulation never re-plans: with the static tables' refill skipped after the capture,
    the replay reads the capture's tables (every request one dummy key), not the batch's."""
    world, reqs, q = _decode_world()
    batch = _batch(world, reqs)
    eager = _eager(world, batch, q)
    graphed = GraphedAttention(world.backend, {0: tuple(q.shape[1:])}, tokens=1,
                               dtype=q.dtype, buckets=(4,))
    graphed.capture_all({0: q})
    fill = torch_ref.static_tables

    def unrefilled(cache, key, t, device, keys, chain=False, capture=False):
        st = cache.get((*key, chain))
        return fill(cache, key, t, device, keys, chain, capture) if st is None else st

    monkeypatch.setattr(torch_ref, "static_tables", unrefilled)
    out = graphed.forward(batch, {0: q})[0]
    assert not torch.allclose(torch.nan_to_num(out), eager, atol=1e-3)


def test_a_graph_replayed_for_another_routes_batch_is_named_before_it_runs() -> None:
    """With guards on the replay planning compares the captured route with the batch's, on the
    host: a decode graph (the decode pass's tables) for a draft_extend batch (the verify
    pass's) raises, naming the bucket, both modes and both routes."""
    world, reqs, q = _decode_world()
    backend = world.backend
    graphed = GraphedAttention(backend, {0: tuple(q.shape[1:])}, tokens=1, dtype=q.dtype,
                               buckets=(4,))
    graphed.capture_all({0: q})
    with pytest.raises(GraphRouteError) as e:
        backend.init_forward_metadata_replay(_batch(world, reqs, "draft_extend"), 4, 1,
                                             captured_mode="decode")
    msg = str(e.value)
    assert "decode bucket of 4 requests × 1 tokens" in msg and "draft_extend batch" in msg
    assert "torch: decode" in msg and "torch: verify" in msg
    assert backend.graph_route("decode", 1) != backend.graph_route("draft_extend", 1)
    # a mode of the same route may share the graph: draft_decode plans the decode pass too
    backend.init_forward_metadata_replay(_batch(world, reqs, "draft_decode"), 4, 1,
                                         captured_mode="decode")
