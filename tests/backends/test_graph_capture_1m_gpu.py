"""Start-up capture of every graph bucket over a real-sized pool, and fp8 scales vs graphs (GPU).

Gemma 4 geometry (6 layers: 5 SWA 16×256, 1 full 4×512, W = 1024, bf16) over a pool of 2^20 full
rows at 128K context: buckets 1, 2, 4, 8, 16, 32 and 64 (decode) are all captured at start-up
(`GraphedAttention.capture_all`), and the graph state (`AttentionBackend.graph_state_bytes`) must
stay under 5% of the pool's bytes: its buffers are sized by bs × max_context (SWA: bs × (W + 1 +
page)), not by the pool's rows (which made bucket 64's one index buffer 256 MB). Batches of 3
and 40 requests, one of them at 128K tokens, then replay buckets 4 and 64 and must equal the
eager forward over the same pool. The fp8 twin of test_graph_state_bounds.py: a bucket captured
before `set_kv_scales` refuses to replay, and `GraphedAttention` re-captures it and matches eager.

    python -m pytest -m gpu tests/backends/test_graph_capture_1m_gpu.py -s
"""
from __future__ import annotations

import pytest
import torch

import swafactory
from swafactory.backend import build_backend
from swafactory.graphs.sizing import graph_state_estimate
from swafactory.graphs.state import StaleGraphError
from swafactory.graphs.replay import GraphedAttention
from swafactory.harness.world import World
from swafactory.metadata import ForwardBatch
from test_flashinfer_host import adapter_world

pytestmark = pytest.mark.gpu

ROWS, SWA_ROWS, CTX, W = 1 << 20, 1 << 17, 128 * 1024, 1024
# pool: 8 GiB full + 10 GiB SWA (bf16); buffers sized by the pool's rows would hold ~1.1 GiB
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


def _grow(world, rid, n: int, chunk: int = 8192) -> None:
    """Allocate ``n`` positions of ``rid`` in chunks, freeing what left the window (the SWA pool
    holds W + a chunk per request, as a serving engine's)."""
    while n > 0:
        step = min(chunk, n)
        world.slots.extend(rid, step)
        n -= step
        world.slots.evict_out_of_window(rid, world.kv_len(rid), W)


def _decode(world, rids) -> ForwardBatch:
    reqs = [world.req(r, world.kv_len(r), 1) for r in rids]
    for r in rids:
        world.slots.extend(r, 1)
    return ForwardBatch.of("decode", reqs, world.slots.req_to_token.table, world.alloc.full_id)


@pytest.mark.parametrize("backend", ["flashinfer", "triton"])
def test_every_bucket_captured_over_a_1m_row_pool_at_128k_fits_and_replays(backend) -> None:
    pytest.importorskip(backend)
    torch.cuda.empty_cache()
    cfg = swafactory.compose(["model=gemma4", "model.num_layers=6", f"backend={backend}",
                              "backend.page_size=1", "spec=none", "backend.kv_dtype=bfloat16",
                              "backend.cuda_graph=true", f"workload.context_len={CTX}"])
    world = World(cfg, size_full=ROWS, size_swa=SWA_ROWS, max_requests=64,
                  max_context=CTX + 16, check_mode=False, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for sp in world.pool.sub_pools:  # every slot holds data (unwritten rows are zeros otherwise)
        for buf in (*sp.k_bufs, *sp.v_bufs):
            buf.normal_(generator=gen)
    pool_bytes = sum(sp.bytes for sp in world.pool.sub_pools)
    m = cfg.model
    layers = list(range(m.num_layers))
    shapes = {l: (m.num_attention_heads, m.geometry(l).head_dim) for l in layers}
    b = world.backend
    b.init_cuda_graph_state(BUCKETS[-1], 1, max_context=CTX)
    graphed = GraphedAttention(b, shapes, tokens=1, dtype=torch.bfloat16, buckets=BUCKETS)
    ex_q = {l: torch.zeros(1, *shapes[l], dtype=torch.bfloat16, device="cuda") for l in layers}
    ex_kv = {l: tuple(torch.zeros(1, m.geometry(l).num_kv_heads, shapes[l][1],
                                  dtype=torch.bfloat16, device="cuda") for _ in range(2))
             for l in layers}
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    assert graphed.capture_all(ex_q, ex_kv) == len(BUCKETS)
    torch.cuda.synchronize()
    state = b.graph_state_bytes()
    est = graph_state_estimate(cfg, buckets=BUCKETS, tokens=(1,), max_context=CTX)
    print(f"\n{backend}: graph state {state / 2**20:.1f} MiB (estimate {est / 2**20:.1f} MiB, "
          f"allocated during capture {(torch.cuda.memory_allocated() - before) / 2**20:.1f} MiB) "
          f"for pool {pool_bytes / 2**30:.2f} GiB = {100 * state / pool_bytes:.2f}%")
    assert 0 < state <= 0.05 * pool_bytes
    # the bound by bucket and context: a pool-sized index list of bucket 64 alone is 4 · 64 · 2^20
    assert state < 4 * BUCKETS[-1] * ROWS

    eager = build_backend(cfg, pools=world.pool)  # its own adapter, the same pool
    lens = [CTX - 2] + [1500 + 97 * i for i in range(39)]  # request 0 reaches CTX at bs 40
    for r, n in enumerate(lens):
        world.open(r)
        _grow(world, r, n)
    qgen = torch.Generator().manual_seed(1)
    for bs in (3, 40):
        batch = _decode(world, list(range(bs)))
        assert max(world.kv_len(r) for r in range(bs)) == world.kv_len(0) <= CTX
        q = {l: torch.randn(bs, *shapes[l], generator=qgen).to("cuda", torch.bfloat16)
             for l in layers}
        kv = {l: tuple(torch.randn(bs, m.geometry(l).num_kv_heads, shapes[l][1], generator=qgen)
                       .to("cuda", torch.bfloat16) for _ in range(2)) for l in layers}
        out = {l: o.clone() for l, o in graphed.forward(batch, q, kv).items()}
        eager.init_forward_metadata(batch)
        worst = 0.0
        for l in layers:  # the replay wrote this step's K/V: eager reads the same pool
            ref = eager.forward(q[l], None, None, l, save_kv=False)
            assert torch.isfinite(out[l]).all(), f"bs={bs} layer {l}: non-finite replay"
            worst = max(worst, _rel(out[l], ref))
        print(f"{backend} bs={bs} (bucket {graphed.bucket(bs)}): replay vs eager {worst:.2e}")
        assert worst < 1e-2, f"bs={bs}: replay vs eager {worst:.2e}"
    assert world.kv_len(0) == CTX  # the last batch's request 0 read max_context keys
    assert graphed.captures == len(BUCKETS)  # nothing captured after start-up
    world.open(40)
    _grow(world, 40, CTX + 8)  # its decode reads CTX + 9 keys: past the buffers
    with pytest.raises(ValueError, match=f"max_context={CTX}"):
        b.init_forward_metadata_replay(_decode(world, [40]), 1, 1)


def test_fp8_scales_changed_after_capture_refuse_the_replay_and_are_recaptured() -> None:
    pytest.importorskip("flashinfer")
    world, cfg = adapter_world("gpt_oss_20b", 1, ["model.sliding_window=8", "model.num_layers=4"],
                               device="cuda", kv_dtype="fp8_e4m3", via_registry=True)
    layers = [0, 1]  # SWA, full
    lens = [9, 8, 7, 33, 17, 12, 50, 21]
    for r, n in enumerate(lens):
        world.open(r)
    world.forward("extend", [world.req(r, 0, n) for r, n in enumerate(lens)], layers)
    m = cfg.model
    shapes = {l: (m.num_attention_heads, m.geometry(l).head_dim) for l in layers}
    sinks = {l: world.sinks[l].cuda() for l in layers} if world.sinks else {}
    graphed = GraphedAttention(world.backend, shapes, tokens=1, dtype=torch.bfloat16,
                               buckets=(8,), sinks=sinks)
    eager = build_backend(cfg, pools=world.pool)
    gen = torch.Generator().manual_seed(2)

    def step():
        batch = _decode(world, list(range(6)))
        q = {l: torch.randn(6, *shapes[l], generator=gen).to("cuda", torch.bfloat16)
             for l in layers}
        kv = {l: tuple(torch.randn(6, m.geometry(l).num_kv_heads, shapes[l][1], generator=gen)
                       .to("cuda", torch.bfloat16) for _ in range(2)) for l in layers}
        return batch, q, kv

    def check(batch, q, out):
        eager.init_forward_metadata(batch)
        for l in layers:
            ref = eager.forward(q[l], None, None, l, save_kv=False, sinks=sinks.get(l))
            err = _rel(out[l], ref)
            assert err < 2e-2, f"layer {l}: replay vs eager {err:.2e}"

    batch, q, kv = step()
    check(batch, q, {l: o.clone() for l, o in graphed.forward(batch, q, kv).items()})
    ks, vs = world.pool.kv_scales(1)
    world.pool.set_kv_scales(1, 2 * ks, 0.5 * vs)
    batch, q, kv = step()
    with pytest.raises(StaleGraphError, match="layer 1") as e:
        world.backend.init_forward_metadata_replay(batch, 8, 1)
    assert "re-capture the bucket" in str(e.value) and "version" in str(e.value)
    out = {l: o.clone() for l, o in graphed.forward(batch, q, kv).items()}  # re-captured
    assert graphed.captures == 2 and world.backend.graph_stale(8, 1) is None
    check(batch, q, out)
