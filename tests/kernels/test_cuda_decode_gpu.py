"""Our CUDA cluster decode kernel (``kernels/cuda/decode_d64.cu``) on a GPU at GPT-OSS's geometry
(64 q / 8 KV heads × 64, sinks, W = 128), bf16, against fp32 attention over each request's
logical history and against the Triton decode. Pools are shuffled and their unowned rows (the
dummy row 0 included) NaN, so a stray read shows; the step's rows are NaN before a fused call,
so the output is right only if the new key came from ``new_kv``. Run: ``pytest -m gpu
tests/kernels``.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

from kernel_batches import Req, assert_graph_replays_equal, make_batch, oracle_outputs, tol

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")


def _needs_kernel():
    from swafactory.kernels.cuda.launch import cuda_kernels_available
    if not cuda_kernels_available(torch.device("cuda")) or \
            torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the cluster decode kernel needs nvcc and a Hopper GPU")


def _reqs(lens, window, seed):
    rng = random.Random(seed)
    reqs = []
    for i, n in enumerate(lens):
        pos = list(range(0 if window is None else max(0, n - window), n))
        if i % 2:  # list order is not position order: the kernel masks by position
            rng.shuffle(pos)
        reqs.append(Req(kv_pos=pos, q_pos=[n - 1]))
    return reqs


def _batch(lens, window, *, hq=64, hkv=8, seed=0):
    return make_batch(_reqs(lens, window, seed), hq=hq, hkv=hkv, d=64, dtype=torch.bfloat16,
                      seed=seed, device="cuda")


def _new_rows(batch):
    """The slots of each request's key at q's position, and their K/V (cloned)."""
    pos = batch.kv_pos.long()
    starts = batch.kv_indptr[:-1].long()
    qp = batch.q_pos.long()
    idx = torch.stack([starts[b] + (pos[starts[b]:batch.kv_indptr[b + 1]] == qp[b]).nonzero()[0, 0]
                       for b in range(qp.numel())])
    slots = batch.kv_indices[idx].long()
    return slots, batch.k_buf[slots].clone(), batch.v_buf[slots].clone()


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("window,with_sinks", [(None, True), (128, True), (None, False)])
@pytest.mark.parametrize("bs,top,splits", [(1, 3000, None), (3, 2000, 2), (8, 4100, None),
                                           (64, 700, None), (5, 90, 4)])
def test_cluster_decode_equals_the_oracle_and_the_triton_decode(bs, top, splits, window,
                                                                 with_sinks, fused):
    _needs_kernel()
    from swafactory.kernels.triton.decode import decode_attention

    lens = [top] + [max(1, top - 131 * i) for i in range(1, bs)]
    batch = _batch(lens, window, seed=bs + 7 * (window or 1))
    sinks = torch.randn(64, device="cuda") * 2 if with_sinks else None
    slots, kn, vn = _new_rows(batch)
    kw = dict(window=window, scale=0.125, sinks=sinks, num_splits=splits)
    want = oracle_outputs(batch, window=window, scale=0.125, sinks=sinks)
    ref_o, ref_lse = decode_attention(*batch.args(), **kw, cuda=False)
    new_kv = None
    if fused:
        new_kv = (kn, vn, slots)
        batch.k_buf[slots] = math.nan
        batch.v_buf[slots] = math.nan
    o, lse = decode_attention(*batch.args(), **kw, new_kv=new_kv, cuda=True)
    torch.testing.assert_close(o.float().cpu(), want, **tol(torch.bfloat16))
    torch.testing.assert_close(o, ref_o, **tol(torch.bfloat16))
    torch.testing.assert_close(lse, ref_lse, rtol=1e-3, atol=1e-3)
    if fused:
        assert torch.equal(batch.k_buf[slots], kn) and torch.equal(batch.v_buf[slots], vn)
    assert torch.isnan(batch.k_buf[0]).all() and torch.isnan(batch.v_buf[0]).all()


@pytest.mark.parametrize("hq,hkv", [(32, 8), (8, 8)])
def test_cluster_decode_smaller_gqa_groups(hq, hkv):
    _needs_kernel()
    from swafactory.kernels.triton.decode import decode_attention

    batch = _batch([2500, 1200, 77], None, hq=hq, hkv=hkv, seed=hq)
    want = oracle_outputs(batch, window=None, scale=0.2)
    o, _ = decode_attention(*batch.args(), window=None, scale=0.2, cuda=True)
    torch.testing.assert_close(o.float().cpu(), want, **tol(torch.bfloat16))


def test_cluster_decode_drops_padding_writes_and_shows_a_visible_nan():
    _needs_kernel()
    from swafactory.kernels.triton.decode import decode_attention

    # a graph's padding request: one key at the dummy row 0, position 0, writing row 0
    batch = make_batch([Req(kv_pos=list(range(600)), q_pos=[599]), Req(kv_pos=[0], q_pos=[0])],
                       hq=64, hkv=8, d=64, dtype=torch.bfloat16, seed=2, device="cuda")
    batch.kv_indices[600] = 0
    batch.q_pos[1] = 0
    kn = torch.randn(2, 8, 64, device="cuda", dtype=torch.bfloat16)
    vn = torch.randn(2, 8, 64, device="cuda", dtype=torch.bfloat16)
    slots = torch.tensor([int(batch.kv_indices[599]), 0], device="cuda")
    o, _ = decode_attention(*batch.args(), window=None, scale=0.125, new_kv=(kn, vn, slots),
                            cuda=True)
    assert torch.isnan(batch.k_buf[0]).all() and torch.isnan(batch.v_buf[0]).all()
    torch.testing.assert_close(o[1], vn[1].repeat_interleave(8, 0))  # its only key: its own
    assert torch.isfinite(o).all()
    # a visible pool row of NaN reaches the output of every head of its KV head
    batch.k_buf[int(batch.kv_indices[5]), 3] = math.nan
    o, _ = decode_attention(*batch.args(), window=None, scale=0.125, new_kv=(kn, vn, slots),
                            cuda=True)
    assert torch.isnan(o[0, 24:32]).all() and torch.isfinite(o[0, :24]).all()


@pytest.mark.parametrize("bs", [8, 64])
def test_cluster_decode_replays_from_a_cuda_graph(bs):
    _needs_kernel()
    from swafactory.kernels.triton.decode import decode_attention

    batch = _batch([4096 - 17 * i for i in range(bs)], None, seed=bs)
    sinks = torch.randn(64, device="cuda")
    slots, kn, vn = _new_rows(batch)

    def call():
        return decode_attention(*batch.args(), window=None, scale=0.125, sinks=sinks,
                                new_kv=(kn, vn, slots), cuda=True)[0]

    o = call()
    assert_graph_replays_equal(call, o)
