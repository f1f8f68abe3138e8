"""Plain passes reach FlashInfer as ``causal=True, window_left=W-1`` with no mask; trees, DFlash
blocks, tree drafts and cascade halves keep the custom mask; every output equals the oracle.
Every pass is FlashInfer's here (``backend.kernels.*.*=library``; by default our tile serves
multi-query passes of ≤ 64 rows per KV head: test_flashinfer_host.py).

Through `flashinfer_fake`, which counts FlashInfer's causality and window from the end of each
request's key list (``kv_len - q_len + i``) as the real kernels do: a plain pass whose list did
not end at its last query, or a tree run causal, fails the oracle here as it would on the GPU.
"""
from __future__ import annotations

import sys

import pytest
import torch

from flashinfer_fake import module as fake_flashinfer
from swafactory.metadata import ForwardBatch
from swafactory.kernels.flashinfer_passes import FA2_MAX_QUERIES
from swafactory.window import flashinfer_window_left
from test_backends_vs_oracle import assert_close, run_mode
from test_flashinfer_host import adapter_world, set_policy

W = 20
PLAIN = ("extend", "extend_prefix", "verify_chain", "draft_extend")
MASKED = ("verify_tree_4", "draft_decode", "dflash_block")


@pytest.fixture
def plans(monkeypatch):
    """Install the fake; returns the list every prefill ``plan`` appends to: (wrapper, causal,
    window_left, packed mask or None)."""
    mod = fake_flashinfer()
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    calls = []
    cls = mod.BatchPrefillWithPagedKVCacheWrapper
    plan = cls.plan

    def recorded(self, *a, **kw):
        calls.append((self, kw.get("causal", False), kw.get("window_left", -1),
                      kw.get("packed_custom_mask")))
        return plan(self, *a, **kw)
    monkeypatch.setattr(cls, "plan", recorded)
    return calls


def library_world(page: int, **kw):
    """``tiny`` at window W on FlashInfer, every pass FlashInfer's own kernels."""
    world, cfg = adapter_world("tiny", page, [f"model.sliding_window={W}"], **kw)
    set_policy(world, "tiny", *(f"backend.kernels.{g}.{p}=library" for g in ("swa", "full")
                                for p in ("decode", "verify", "extend")))
    return world, cfg


def _window(group: str) -> int | None:
    return int(group.split("/w")[1]) if "/w" in group else None


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("mode", PLAIN + MASKED)
def test_plain_passes_run_causal_and_structured_ones_keep_the_mask(plans, page: int,
                                                                   mode: str) -> None:
    """Windows start mid-page at P = 16 (the SWA lists are trimmed to a page start before the
    window), prefixes are W-1 … 2W+3 tokens; the oracle checks every layer of both groups."""
    world, _ = library_world(page)
    checks = run_mode(world, mode, [0, 2], W)
    assert_close(checks)
    ad = world.backend.adapter
    key_of = {id(w): k for k, w in ad._wrappers.items()}
    assert plans
    seen = set()
    for w, causal, left, mask in plans:
        group, role, decode, is_causal, graph, backend = key_of[id(w)]
        assert not decode and graph is None and causal == is_causal
        # a short causal pass asks for FA2 (FA3 reads K/V once per query head); long ones and
        # masked ones leave FlashInfer its choice
        short = int((w.qo[1:] - w.qo[:-1]).max()) <= FA2_MAX_QUERIES
        assert backend == w.backend == ("fa2" if causal and short else "auto"), (backend, short)
        seen.add(backend)
        if causal:  # FlashInfer's own rule, the one window convention, nothing per (q, k)
            assert mask is None and left == flashinfer_window_left(_window(group)), (group, left)
        else:
            assert mask is not None and left == -1
    # the first extend is long; a chain's verify and draft extend are short
    assert "auto" in seen and ("fa2" in seen or mode not in ("verify_chain", "draft_extend"))
    # every forward of run_mode starts with a plain extend; a structured mode's step is masked
    assert plans[0][1]
    last = [c for _, c, _, _ in plans[-2:]]  # the last forward: one plan per group
    assert last == [mode in PLAIN] * 2, (mode, last)


def test_cascade_prefix_keeps_its_mask(plans) -> None:
    """A cascade's prefix half has no structure mask but its queries (tree nodes) come after
    its keys: FlashInfer's causal rule would hide most of them. It is planned masked."""
    world, _ = library_world(16, tree_mask="cascade")
    plans.clear()
    assert_close(run_mode(world, "verify_tree_4", [0, 2], W))
    roles = {(k[1], k[3]) for k in world.backend.adapter._wrappers if not k[2]}
    assert ("pre", True) not in roles and ("pre", False) in roles and ("main", True) in roles


@pytest.mark.parametrize("page", [1, 16])
def test_natural_tables_end_at_their_last_query(plans, page: int) -> None:
    """What the planner's ``natural`` promises, read back from its tables: each request's keys
    are consecutive positions ending at its last query, its queries consecutive up to there
    (requests of several lengths, SWA lists trimmed to a page start); structured batches are not
    natural."""
    world, _ = library_world(page)
    lens = [3, W - 1, W + 5, 2 * W + 9]
    for r, n in enumerate(lens):
        world.open(r)
        world.forward("extend", [world.req(r, 0, n)], [0])
        world.slots.evict_out_of_window(r, n, W)
        world.slots.extend(r, 6)
    table, full_id = world.slots.req_to_token.table, world.alloc.full_id
    chain = [world.req(r, n, 6 - r, query_from=r % 2) for r, n in enumerate(lens)]
    fplan = world.backend.init_forward_metadata(ForwardBatch.of("target_verify", chain, table,
                                                                full_id))
    for g in fplan.groups.values():
        t = g.tables
        assert t.natural and t.mask is None
        qo, kv = t.qo_host.tolist(), t.kv_host.tolist()
        for b in range(len(chain)):
            qp, kp = t.q_pos[qo[b]:qo[b + 1]].tolist(), t.kv_pos[kv[b]:kv[b + 1]].tolist()
            assert kp == list(range(kp[0], kp[0] + len(kp))) and kp[-1] == qp[-1]
            assert qp == list(range(qp[0], qp[0] + len(qp))) and kp[0] % page == 0
    for extra in (dict(parents=(-1, 0, 0)), dict(block=True),
                  dict(query_from=2, prefix_only=True)):
        reqs = [world.req(0, lens[0], 3, **extra)]
        fplan = world.backend.init_forward_metadata(ForwardBatch.of("draft_decode", reqs, table,
                                                                    full_id))
        assert not any(g.tables.natural for g in fplan.groups.values()), extra


@pytest.mark.parametrize("tokens", [2, 8])
def test_graph_buckets_keep_the_mask(plans, tokens: int) -> None:
    """A multi-token graph bucket's kernel is fixed at capture by the bucket alone and must
    serve the trees it replays, so a plain batch replayed in it is planned masked (padding
    requests: ``tokens`` rows, one key, every bit set), never causal."""
    world, _ = library_world(1)
    world.open(0)
    world.forward("extend", [world.req(0, 0, 30)], [0])
    world.slots.extend(0, 2)
    batch = ForwardBatch.of("target_verify", [world.req(0, 30, 2)],
                            world.slots.req_to_token.table, world.alloc.full_id)
    backend = world.backend
    fplan = backend._plan_forward(batch, None)
    ad = backend.adapter
    ad.plan(fplan, world.pool, graph=(3, tokens))
    passes = list(ad._passes.values())
    assert passes and all(not p.causal and p.mask is not None for p in passes)
    assert all(torch.all(p.mask[-2 * ((tokens + 7) // 8):] == 255) for p in passes)
