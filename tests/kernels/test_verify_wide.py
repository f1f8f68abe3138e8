"""The two-kernel verify of wide heads (`verify_wide`) against the fp32 oracle (interpreter).

The path is built for D = 512 with 64 rows per KV head; its rules do not depend on D, so most
cases run at D = 32 with ``wide=True`` (the interpreter is slow), key tiles small enough that
every request spans several, and both kernels' key splits forced past one. One case runs it at
D = 512 through ``extend_attention(..., wide=True)``: it is opt-in (slower on the H200 than the
one-kernel tile so far), never the default.
"""
from __future__ import annotations

import math

import pytest
import torch

from swafactory.harness.oracle import tree_visibility
from swafactory.kernels.torch_ref import attention_reference
from kernel_batches import Req, depths, make_batch, oracle_outputs, tree_parents, tol

pytest.importorskip("triton")
from swafactory.kernels.triton import verify_wide  # noqa: E402
from swafactory.kernels.triton.extend import extend_attention  # noqa: E402
from swafactory.kernels.triton.merge import compute_dtype  # noqa: E402

D = 32


def _wide(splits=(1, 1), bn=8, dk=None):
    """extend_attention's signature over `wide_verify` with fixed tiles and splits."""
    def fn(q, k, v, qo, kvp, kvi, qp, kp, *, mask=None, mask_indptr=None, window=None, scale,
           softcap=None, sinks=None, **_):
        group = q.shape[1] // k.shape[1]
        nq = int((qo[1:] - qo[:-1]).max())
        bm = max(16, 1 << (nq * group - 1).bit_length())
        m = None if mask is None else mask.contiguous().view(torch.uint8)
        return verify_wide.wide_verify(
            q, k, v, qo, kvp, kvi, qp, kp, mask=m, mask_indptr=mask_indptr, window=window,
            scale=scale, softcap=softcap, sinks=sinks, group=group, block_m=bm,
            cdt=compute_dtype(q.dtype, k.dtype),
            config=dict(BN=bn, s_splits=splits[0], pv_splits=splits[1], DS=16, DK=dk or D))
    return fn


def _check(fn, batch, *, window, softcap=None, sinks=None, dtype=torch.float32):
    scale = batch.q.shape[-1] ** -0.5
    o, lse = fn(*batch.args(), **batch.masks(), window=window, scale=scale, softcap=softcap,
                sinks=sinks)
    assert o.dtype == batch.q.dtype and not torch.isnan(o).any()
    want = oracle_outputs(batch, window=window, scale=scale, softcap=softcap, sinks=sinks)
    torch.testing.assert_close(o.float(), want, **tol(dtype))
    _, rl = attention_reference(*batch.args(), **batch.masks(), window=window, scale=scale,
                                softcap=softcap, sinks=sinks)
    torch.testing.assert_close(lse, rl, **(tol(dtype) | {"equal_nan": True}))
    return o, lse


def _tree_req(prefix_len, parents):
    pos = [prefix_len + dpt for dpt in depths(parents)]
    return Req(kv_pos=list(range(prefix_len)) + pos, q_pos=pos,
               structure=tree_visibility(prefix_len, parents))


def _chain_req(prefix_len, n):
    return Req(kv_pos=list(range(prefix_len + n)), q_pos=list(range(prefix_len, prefix_len + n)))


@pytest.mark.parametrize("dtype,window,splits", [(torch.float32, None, (1, 1)),
                                                  (torch.float32, 13, (3, 2)),
                                                  (torch.float16, 13, (3, 2))])
def test_chain_verify_matches_oracle(dtype, window, splits):
    # 8 tokens × group 4 = 32 rows; lengths that end mid-tile and a request shorter than a tile
    reqs = [_chain_req(37, 8), _chain_req(3, 8), _chain_req(60, 5)]
    batch = make_batch(reqs, hq=8, hkv=2, d=D, dtype=dtype, page_size=4, seed=1)
    _check(_wide(splits), batch, window=window, dtype=dtype)


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
def test_tree_verify_with_window_softcap_and_sinks_matches_oracle(page_size, with_sinks):
    reqs = [_tree_req(29, tree_parents(2, 3, seed=1)), _tree_req(50, tree_parents(4, 2, seed=2))]
    batch = make_batch(reqs, hq=16, hkv=2, d=D, page_size=page_size, seed=3)  # group 8: 64 rows
    sinks = torch.linspace(-1, 1, 16) if with_sinks else None
    _check(_wide((2, 3)), batch, window=11, sinks=sinks, softcap=5.0)


def test_scores_over_d_slices_equal_scores_with_q_resident():
    reqs = [_tree_req(29, tree_parents(2, 3, seed=1)), _chain_req(40, 8)]
    batch = make_batch(reqs, hq=16, hkv=2, d=D, page_size=4, seed=8)
    o, lse = _check(_wide((2, 2), dk=8), batch, window=11, softcap=5.0)
    o1, lse1 = _wide((2, 2))(*batch.args(), **batch.masks(), window=11, scale=D ** -0.5,
                             softcap=5.0)
    torch.testing.assert_close(o, o1, **tol(torch.float32))
    torch.testing.assert_close(lse, lse1, **tol(torch.float32))


def test_dflash_block_sees_the_whole_block():
    prefix, block = 21, 6
    pos = list(range(prefix, prefix + block))
    st = torch.ones(block, prefix + block, dtype=torch.bool)
    batch = make_batch([Req(kv_pos=list(range(prefix + block)), q_pos=pos, structure=st)],
                       hq=8, hkv=1, d=D, seed=4)
    _check(_wide((2, 1)), batch, window=None)


def test_stale_reads_poison_only_the_rows_that_see_them():
    parents = [-1, -1, 0, 1]  # two branches: 0→2 and 1→3
    batch = make_batch([_tree_req(19, parents)], hq=16, hkv=2, d=D, seed=5)
    fn = _wide((2, 2))
    row = int(batch.kv_indices[19 + 1])  # node 1's V row
    batch.v_buf[row] = math.nan
    o, _ = fn(*batch.args(), **batch.masks(), scale=0.25)
    ro, _ = attention_reference(*batch.args(), **batch.masks(), scale=0.25)
    assert torch.isnan(o[[1, 3]]).all() and not torch.isnan(o[[0, 2]]).any()
    torch.testing.assert_close(o[[0, 2]], ro[[0, 2]], **tol(torch.float32))
    batch.v_buf[row] = 0.0
    batch.k_buf[row] = math.nan  # a NaN key: the same rule through the scores
    o, _ = fn(*batch.args(), **batch.masks(), scale=0.25)
    assert torch.isnan(o[[1, 3]]).all() and not torch.isnan(o[[0, 2]]).any()
    # a NaN row out of the window is read by nobody and poisons nothing
    chain = make_batch([_chain_req(30, 4)], hq=16, hkv=2, d=D, seed=6)
    old = int(chain.kv_indices[2])
    chain.k_buf[old] = math.nan
    chain.v_buf[old] = math.nan
    o, _ = fn(*chain.args(), window=9, scale=0.25)
    ro, _ = attention_reference(*chain.args(), window=9, scale=0.25)
    assert not torch.isnan(o).any()
    torch.testing.assert_close(o, ro, **tol(torch.float32))


def test_opt_in_at_d512_matches_the_one_kernel_tile_which_stays_the_default(monkeypatch):
    batch = make_batch([_chain_req(40, 8), _chain_req(9, 8)], hq=16, hkv=2, d=512, seed=7)
    calls = []
    real = verify_wide.wide_verify

    def spy(*a, **kw):
        calls.append(kw["block_m"])
        return real(*a, **kw)

    import swafactory.kernels.triton.extend as ext
    monkeypatch.setattr(ext, "wide_verify", spy)
    o, lse = extend_attention(*batch.args(), scale=512 ** -0.5, max_q_len=8, wide=True)
    assert calls == [64]
    o1, lse1 = extend_attention(*batch.args(), scale=512 ** -0.5, max_q_len=8)
    assert calls == [64]  # the default is the one-kernel tile
    torch.testing.assert_close(o, o1, **tol(torch.float32))
    torch.testing.assert_close(lse, lse1, **tol(torch.float32))
    want = oracle_outputs(batch, window=None, scale=512 ** -0.5, softcap=None, sinks=None)
    torch.testing.assert_close(o, want, **tol(torch.float32))
    with pytest.raises(ValueError, match="64 rows"):
        extend_attention(*batch.args(), scale=512 ** -0.5, max_q_len=9, wide=True)
