"""Graph state bounded by what a bucket can read, and fp8 scales recorded at capture (CPU).

A bucket's static buffers hold ``bs · max_context`` keys per full group and ``bs · (W + tokens +
page)`` per SWA group, whatever the pool's rows (a 1M-row pool once made bucket 64's FlashInfer
indices 256 MB each); `AttentionBackend.graph_state_bytes` counts them. A replay whose requests
read more keys than that raises naming the bucket, the keys and max_context. A bucket captured
before `set_kv_scales` refuses to replay (its kernels hold the old scales as constants), and
`GraphedAttention` re-captures it. The GPU twins: test_graph_capture_1m_gpu.py.
"""
from __future__ import annotations

import sys

import pytest
import torch

import swafactory
from flashinfer_fake import module as fake_flashinfer
from swafactory.backend import AttentionBackend, TargetView, model_windows
from swafactory.graphs.state import StaleGraphError
from swafactory.graphs.replay import GraphedAttention
from swafactory.harness.world import World
from swafactory.kernels.torch_ref import attend
from swafactory.metadata import ForwardBatch
from swafactory.registry.table import backend_module

W, CTX, BUCKETS = 16, 64, (1, 2, 4, 8)


def _world(rows: int, backend: str, extra=()):
    cfg = swafactory.compose(["model=tiny", "model.num_layers=3", "backend=torch",
                              "backend.page_size=1", "spec=none", "backend.kv_dtype=float32",
                              "backend.cuda_graph=false", f"model.sliding_window={W}", *extra])
    world = World(cfg, size_full=rows, size_swa=2048, seed=0)
    world.backend = AttentionBackend(cfg, backend_module(backend).Adapter(),
                                     TargetView(world.pool), model_windows(cfg))
    return world, cfg


def _bound(backend: str, cfg) -> tuple[int, int]:
    """(least, most) graph-state bytes of decode buckets BUCKETS at max_context CTX, from the
    buffers' definitions: indices (and Triton's positions) of n · keys int32, a few [n + 1]
    int32 tables, [n] int64 write slots per group."""
    keys = {"swa": min(CTX, W + 1 + 1), "full": CTX}  # SWA: W + tokens + page
    per_key = 4 if backend == "flashinfer" else 8  # triton: rows and positions
    least = most = 0
    for n in BUCKETS:
        for k in keys.values():
            least += per_key * n * k
            most += per_key * n * k + 4 * (3 * n + 2) + 8 * n
    return least, most


@pytest.mark.parametrize("backend", ["flashinfer", "triton"])
def test_graph_state_is_sized_by_bucket_and_context_not_pool_rows(backend, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer())
    got = {}
    for rows in (2048, 131072):
        world, cfg = _world(rows, backend)
        b = world.backend
        assert b.graph_state_bytes() == 0
        b.init_cuda_graph_state(BUCKETS[-1], 1, max_context=CTX)
        for n in BUCKETS:
            b.init_forward_metadata_capture(n, 1, "decode")
        got[rows] = b.graph_state_bytes()
        pool_rows_bytes = 4 * BUCKETS[-1] * rows  # one bucket-8 index list sized by the pool
        assert got[rows] < pool_rows_bytes or rows == 2048
    least, most = _bound(backend, cfg)
    assert got[2048] == got[131072], got  # independent of the pool's rows
    assert least <= got[131072] <= most, (least, got, most)


def _decode_batch(world, lens):
    reqs = [world.req(r, n, 1) for r, n in enumerate(lens)]
    for r in range(len(lens)):
        world.slots.extend(r, 1)
    return ForwardBatch.of("decode", reqs, world.slots.req_to_token.table, world.alloc.full_id)


def test_a_replay_past_max_context_raises_naming_bucket_keys_and_context(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer())
    world, _ = _world(65536, "flashinfer")
    lens = [20, CTX - 1, 30]  # decode: each reads lens + 1 keys in its full group
    for r, n in enumerate(lens):
        world.open(r)
    world.forward("extend", [world.req(r, 0, n) for r, n in enumerate(lens)], [0, 2])
    b = world.backend
    b.init_cuda_graph_state(4, 1, max_context=CTX)
    b.init_forward_metadata_capture(4, 1, "decode")
    batch = _decode_batch(world, lens)
    eager = b.init_forward_metadata(batch)
    plan = b.init_forward_metadata_replay(batch, 4, 1)  # CTX keys at most: fits
    k, v, _ = world.pool.get_kv(2)
    k.nan_to_num_(0.0), v.nan_to_num_(0.0)  # the fake multiplies every row: no poisoned slots
    q = torch.randn(3, 8, k.shape[-1], generator=torch.Generator().manual_seed(0))
    o, _ = b.adapter.run(plan.group(2).tables, torch.cat([q, q.new_zeros(1, *q.shape[1:])]),
                         k, v, window=None, scale=k.shape[-1] ** -0.5)
    ref, _ = attend(eager.group(2).tables, q, k, v, window=None, scale=k.shape[-1] ** -0.5)
    torch.testing.assert_close(o[:3], ref)
    world.forward("extend", [world.req(1, CTX, 2)], [0, 2])  # request 1 now reads CTX + 3 keys
    batch = _decode_batch(world, [lens[0] + 1, CTX + 2, lens[2] + 1])
    with pytest.raises(ValueError) as e:
        b.init_forward_metadata_replay(batch, 4, 1)
    msg = str(e.value)
    assert "graph bucket of 4 requests × 1 tokens" in msg and f"reads {CTX + 3} keys" in msg
    assert f"max_context={CTX}" in msg and "group full" in msg, msg
    with pytest.raises(ValueError, match="max_context is fixed|captured with max_context"):
        b.init_cuda_graph_state(4, 1, max_context=2 * CTX)


def test_default_max_context_is_the_workload_context_capped_by_the_pool() -> None:
    world, cfg = _world(2048, "torch", ["workload.context_len=512"])
    world.backend.init_cuda_graph_state(2, 1)
    assert world.backend.cuda_graph_state.max_context == 512
    world, cfg = _world(2048, "torch", ["workload.context_len=100000"])
    world.backend.init_cuda_graph_state(2, 1)
    assert world.backend.cuda_graph_state.max_context == 2048


def test_capture_all_captures_every_bucket_up_front_and_forwards_capture_none() -> None:
    world, cfg = _world(2048, "torch")
    layers = [0, 2]
    lens = [20, 33, 40]
    for r, n in enumerate(lens):
        world.open(r)
    world.forward("extend", [world.req(r, 0, n) for r, n in enumerate(lens)], layers)
    m = cfg.model
    shapes = {l: (m.num_attention_heads, m.geometry(l).head_dim) for l in layers}
    kvh = {l: m.geometry(l).num_kv_heads for l in layers}
    world.backend.init_cuda_graph_state(4, 1, max_context=CTX)
    graphed = GraphedAttention(world.backend, shapes, tokens=1, dtype=torch.float32,
                               buckets=(1, 2, 4))
    q = {l: torch.zeros(1, *shapes[l]) for l in layers}
    kv = {l: (torch.zeros(1, kvh[l], shapes[l][1]),) * 2 for l in layers}
    assert graphed.capture_all(q, kv) == 3 and graphed.capture_all(q, kv) == 0
    gen = torch.Generator().manual_seed(4)
    batch = _decode_batch(world, lens)
    q = {l: torch.randn(3, *shapes[l], generator=gen) for l in layers}
    kv = {l: tuple(torch.randn(3, kvh[l], shapes[l][1], generator=gen) for _ in range(2))
          for l in layers}
    out = graphed.forward(batch, q, kv)
    assert graphed.captures == 3 and graphed.replays == 1
    plan = world.backend.init_forward_metadata(batch)
    for l in layers:
        k_buf, v_buf, sub = world.pool.get_kv(l)
        ref, _ = attend(plan.group(l).tables, q[l], k_buf, v_buf, window=plan.group(l).window,
                        scale=sub.head_dim ** -0.5)
        torch.testing.assert_close(out[l], ref)


# --- fp8 scales and captured buckets (emulated graphs: the torch backend) ---------------------

def test_a_bucket_captured_before_set_kv_scales_refuses_to_replay_and_is_recaptured() -> None:
    cfg = swafactory.compose(["model=tiny", "model.num_layers=3", "backend=torch",
                              "backend.page_size=1", "spec=none", "backend.kv_dtype=fp8_e4m3",
                              "backend.cuda_graph=false", f"model.sliding_window={W}"])
    world = World(cfg, size_full=2048, size_swa=1024, seed=0)
    layers = [0, 2]  # SWA, full
    lens = [9, 30, 21, 40]
    for r, n in enumerate(lens):
        world.open(r)
    world.forward("extend", [world.req(r, 0, n) for r, n in enumerate(lens)], layers)
    m = cfg.model
    shapes = {l: (m.num_attention_heads, m.geometry(l).head_dim) for l in layers}
    graphed = GraphedAttention(world.backend, shapes, tokens=1, dtype=torch.float32,
                               buckets=(4,))
    gen = torch.Generator().manual_seed(3)

    def step():
        batch = _decode_batch(world, [world.kv_len(r) for r in range(4)])
        q = {l: torch.randn(4, *shapes[l], generator=gen) for l in layers}
        kv = {l: tuple(torch.randn(4, m.geometry(l).num_kv_heads, shapes[l][1], generator=gen)
                       for _ in range(2)) for l in layers}
        return batch, q, kv

    batch, q, kv = step()
    graphed.forward(batch, q, kv)
    assert graphed.captures == 1 and world.backend.graph_stale(4, 1) is None
    pool = world.pool
    pool.set_kv_scales(2, *pool.kv_scales(2))  # the same scales: the version moves, nothing else
    assert world.backend.graph_stale(4, 1) is None
    k_old, v_old = pool.kv_scales(2)
    pool.set_kv_scales(2, 2 * k_old, v_old)
    reason = world.backend.graph_stale(4, 1)
    assert reason is not None and "layer 2" in reason and "re-capture the bucket" in reason
    batch, q, kv = step()
    with pytest.raises(StaleGraphError) as e:
        world.backend.init_forward_metadata_replay(batch, 4, 1)
    msg = str(e.value)
    assert "layer 2" in msg and f"({k_old}, {v_old})" in msg and f"({2 * k_old}, {v_old})" in msg
    assert "set_kv_scales" in msg and "version" in msg
    out = graphed.forward(batch, q, kv)  # GraphedAttention re-captures the stale bucket
    assert graphed.captures == 2 and world.backend.graph_stale(4, 1) is None
    plan = world.backend.init_forward_metadata(batch)
    for l in layers:  # the new scales read: the oracle dequantizes with them
        k_buf, v_buf, sub = pool.get_kv(l)
        ks, vs = pool.kv_scales(l)
        ref, _ = attend(plan.group(l).tables, q[l], k_buf.float() * ks, v_buf.float() * vs,
                        window=plan.group(l).window, scale=sub.head_dim ** -0.5)
        torch.testing.assert_close(out[l], ref, atol=1e-4, rtol=1e-4)


# --- the engine runner: every bucket at start-up ----------------------------------------------

def test_the_engine_runner_captures_every_bucket_at_start_up_sized_by_its_longest_request() -> None:
    pytest.importorskip("transformers")
    from swafactory.models.build import build
    from swafactory.engine.runner import BUCKETS as RUNNER_BUCKETS
    from swafactory.registry.device import detect_device
    from swafactory.registry.select import validate

    device = detect_device("cpu")
    cfg = validate(swafactory.compose([
        "run=generate", "backend=torch", "model=tiny", "spec=none", "backend.cuda_graph=true",
        "workload.max_running_requests=2", "run.hidden_size=32", "run.intermediate_size=32",
        "run.vocab_size=128", f"model.sliding_window={W}"]), device)
    parts = build(cfg, device, [20, 30], [5, 7])
    runner = parts.target
    st = runner.backend.cuda_graph_state
    assert st.max_context == 30 + 7 + 1 + 1  # the longest request + a step + a page
    # the scheduler captures at start-up (scheduler.capture_graphs): up to the bucket of its
    # 2 running requests, before any step
    from swafactory.serving.scheduler import capture_graphs

    assert runner.graph_use["captures"] == 0
    assert capture_graphs(parts) == 2 and runner.graph_use["replays"] == 0
    assert runner.capture_all([("decode", 1)]) == len(RUNNER_BUCKETS) - 2
    assert runner.capture_all([("decode", 1)]) == 0  # captured ones are kept
    assert runner.graph_use["captures"] == len(RUNNER_BUCKETS)
    groups = len({k for k, _, _ in st.writes})
    # the reference kernel's static tables (int32, per bucket and group): sized by what a
    # bucket reads (bs · max_context keys at most), never by the pool's rows
    tables = runner.backend.adapter.graph_bytes()
    assert 0 < tables <= groups * sum(4 * (2 * n * st.max_context + 3 * n + 3)
                                      for n in RUNNER_BUCKETS)
    assert runner.backend.graph_state_bytes() == 8 * sum(RUNNER_BUCKETS) * groups + tables
