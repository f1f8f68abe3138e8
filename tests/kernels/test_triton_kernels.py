"""Triton decode / extend / merge against the fp32 oracle and the torch reference (interpreter).

Method: build a batch in a shuffled paged pool whose unowned rows (row 0 included) are NaN,
run the kernel under ``TRITON_INTERPRET=1`` on CPU tensors, and compare it per request to
``oracle_attention`` on the logical K/V gathered by hand, and to ``reference.py`` (o and lse).
Shapes are small because the interpreter is slow; the GPU file repeats this at real shapes.
"""
from __future__ import annotations

import math

import pytest
import torch

from swafactory.harness.oracle import tree_visibility
from swafactory.kernels.torch_ref import attention_reference, merge_state
from kernel_batches import Req, depths, make_batch, oracle_outputs, tree_parents, tol

pytest.importorskip("triton")
from swafactory.kernels.triton.decode import decode_attention  # noqa: E402
from swafactory.kernels.triton.extend import extend_attention  # noqa: E402
from swafactory.kernels.triton.merge import merge_attention_states  # noqa: E402
from swafactory.kernels.triton.ops import paged_attention  # noqa: E402

D = 16


def _check(fn, batch, *, window, softcap=None, sinks=None, dtype=torch.float32, **kw):
    """Run ``fn`` and compare o with the oracle and (o, lse) with the reference."""
    scale = batch.q.shape[-1] ** -0.5
    o, lse = fn(*batch.args(), **batch.masks(), window=window, scale=scale, softcap=softcap,
                sinks=sinks, **kw)
    assert o.dtype == batch.q.dtype and lse.dtype == torch.float32
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    want = oracle_outputs(batch, window=window, scale=scale, softcap=softcap, sinks=sinks)
    torch.testing.assert_close(o.float(), want, **tol(dtype))
    ro, rl = attention_reference(*batch.args(), **batch.masks(), window=window, scale=scale,
                                 softcap=softcap, sinks=sinks)
    torch.testing.assert_close(o.float(), ro.float(), **tol(dtype))
    torch.testing.assert_close(lse, rl, **(tol(dtype) | {"equal_nan": True}))  # -inf == -inf
    return o, lse


def _decode_reqs(lens, trim_to=None):
    """One decode query per request at position len-1; keys 0..len-1 or only the last trim_to."""
    reqs = []
    for n in lens:
        first = 0 if trim_to is None else max(0, n - trim_to)
        reqs.append(Req(kv_pos=list(range(first, n)), q_pos=[n - 1]))
    return reqs


# ----------------------------------------------------------------------------------- decode
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_matches_oracle(page_size, gqa, window, dtype):
    # odd lengths and the window edges W-1, W, W+1 in one batch; 70 spans several key tiles
    batch = make_batch(_decode_reqs([1, 7, 8, 9, 33, 70]), hq=2 * gqa, hkv=2, d=D, dtype=dtype,
                       page_size=page_size, seed=gqa + page_size)
    _check(decode_attention, batch, window=window, dtype=dtype, num_splits=3)


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("softcap", [None, 4.0])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_decode_sinks_softcap_and_splits(with_sinks, softcap, splits):
    batch = make_batch(_decode_reqs([3, 8, 41]), hq=8, hkv=2, d=32, page_size=16, seed=5)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(1)) * 2 if with_sinks else None
    _check(decode_attention, batch, window=8, softcap=softcap, sinks=sinks, num_splits=splits)


def test_decode_on_a_trimmed_list_and_int64_indices_and_wide_heads():
    # the planner may keep only the window's keys; D=512 is Gemma 4's full-layer head dim
    batch = make_batch(_decode_reqs([5, 8, 9, 30], trim_to=8), hq=4, hkv=1, d=512,
                       page_size=1, seed=3, index_dtype=torch.int64)
    _check(decode_attention, batch, window=8, num_splits=2)


def test_decode_with_no_visible_key_gives_zero_and_minus_inf_or_the_sink():
    # the only key sits outside the window: o = 0 and lse = -inf, or lse = sink with a sink
    batch = make_batch([Req(kv_pos=[0], q_pos=[10])], hq=2, hkv=1, d=D, seed=4)
    o, lse = decode_attention(*batch.args(), window=4, scale=0.25)
    assert torch.equal(o, torch.zeros_like(o)) and bool((lse == -math.inf).all())
    sinks = torch.tensor([0.5, -1.0])
    o, lse = decode_attention(*batch.args(), window=4, scale=0.25, sinks=sinks)
    assert torch.equal(o, torch.zeros_like(o))
    torch.testing.assert_close(lse[0], sinks)


# ----------------------------------------------------------------------------------- extend
def _prefill_reqs():
    # prefill with a cached prefix (odd sizes) and a request with no cached prefix
    return [Req(kv_pos=list(range(n)), q_pos=list(range(n - m, n)))
            for n, m in [(13, 5), (37, 9), (8, 8), (21, 1)]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_causal_prefill_matches_oracle(page_size, gqa, window, dtype):
    batch = make_batch(_prefill_reqs(), hq=2 * gqa, hkv=2, d=D, dtype=dtype,
                       page_size=page_size, seed=7 + gqa)
    _check(extend_attention, batch, window=window, dtype=dtype, num_splits=2)


def test_extend_with_a_written_out_causal_mask_equals_the_implicit_one():
    reqs = _prefill_reqs()
    implicit = make_batch(reqs, hq=4, hkv=2, d=D, seed=8)
    explicit = make_batch(reqs, hq=4, hkv=2, d=D, seed=8, with_mask=True)
    a, la = extend_attention(*implicit.args(), window=8, scale=0.25)
    b, lb = extend_attention(*explicit.args(), **explicit.masks(), window=8, scale=0.25)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(la, lb, rtol=0, atol=0)


@pytest.mark.parametrize("dense", [True, False])
def test_an_empty_mask_block_is_causal_beside_a_tree(dense):
    """A graph bucket captured with a mask replays chains too: a request whose block is empty
    (``mask_indptr[b] == mask_indptr[b+1]``) is causal by position, exactly as the same request
    with its causal block written out, beside a tree request's real block."""
    tree = _tree_req(9, tree_parents(2, 3, seed=1))
    chain = Req(kv_pos=list(range(21)), q_pos=list(range(13, 21)))
    full = make_batch([chain, tree, chain], hq=8, hkv=2, d=D, seed=11, with_mask=True)
    n_chain = len(chain.q_pos) * len(chain.kv_pos)
    mi = full.mask_indptr.tolist()
    keep = torch.ones(full.mask.numel(), dtype=torch.bool)
    keep[mi[0]:mi[1]] = False
    keep[mi[2]:mi[3]] = False
    empty = torch.tensor([0, 0, mi[2] - mi[1], mi[2] - mi[1]], dtype=torch.int32)
    kw = dict(window=6, scale=0.25, num_splits=2, dense=dense)
    a, la = extend_attention(*full.args(), **full.masks(), **kw)
    b, lb = extend_attention(*full.args(), mask=full.mask[keep], mask_indptr=empty, **kw)
    assert n_chain and torch.equal(a, b) and torch.equal(la, lb)
    ro, rl = attention_reference(*full.args(), mask=full.mask[keep], mask_indptr=empty,
                                 window=6, scale=0.25)
    torch.testing.assert_close(b, ro, **tol(torch.float32))


def _tree_req(prefix_len, parents):
    n = len(parents)
    pos = [prefix_len + dpt for dpt in depths(parents)]
    return Req(kv_pos=list(range(prefix_len)) + pos, q_pos=pos,
               structure=tree_visibility(prefix_len, parents))


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("topk", [2, 4])
@pytest.mark.parametrize("page_size", [1, 16])
def test_tree_verify_matches_oracle(page_size, topk, window, with_sinks):
    # window 6 cuts into the prefix by each node's own position (prefix_len + depth)
    reqs = [_tree_req(9, tree_parents(topk, 3, seed=1)), _tree_req(23, tree_parents(topk, 2, seed=2))]
    batch = make_batch(reqs, hq=8, hkv=2, d=D, page_size=page_size, seed=topk)
    sinks = torch.linspace(-1, 1, 8) if with_sinks else None
    _check(extend_attention, batch, window=window, sinks=sinks, softcap=5.0, num_splits=2)


def test_dflash_block_is_non_causal_inside_the_block():
    prefix, block = 11, 5
    pos = list(range(prefix, prefix + block))
    st = torch.ones(block, prefix + block, dtype=torch.bool)
    batch = make_batch([Req(kv_pos=list(range(prefix + block)), q_pos=pos, structure=st)],
                       hq=4, hkv=1, d=D, seed=9)
    o, _ = _check(extend_attention, batch, window=None)
    causal = make_batch([Req(kv_pos=list(range(prefix + block)), q_pos=pos)], hq=4, hkv=1, d=D, seed=9)
    oc, _ = extend_attention(*causal.args(), scale=0.25)
    assert not torch.allclose(o[:-1], oc[:-1])  # early block queries see later block keys
    torch.testing.assert_close(o[-1], oc[-1])   # the last one sees the same keys either way


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("topk", [2, 4])
def test_cascade_prefix_plus_expand_plus_merge_equals_one_masked_pass(topk, with_sinks):
    prefix, window = 19, 7
    parents = tree_parents(topk, 3, seed=topk)
    pos = [prefix + dpt for dpt in depths(parents)]
    n = len(parents)
    sinks = torch.linspace(-0.5, 1.5, 8) if with_sinks else None
    kw = dict(window=window, scale=0.25, softcap=None)
    full = make_batch([_tree_req(prefix, parents)], hq=8, hkv=2, d=D, page_size=16, seed=11)
    o_full, lse_full = extend_attention(*full.args(), **full.masks(), **kw, sinks=sinks)
    # the same K/V rows, split: prefix keys (causal holds: every node is past the prefix) …
    kv = full.kv_indices
    pre = make_batch([Req(kv_pos=list(range(prefix)), q_pos=pos)], hq=8, hkv=2, d=D)
    pre.q, pre.k_buf, pre.v_buf, pre.kv_indices = full.q, full.k_buf, full.v_buf, kv[:prefix]
    o1, l1 = extend_attention(*pre.args(), **kw)
    # … and the draft keys under the tree mask alone
    st = tree_visibility(0, parents)
    exp = make_batch([Req(kv_pos=pos, q_pos=pos, structure=st)], hq=8, hkv=2, d=D)
    exp.q, exp.k_buf, exp.v_buf, exp.kv_indices = full.q, full.k_buf, full.v_buf, kv[prefix:]
    o2, l2 = extend_attention(*exp.args(), **exp.masks(), **kw)
    o, lse = merge_attention_states(o1, l1, o2, l2, sinks=sinks)
    torch.testing.assert_close(o, o_full, **tol(torch.float32))
    torch.testing.assert_close(lse, lse_full, **tol(torch.float32))
    ro, rl = merge_state(o1, l1, o2, l2, sinks=sinks)
    torch.testing.assert_close(o, ro, **tol(torch.float32))
    torch.testing.assert_close(lse, rl, **tol(torch.float32))
    assert o.shape == (n, 8, D)


def test_merge_handles_empty_states_and_fp16():
    g = torch.Generator().manual_seed(3)
    o1, o2 = torch.randn(5, 4, 32, generator=g).half(), torch.randn(5, 4, 32, generator=g).half()
    l1, l2 = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)
    l1[0], l2[1] = -math.inf, -math.inf
    o1[0], o2[1] = 0, 0
    l1[2], l2[2] = -math.inf, -math.inf
    o1[2], o2[2] = 0, 0
    o, lse = merge_attention_states(o1, l1, o2, l2)
    ro, rl = merge_state(o1, l1, o2, l2)
    torch.testing.assert_close(o, ro, **tol(torch.float16))
    torch.testing.assert_close(lse, rl, rtol=1e-5, atol=1e-5, equal_nan=False)
    torch.testing.assert_close(o[0], o2[0], rtol=0, atol=0)
    torch.testing.assert_close(lse[1], l1[1], rtol=0, atol=0)
    assert bool((lse[2] == -math.inf).all()) and torch.equal(o[2], torch.zeros_like(o[2]))


# ------------------------------------------------------------------------------ NaN hygiene
def test_nan_in_masked_rows_does_not_leak_and_nan_in_a_visible_row_does():
    # request 0's oldest key is mapped to the dummy row 0 (NaN): outside the window, so it must
    # not leak; request 1's visible key row is poisoned, so its output must be NaN.
    reqs = _decode_reqs([12, 10])
    batch = make_batch(reqs, hq=4, hkv=1, d=D, page_size=1, seed=12)
    batch.kv_indices[0] = 0
    assert torch.isnan(batch.k_buf[0]).all() and torch.isnan(batch.v_buf[0]).all()
    out_of_window = int(batch.kv_indices[1])  # position 1 of request 0: also outside W=8
    batch.k_buf[out_of_window] = math.nan
    batch.v_buf[out_of_window] = math.nan
    seen = int(batch.kv_indices[12 + 7])
    batch.v_buf[seen] = math.nan
    for fn in (decode_attention, extend_attention):
        o, lse = fn(*batch.args(), window=8, scale=0.25)
        ro, rl = attention_reference(*batch.args(), window=8, scale=0.25)
        assert not torch.isnan(o[0]).any() and not torch.isnan(lse[0]).any()
        assert torch.isnan(o[1]).all()
        torch.testing.assert_close(o[0], ro[0], **tol(torch.float32))
        assert torch.isnan(ro[1]).all()


def test_nan_in_a_sibling_branch_reaches_only_the_queries_that_see_it():
    parents = [-1, -1, 0, 1]  # two branches: 0→2 and 1→3
    batch = make_batch([_tree_req(6, parents)], hq=4, hkv=2, d=D, seed=13)
    row = int(batch.kv_indices[6 + 1])  # node 1's V row
    batch.v_buf[row] = math.nan
    o, _ = extend_attention(*batch.args(), **batch.masks(), scale=0.25)
    ro, _ = attention_reference(*batch.args(), **batch.masks(), scale=0.25)
    assert torch.isnan(o[[1, 3]]).all() and not torch.isnan(o[[0, 2]]).any()
    torch.testing.assert_close(o[[0, 2]], ro[[0, 2]], **tol(torch.float32))
    batch.v_buf[row] = 0.0
    batch.k_buf[row] = math.nan  # a NaN key: same rule through the scores
    o, _ = extend_attention(*batch.args(), **batch.masks(), scale=0.25)
    assert torch.isnan(o[[1, 3]]).all() and not torch.isnan(o[[0, 2]]).any()


# ------------------------------------------------------------------------------- dispatcher
def test_paged_attention_routes_and_matches_the_reference(monkeypatch):
    dec = make_batch(_decode_reqs([4, 9]), hq=4, hkv=2, d=D, seed=14)
    ext = make_batch(_prefill_reqs(), hq=4, hkv=2, d=D, seed=15)
    for batch in (dec, ext):
        o, lse = paged_attention(*batch.args(), **batch.masks(), window=8, scale=0.25)
        ro, rl = attention_reference(*batch.args(), **batch.masks(), window=8, scale=0.25)
        torch.testing.assert_close(o, ro, **tol(torch.float32))
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU without the interpreter: torch fallback
    o, _ = paged_attention(*ext.args(), window=8, scale=0.25)
    torch.testing.assert_close(o, attention_reference(*ext.args(), window=8, scale=0.25)[0],
                               rtol=0, atol=0)


def test_decode_refuses_masks_and_odd_head_dims():
    batch = make_batch(_decode_reqs([4]), hq=2, hkv=1, d=24, seed=16)
    with pytest.raises(ValueError, match="power of two"):
        decode_attention(*batch.args(), scale=0.2)
    with pytest.raises(ValueError, match="extend_attention"):
        decode_attention(*batch.args(), mask=torch.ones(4, dtype=torch.bool),
                         mask_indptr=torch.tensor([0, 4], dtype=torch.int32), scale=0.2)


@pytest.mark.parametrize("fn", [decode_attention, extend_attention])
def test_untrimmed_lists_much_longer_than_the_window_take_the_tile_skipping_path(fn):
    # 200 keys, W = 8: most key tiles are invisible, so the kernel branches around them
    reqs = _decode_reqs([200, 150]) if fn is decode_attention else \
        [Req(kv_pos=list(range(200)), q_pos=list(range(195, 200)))]
    batch = make_batch(reqs, hq=4, hkv=2, d=D, page_size=16, seed=17)
    _check(fn, batch, window=8, num_splits=2)


# ---------------------------------------------------------------------- dense run (fast path)
def _holey_req(prefix, nodes, seed, *, shuffle_pos=False):
    """A verify-like request whose structure has holes in the prefix (so the dense run stops
    early and starts late) and, optionally, key positions out of order."""
    g = torch.Generator().manual_seed(seed)
    n = prefix + nodes
    kv_pos = list(range(n))
    if shuffle_pos:
        perm = torch.randperm(prefix, generator=g).tolist()
        kv_pos = [kv_pos[i] for i in perm] + kv_pos[prefix:]
    st = torch.ones(nodes, n, dtype=torch.bool)
    st[:, prefix:] = torch.rand(nodes, nodes, generator=g) < 0.5
    st[:, prefix:] |= torch.eye(nodes, dtype=torch.bool)
    for c in torch.randint(0, prefix, (3,), generator=g).tolist():  # a few holes in the prefix
        st[torch.randint(0, nodes, (1,), generator=g), c] = False
    return Req(kv_pos=kv_pos, q_pos=list(range(prefix, prefix + nodes)), structure=st)


@pytest.mark.parametrize("window,config", [(None, None), (11, (16, 16, 4, 2, 0))])
def test_dense_run_with_holes_and_shuffled_positions_matches_the_general_path(window, config):
    # the dense run is only where every query sees every key; holes, a window edge and
    # out-of-order positions push keys back to the general tiles, splits cut the run
    reqs = [_holey_req(29, 5, seed=1), _holey_req(40, 3, seed=2, shuffle_pos=True),
            _holey_req(7, 6, seed=3)]
    batch = make_batch(reqs, hq=8, hkv=2, d=D, page_size=4, seed=21)
    sinks = torch.linspace(-1, 1, 8)
    for splits in (1, 3):
        o, lse = _check(extend_attention, batch, window=window, sinks=sinks, num_splits=splits,
                        config=config)
        o2, lse2 = extend_attention(*batch.args(), **batch.masks(), window=window, scale=D ** -0.5,
                                    sinks=sinks, num_splits=splits, config=config, dense=False)
        torch.testing.assert_close(o, o2, **tol(torch.float32))
        torch.testing.assert_close(lse, lse2, **tol(torch.float32))


def test_a_partly_nan_row_in_the_dense_run_poisons_whole_rows_of_the_queries_that_see_it():
    # a NaN in one column of a V row every query sees: whole output rows NaN, as the reference
    batch = make_batch([Req(kv_pos=list(range(40)), q_pos=[38, 39]),
                        Req(kv_pos=list(range(20)), q_pos=[19])], hq=4, hkv=1, d=D, seed=22)
    batch.v_buf[int(batch.kv_indices[5]), 0, 3] = math.nan
    o, _ = extend_attention(*batch.args(), scale=0.25, max_q_len=2)
    ro, _ = attention_reference(*batch.args(), scale=0.25)
    assert torch.isnan(o[:2]).all() and torch.isnan(ro[:2]).all()
    torch.testing.assert_close(o[2:], ro[2:], **tol(torch.float32))


# ----------------------------------------------------------------------------------- sinks
@pytest.mark.parametrize("lse_scale", [1.0, math.log(2.0)])
def test_sink_epilogue_equals_the_torch_epilogue_on_a_transposed_lse(lse_scale):
    """The one-launch sink epilogue the adapters take on CUDA (`sink_output`) gives what
    `apply_sinks` gives, for an LSE handed over transposed (FA4's [Hq, total_q]) and in base 2
    (FlashInfer's), with -inf rows (no visible key) weighing 0."""
    from swafactory.kernels.torch_ref import apply_sinks
    from swafactory.kernels.triton.sinks import sink_epilogue, sink_output

    g = torch.Generator().manual_seed(0)
    n, h, d = 5, 6, 24  # d not a power of two: the kernel masks its padded columns
    o = torch.randn(n, h, d, generator=g)
    lse_t = torch.randn(h, n, generator=g) * 3  # as FA4 returns it
    lse_t[:, 2] = float("-inf")
    sinks = torch.randn(h, generator=g)
    want, _ = apply_sinks(o, lse_t.t() * lse_scale, sinks)
    got = sink_epilogue(o.clone(), lse_t.t().contiguous(), sinks, lse_scale=lse_scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(got[2], torch.zeros_like(got[2]))
    torch.testing.assert_close(sink_output(o.clone(), lse_t.t(), sinks, lse_scale=lse_scale),
                               want, rtol=1e-5, atol=1e-6)  # CPU: the torch epilogue
