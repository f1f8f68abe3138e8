"""The oracle against independent formulations: SDPA with an explicit mask, sinks as an extra key."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from swafactory.harness.oracle import causal_visibility, oracle_attention, tree_visibility
from swafactory.window import (first_visible_pos, flash_attn_window_size, flashinfer_window_left,
                               kept_keys, visible)


def _sdpa(q, k, v, mask, scale):
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    o = F.scaled_dot_product_attention(q.transpose(0, 1).double(), kk.transpose(0, 1).double(),
                                       vv.transpose(0, 1).double(), attn_mask=mask, scale=scale)
    return o.transpose(0, 1).float()


@pytest.mark.parametrize("window", [None, 1, 4, 7])
@pytest.mark.parametrize("gqa", [1, 4])
def test_extend_matches_sdpa_with_an_explicit_window_mask(window, gqa) -> None:
    g = torch.Generator().manual_seed(0)
    nk, nq, hkv, d = 11, 5, 2, 8
    q = torch.randn(nq, hkv * gqa, d, generator=g)
    k, v = torch.randn(nk, hkv, d, generator=g), torch.randn(nk, hkv, d, generator=g)
    k_pos, q_pos = torch.arange(nk), torch.arange(nk - nq, nk)
    mask = torch.tensor([[0 <= qp - kp < (window or 10**9) for kp in range(nk)] for qp in q_pos.tolist()])
    got = oracle_attention(q, k, v, q_pos, k_pos, causal_visibility(q_pos, k_pos), window=window)
    torch.testing.assert_close(got, _sdpa(q, k, v, mask, d ** -0.5), rtol=1e-5, atol=1e-5)


def test_sinks_act_as_an_extra_key_with_zero_value() -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(3, 4, 8, generator=g), torch.randn(6, 2, 8, generator=g), torch.randn(6, 2, 8, generator=g)
    sinks = torch.randn(4, generator=g)
    q_pos, k_pos = torch.tensor([3, 4, 5]), torch.arange(6)
    got = oracle_attention(q, k, v, q_pos, k_pos, causal_visibility(q_pos, k_pos), window=3,
                           scale=0.3, sinks=sinks)
    for h in range(4):
        for i, p in enumerate(q_pos.tolist()):
            keys = [j for j in range(6) if 0 <= p - j < 3]
            s = torch.cat([(q[i, h] @ k[keys, h // 2].T).double() * 0.3, sinks[h:h + 1].double()])
            w = torch.softmax(s, 0)[:-1]
            torch.testing.assert_close(got[i, h], (w @ v[keys, h // 2].double()).float(), rtol=1e-5, atol=1e-6)


def test_softcap_is_applied_before_the_mask() -> None:
    q, k, v = torch.full((1, 1, 2), 10.0), torch.ones(2, 1, 2), torch.tensor([[[1.0, 0]], [[0, 1.0]]])
    pos = torch.tensor([1])
    capped = oracle_attention(q, k, v, pos, torch.arange(2), causal_visibility(pos, torch.arange(2)),
                              window=None, softcap=5.0)
    torch.testing.assert_close(capped[0, 0], torch.tensor([0.5, 0.5]))


def test_tree_nodes_see_prefix_ancestors_and_self_and_window_by_position() -> None:
    vis = tree_visibility(3, [-1, 0, 0, 1])
    assert vis[:, :3].all()
    assert vis[3, 3:].tolist() == [True, True, False, True]
    assert vis[2, 3:].tolist() == [True, False, True, False]
    # node 3 sits at depth 2 (position 3 + 2 = 5); with W = 3 it sees positions 3..5 only
    q_pos = torch.tensor([3, 4, 4, 5])
    k_pos = torch.cat([torch.arange(3), q_pos])
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(4, 1, 4, generator=g), torch.randn(7, 1, 4, generator=g), torch.randn(7, 1, 4, generator=g)
    out = oracle_attention(q, k, v, q_pos, k_pos, vis, window=3)
    keys = [3, 4, 6]  # node 0 (pos 3), node 1 (pos 4), itself (pos 5); prefix pos 2 is out of window
    w = torch.softmax((q[3, 0] @ k[keys, 0].T) * 0.5, 0)
    torch.testing.assert_close(out[3, 0], w @ v[keys, 0], rtol=1e-5, atol=1e-6)


def test_a_query_that_sees_nothing_gets_zeros_not_nan() -> None:
    q, k, v = torch.randn(1, 1, 4), torch.randn(2, 1, 4), torch.randn(2, 1, 4)
    q_pos, k_pos = torch.tensor([0]), torch.tensor([5, 6])
    out = oracle_attention(q, k, v, q_pos, k_pos, causal_visibility(q_pos, k_pos), window=None)
    assert torch.equal(out, torch.zeros_like(out))


def test_a_dflash_block_sees_keys_ahead_of_it_inside_the_block() -> None:
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, 1, 4, generator=g), torch.randn(4, 1, 4, generator=g), torch.randn(4, 1, 4, generator=g)
    q_pos, k_pos = torch.tensor([2, 3]), torch.arange(4)
    block = torch.ones(2, 4, dtype=torch.bool)  # prefix 0-1 + the whole block 2-3
    out = oracle_attention(q, k, v, q_pos, k_pos, block, window=None)
    w = torch.softmax((q[0, 0] @ k[:, 0].T) * 0.5, 0)
    torch.testing.assert_close(out[0, 0], w @ v[:, 0], rtol=1e-5, atol=1e-6)


def test_window_helpers_share_one_convention() -> None:
    assert visible(torch.tensor([5]), torch.arange(7), 3).tolist() == [[False, False, False, True, True, True, False]]
    assert first_visible_pos(5, 3) == 3 and first_visible_pos(1, 3) == 0 and first_visible_pos(9, None) == 0
    assert kept_keys(10, 4) == 4 and kept_keys(3, 4) == 3 and kept_keys(10, None) == 10
    assert flashinfer_window_left(1024) == 1023 and flashinfer_window_left(None) == -1
    assert flash_attn_window_size(128) == (127, 0) and flash_attn_window_size(None) == (None, 0)


@pytest.mark.parametrize("budget", [1 << 25, 64], ids=["padded_batch", "per_request_chunks"])
@pytest.mark.parametrize("window", [None, 5])
def test_forward_oracle_equals_the_per_request_oracle(budget, window, monkeypatch) -> None:
    """The per-forward oracle (padded batch, or per-request query chunks past the budget) gives
    exactly what `oracle_for` gives request by request: chains, a tree, a DFlash block, a
    draft level (query_from), odd lengths, GQA and sinks."""
    from swafactory.harness import forward_oracle
    from swafactory.harness.workers import History, LayerSpec, oracle_for
    from swafactory.metadata.batch import ReqForward

    monkeypatch.setattr(forward_oracle, "SCORE_BUDGET", budget)
    monkeypatch.setattr(forward_oracle, "CPU_PAD_WASTE", 1e9)  # pad on CPU too (GPU's choice)
    g = torch.Generator().manual_seed(3)
    spec = LayerSpec(window=window, num_q_heads=4, num_kv_heads=2, head_dim=8, scale=0.3,
                     softcap=None, history_layer=0)
    reqs = [ReqForward("a", 0, 9, 1), ReqForward("b", 1, 4, 3, query_from=1),
            ReqForward("c", 2, 6, 5, parents=(-1, 0, 0, 1, 2)),
            ReqForward("d", 3, 3, 4, block=True), ReqForward("e", 4, 0, 7)]
    hist = {}
    for r in reqs:
        h = History()
        n = r.prefix_len + r.nodes
        h.pos = list(range(r.prefix_len)) + r.node_positions().tolist()
        h.record(0, 0, torch.randn(n, 2, 8, generator=g), torch.randn(n, 2, 8, generator=g))
        hist[r.rid] = h
    total = sum(r.q_len for r in reqs)
    q = torch.randn(total, 4, 8, generator=g)
    sinks = torch.randn(4, generator=g)
    got = forward_oracle.ForwardOracle(reqs, hist, "cpu").reference(spec, q, sinks)
    row, want = 0, []
    for r in reqs:
        want.append(oracle_for(spec, r, hist[r.rid], q[row:row + r.q_len], sinks))
        row += r.q_len
    want = torch.cat(want)
    assert got.shape == want.shape == (total, 4, 8)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert want.abs().sum() > 0
