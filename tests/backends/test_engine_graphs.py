"""Engine-style CUDA graphs: an engine captures its *own* step, a multi-layer loop in which layer
l's q, k and v are computed from layer l − 1's output, with `AttentionBackend.forward` per layer
inside, through the graph contract (`init_cuda_graph_state`, `init_forward_metadata_capture`,
`init_forward_metadata_replay`). For every forward mode, batches shrink and grow between replays
(buckets 2, 4, 8) and each replay equals the same step run eagerly on the same pools.

GPU only (FlashInfer and triton in every mode). The CPU side of the contract (padding,
static write slots, refusals) is in test_graphs.py.
"""
from __future__ import annotations

import pytest
import torch

from swafactory.metadata import ForwardBatch
from test_backends_vs_oracle import tree
from test_flashinfer_host import adapter_world

pytestmark = pytest.mark.gpu

LENS = [9, 8, 7, 33, 17, 12, 50, 21]  # straddling W = 8 on the SWA layers
MODES = {  # name → (forward mode, tokens per request in the bucket)
    "decode": ("decode", 1),
    "verify_chain": ("target_verify", 4),
    "verify_tree": ("target_verify", 6),
    "draft_decode": ("draft_decode", 2),
    "draft_extend": ("draft_extend", 4),
}
HIDDEN = 256


class Toy:
    """A residual stack whose attention runs through ``backend``: h [rows, HIDDEN] bf16."""

    def __init__(self, cfg, layers, sinks, gen) -> None:
        m = cfg.model
        self.layers, self.sinks, self.w = layers, sinks, {}

        def mk(i: int, o: int, s: float = 1.0) -> torch.Tensor:
            return (torch.randn(i, o, generator=gen) * s / i ** 0.5).to("cuda", torch.bfloat16)

        for l in layers:
            g = m.geometry(l)
            hq, hkv, d = m.num_attention_heads, g.num_kv_heads, g.head_dim
            # q·k scaled to unit variance under the model's softmax scale (Gemma 4's is 1.0,
            # with QK-norm in the real model): a peaked softmax would turn bf16 rounding
            # differences between two correct runs into different argmax keys
            qk = (d * (m.softmax_scale or d ** -0.5) ** 2) ** -0.25
            self.w[l] = (mk(HIDDEN, hq * d, qk), mk(HIDDEN, hkv * d, qk), mk(HIDDEN, hkv * d),
                         mk(hq * d, HIDDEN), (hq, hkv, d))

    def step(self, backend, h: torch.Tensor) -> torch.Tensor:
        for l in self.layers:
            wq, wk, wv, wo, (hq, hkv, d) = self.w[l]
            n = h.shape[0]
            q, k, v = (h @ wq).view(n, hq, d), (h @ wk).view(n, hkv, d), (h @ wv).view(n, hkv, d)
            o = backend.forward(q, k, v, l, sinks=self.sinks.get(l))
            h = h + o.reshape(n, hq * d) @ wo
        return h


def _batch(world, name: str, bs: int) -> ForwardBatch:
    fmode, _ = MODES[name]
    reqs = []
    for r in range(bs):
        if name == "decode":
            reqs.append(world.req(r, world.kv_len(r), 1))
        elif name == "verify_chain":
            reqs.append(world.req(r, LENS[r], 4))
        elif name == "verify_tree":
            reqs.append(world.req(r, LENS[r], 6, parents=tree(2)))
        elif name == "draft_decode":  # a topk-2 draft's second level: 2 queries over 4 nodes
            reqs.append(world.req(r, LENS[r], 4, query_from=2, parents=(-1, -1, 0, 1)))
        else:  # draft extend over the accepted tokens: 1 to 4 per request
            reqs.append(world.req(r, LENS[r], 1 + (3 * r + bs) % 4))
        need = reqs[-1].prefix_len + reqs[-1].nodes - world.kv_len(r)
        if need > 0:
            world.slots.extend(r, need)
    return ForwardBatch.of(fmode, reqs, world.slots.req_to_token.table, world.alloc.full_id)


@pytest.mark.parametrize("model,extra", [
    ("gemma4", ["model.sliding_window=8", "model.num_layers=6"]),        # 16×256 SWA, 4×512 full
    ("gpt_oss_20b", ["model.sliding_window=8", "model.num_layers=4"]),   # sinks, D = 64
])
@pytest.mark.parametrize("name,backend", [(n, b) for n in MODES for b in ("flashinfer", "triton")])
def test_engine_captures_its_own_step_and_replays_shrinking_batches(model, extra, name,
                                                                    backend) -> None:
    pytest.importorskip(backend)
    world, cfg = adapter_world(model, 1, extra, device="cuda", kv_dtype="bfloat16",
                               via_registry=True, backend=backend)
    layers = list(range(cfg.model.num_layers))
    for r, n in enumerate(LENS):
        world.open(r)
    world.forward("extend", [world.req(r, 0, n + 4) for r, n in enumerate(LENS)], layers)
    for r, n in enumerate(LENS):  # evicted, poisoned SWA slots: a replay must not read them
        world.slots.evict_out_of_window(r, n, 8)
    gen = torch.Generator().manual_seed(2)
    sinks = {l: s.cuda() for l, s in world.sinks.items()} if world.sinks else {}
    toy = Toy(cfg, layers, sinks, gen)
    backend = world.backend
    fmode, tokens = MODES[name]
    backend.init_cuda_graph_state(8, tokens)
    static_h = torch.zeros(8 * tokens, HIDDEN, dtype=torch.bfloat16, device="cuda")
    graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
    cur = torch.cuda.current_stream()
    for bs in (8, 6, 3, 8, 2, 5):
        n = next(b for b in (2, 4, 8) if b >= bs)
        if n not in graphs:
            backend.init_forward_metadata_capture(n, tokens, fmode)
            hs = static_h[:n * tokens]
            side = torch.cuda.Stream()
            side.wait_stream(cur)
            with torch.cuda.stream(side):  # warm-up: JIT, wrapper set-up (writes: dummy row)
                toy.step(backend, hs)
            cur.wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = toy.step(backend, hs)
            graphs[n] = (g, out)
        batch = _batch(world, name, bs)
        rows = batch.total_q
        h_in = torch.randn(rows, HIDDEN, generator=gen).to("cuda", torch.bfloat16)
        backend.init_forward_metadata_replay(batch, n, tokens)
        static_h[:rows].copy_(h_in)
        g, out = graphs[n]
        g.replay()
        got = out[:rows].float().clone()
        backend.init_forward_metadata(batch)
        ref = toy.step(backend, h_in).float()
        assert torch.isfinite(got).all(), f"{name} bs={bs}: non-finite replay"
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        assert err < 3e-2, f"{name} bs={bs} (bucket {n}): replay vs eager {err:.2e}"
    assert getattr(backend.adapter, "replans", 0) == 0
