"""A captured step replays the eager step's kernels: the profiler's kernel names of one graph
replay equal those of one eager step (the same batch, every layer's `forward`), for chain and tree
verify, draft extend and decode on our kernels (under flashinfer: handed to the triton adapter by
``backend.kernels``), through FlashInfer and through our Triton kernels.

A graph that ran other kernels than eager (FlashInfer's masked prefill where eager runs its
causal prefill or our verify tile) was 1.6× slower than eager at Gemma 4 bs 64; FlashInfer's
own graph plans split KV where eager's do not (GPT-OSS-20b chain verify bs 64 replayed in 8.21
ms against 6.14 eager, H100). So under flashinfer these passes (≤ 64 rows per KV head) run our
tile, eagerly and over static tables in a graph. Eager's per-forward slot checks (torch kernels)
run at plan time around a replay, so the comparison is of the attention kernels, and a replay
launches no torch kernel eager does not.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from swafactory.metadata import ForwardBatch
from test_backends_vs_oracle import tree
from test_flashinfer_host import adapter_world

pytestmark = pytest.mark.gpu

LENS = [9, 8, 7, 33, 17, 12, 50, 21]
CHAIN = ["spec=eagle", "spec.num_steps=3", "spec.num_draft_tokens=4"]
TREE = ["spec=eagle3", "spec.topk=2", "spec.num_steps=3", "spec.num_draft_tokens=6"]
MODES = {  # name → (forward mode, tokens per request, spec)
    "verify_chain": ("target_verify", 4, CHAIN),
    "verify_tree": ("target_verify", 6, TREE),
    "draft_extend": ("draft_extend", 4, CHAIN),
    # decode on our Triton kernel; under flashinfer handed to the triton adapter beside it
    "decode_ours": ("decode", 1, [*CHAIN, "backend.kernels.swa.decode=triton",
                                  "backend.kernels.full.decode=triton"]),
}


def _kernels(run) -> Counter:
    """The CUDA kernels one call of ``run`` launches, by name (the profiler's)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return Counter(e.name for e in prof.events() if e.device_type.name == "CUDA"
                   and not e.name.startswith(("Memcpy", "Memset")))


@pytest.mark.parametrize("model,extra", [
    ("gemma4", ["model.sliding_window=8", "model.num_layers=6"]),        # 256 SWA, 512 full
    ("gpt_oss_20b", ["model.sliding_window=8", "model.num_layers=4"]),   # sinks, D = 64
])
@pytest.mark.parametrize("name", sorted(MODES))
@pytest.mark.parametrize("backend", ["flashinfer", "triton"])
def test_a_replay_runs_the_eager_steps_kernels(backend, name, model, extra) -> None:
    pytest.importorskip(backend)
    fmode, tokens, spec = MODES[name]
    world, cfg = adapter_world(model, 1, [*extra, *spec], device="cuda", kv_dtype="bfloat16",
                               via_registry=True, backend=backend)
    layers = list(range(cfg.model.num_layers))
    for r, n in enumerate(LENS):
        world.open(r)
    world.forward("extend", [world.req(r, 0, n + tokens) for r, n in enumerate(LENS)], layers)
    reqs = []
    for r, n in enumerate(LENS):
        parents = tree(2) if name == "verify_tree" else None
        # every request fills the bucket's tokens: FlashInfer plans its tiles from the query
        # lengths, so a shorter batch may get other template instances than the capture's
        reqs.append(world.req(r, n, tokens, parents=parents))
    batch = ForwardBatch.of(fmode, reqs, world.slots.req_to_token.table, world.alloc.full_id)
    gen = torch.Generator(device="cuda").manual_seed(0)
    m, rows = cfg.model, 8 * tokens
    sinks = {l: s.cuda() for l, s in world.sinks.items()} if world.sinks else {}
    qkv = {}
    for l in layers:
        g = m.geometry(l)
        qkv[l] = tuple(torch.randn(rows, h, g.head_dim, generator=gen, device="cuda",
                                   dtype=torch.bfloat16)
                       for h in (m.num_attention_heads, g.num_kv_heads, g.num_kv_heads))

    def step(n: int):
        for l in layers:
            q, k, v = (x[:n] for x in qkv[l])
            world.backend.forward(q, k, v, l, sinks=sinks.get(l))

    backend_ = world.backend
    backend_.init_forward_metadata(batch)
    step(batch.total_q)  # first use: JIT, allocations
    backend_.init_forward_metadata(batch)
    eager = _kernels(lambda: step(batch.total_q))
    # buffers sized for this run's context (as sglang passes its own): split counts planned
    # from static sizes then match eager's
    backend_.init_cuda_graph_state(8, tokens, max(LENS) + tokens)
    backend_.init_forward_metadata_capture(8, tokens, fmode)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(rows)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(rows)
    backend_.init_forward_metadata_replay(batch, 8, tokens)
    replay = _kernels(graph.replay)
    short = lambda c: {k[:90]: v for k, v in c.items()}  # noqa: E731
    # eager checks each pool's write slots once a forward (an aminmax and a stack); a graph at plan
    torch_only = lambda c: Counter({k: v for k, v in c.items() if "at::native" in k})  # noqa: E731
    assert not torch_only(replay - eager), short(replay - eager)
    replay, eager = (c - torch_only(c) for c in (replay, eager))
    assert replay == eager, (f"{backend} {name} {model}: replay-only {short(replay - eager)}, "
                             f"eager-only {short(eager - replay)}")
