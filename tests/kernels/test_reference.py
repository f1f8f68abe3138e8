"""reference.py (the torch form of the kernel contract) against the fp32 oracle; torch only."""
from __future__ import annotations

import math

import pytest
import torch

from kernel_batches import Req, depths, make_batch, oracle_outputs, tol, tree_parents
from swafactory.harness.oracle import tree_visibility
from swafactory.kernels.torch_ref import attention_reference, merge_state


@pytest.mark.parametrize("budget", [1 << 25, 40], ids=["whole", "query_chunks"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("window", [None, 5])
def test_reference_matches_oracle_on_decode_prefill_and_trees(page_size, window, budget,
                                                              monkeypatch):
    """Also with the score budget forced tiny, so every request runs in query chunks (the
    masks' offsets and the poisoning per chunk must still line up)."""
    monkeypatch.setattr("swafactory.kernels.torch_ref._SCORE_BUDGET", budget)
    parents = tree_parents(2, 3, seed=0)
    pos = [12 + x for x in depths(parents)]
    reqs = [Req(kv_pos=list(range(9)), q_pos=[8]),
            Req(kv_pos=list(range(17)), q_pos=list(range(11, 17))),
            Req(kv_pos=list(range(12)) + pos, q_pos=pos, structure=tree_visibility(12, parents))]
    batch = make_batch(reqs, hq=8, hkv=2, d=16, page_size=page_size, seed=page_size)
    sinks = torch.linspace(-1, 1, 8)
    o, lse = attention_reference(*batch.args(), **batch.masks(), window=window, scale=0.3,
                                 softcap=4.0, sinks=sinks)
    want = oracle_outputs(batch, window=window, scale=0.3, softcap=4.0, sinks=sinks)
    torch.testing.assert_close(o, want, **tol(torch.float32))
    assert torch.isfinite(lse).all()


def test_reference_lse_is_the_log_of_the_softmax_denominator():
    batch = make_batch([Req(kv_pos=list(range(6)), q_pos=[5])], hq=2, hkv=1, d=16, seed=1)
    o, lse = attention_reference(*batch.args(), window=None, scale=0.5, sinks=torch.tensor([0.0, 1.0]))
    rows = batch.kv_indices.long()
    s = torch.einsum("hd,kd->hk", batch.q[0], batch.k_buf[rows, 0]) * 0.5
    want = torch.logsumexp(torch.cat([s, torch.tensor([[0.0], [1.0]])], 1), 1)
    torch.testing.assert_close(lse[0], want)


def test_merge_state_of_two_halves_equals_the_whole():
    batch = make_batch([Req(kv_pos=list(range(10)), q_pos=[9])], hq=4, hkv=2, d=16, seed=2)
    whole = attention_reference(*batch.args(), window=None, scale=0.25, sinks=torch.ones(4))
    q, k, v, qo, kvp, kvi, qp, kp = batch.args()
    half = torch.tensor([0, 5], dtype=torch.int32)
    a = attention_reference(q, k, v, qo, half, kvi[:5], qp, kp[:5], window=None, scale=0.25)
    b = attention_reference(q, k, v, qo, half, kvi[5:], qp, kp[5:], window=None, scale=0.25)
    o, lse = merge_state(*a, *b, sinks=torch.ones(4))
    torch.testing.assert_close(o, whole[0])
    torch.testing.assert_close(lse, whole[1])
    empty = (torch.zeros_like(o), torch.full_like(lse, -math.inf))
    o2, lse2 = merge_state(*empty, *empty)
    assert torch.equal(o2, torch.zeros_like(o2)) and bool((lse2 == -math.inf).all())
