"""run=generate through the flashinfer adapter on CPU (FlashInfer's kernels faked in torch,
`flashinfer_fake`): emulated graph replays of a whole model step give a standalone draft the
logits eager gives it, also right after a step that committed one token.

On the H200 at `bf87f57`, gemma4 × standalone with ``backend.cuda_graph=true`` committed 2 where
eager (at `407ee43`) committed 5, on the step after a one-token accept. This test rules out the
adapter's and the engine's replay bookkeeping for that step (the tables, write locations and
lengths refilled in place); it cannot see the real kernels' rounding.
"""
from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("transformers")

import swafactory  # noqa: E402
import swafactory.kernels.flashinfer as flashinfer_adapter  # noqa: E402
import swafactory.kernels.torch_ref as torch_ref  # noqa: E402
from flashinfer_fake import module as fake_flashinfer  # noqa: E402
from swafactory.engine.run import run_generate  # noqa: E402
from swafactory.engine.runner import Runner  # noqa: E402

LOAD = ["run=generate", "backend=torch", "model=gemma4", "spec=standalone",
        "workload.num_requests=3", "workload.max_running_requests=2", "workload.seed=1",
        "workload.prompt_over_window=[4,20]", "workload.output_len=[14,18]",
        "workload.chunk_size=16", "run.hidden_size=32", "run.intermediate_size=32",
        "run.vocab_size=128", "model.sliding_window=16",
        # Gemma 4's layer pattern and group sizes at a quarter of its heads and an eighth of
        # their width: the full layers' verify still runs our tile (64 rows per KV head), which
        # the Triton interpreter ran for 50 of the test's 55 s at the real heads; the SWA
        # layers' verify stays on FlashInfer's (faked) prefill, so both paths replay
        "model.num_attention_heads=8", "model.full.num_kv_heads=1", "model.full.head_dim=64",
        "model.swa.num_kv_heads=4", "model.swa.head_dim=32",
        "backend.kernels.swa.verify=library"]
PUSHED = 5  # the token a pushed first draft proposes


def test_graph_replays_feed_the_draft_as_eager_after_short_accepts(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer())
    monkeypatch.setattr(torch_ref, "Adapter", flashinfer_adapter.Adapter)  # backend=torch's
    # registry line (CPU, graph emulation) around the flashinfer adapter
    rows: dict[str, list] = {}
    forward = Runner.forward

    def draft_rows(self, mode, reqs, tokens, positions, *rest, **kw):
        assert isinstance(self.backend.adapter, flashinfer_adapter.Adapter)
        logits = forward(self, mode, reqs, tokens, positions, *rest, **kw)
        if self.name == "draft" and mode == "draft_decode":
            if reqs[0].query_from == 0 and reqs[0].prefix_len % 3 == 0:
                logits[:, PUSHED] += 1e3  # this step's first draft is rejected: it commits 1
            key = [(r.rid, r.prefix_len, r.query_from) for r in reqs]
            rows.setdefault(run, []).append((key, torch.as_tensor(tokens).tolist(),
                                             logits.clone()))
        return logits

    monkeypatch.setattr(Runner, "forward", draft_rows)
    tiles: dict[str, int] = {}  # our tile's calls (the full layers' verify and draft passes)
    tile = flashinfer_adapter.paged_attention

    def counted(*a, **kw):
        tiles[run] = tiles.get(run, 0) + 1
        return tile(*a, **kw)

    monkeypatch.setattr(flashinfer_adapter, "paged_attention", counted)
    reports = {}
    for run in ("eager", "graph"):
        cfg = swafactory.compose([*LOAD, f"backend.cuda_graph={run == 'graph'}"])
        reports[run] = run_generate(cfg)
    eager, graph = reports["eager"], reports["graph"]
    accepts = [q.accept_lengths for q in eager.requests]
    assert {1, 5} <= {a for q in accepts for a in q}, accepts  # short steps, then full ones
    assert any(q[i] == 1 and q[i + 1] == 5 for q in accepts for i in range(len(q) - 1))
    # every spec step's draft forward replays a graph captured at start-up; only the prefill's
    # draft_extend chunks (a prefill runs eagerly) do not
    prefills = sum(s.kind == "prefill" for s in graph.steps)
    assert graph.cuda_graphs["draft"]["replays"] > 0
    assert graph.cuda_graphs["draft"]["eager"] <= prefills, (graph.cuda_graphs, prefills)
    assert [q.accept_lengths for q in graph.requests] == accepts
    assert graph.lossless is True and eager.lossless is True
    assert len(rows["graph"]) == len(rows["eager"])
    assert tiles.get("eager", 0) > 0 and tiles.get("graph", 0) > 0, tiles
    for (ke, te, le), (kg, tg, lg) in zip(rows["eager"], rows["graph"]):
        assert (ke, te) == (kg, tg)
        torch.testing.assert_close(lg, le, rtol=1e-5, atol=1e-5 * float(le.abs().max()))
