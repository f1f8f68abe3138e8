"""Our CUDA fp8 decode kernel (``kernels/cuda/decode_fp8.cu``) on a GPU at Gemma 4's geometries
(32 q heads over 16 KV heads × 256 with W = 1024, and over 4 KV heads × 512), against fp32
attention over each request's dequantized history and against the Triton decode reading the same
e4m3 pool. Pools are shuffled and their unowned rows (the dummy row 0 included) NaN, so a stray
read shows; the scales (1/8, 1/32) make a dropped one miss by far. Run: ``pytest -m gpu
tests/kernels``.
"""
from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from kernel_batches import Req, assert_graph_replays_equal, make_batch, oracle_outputs, tol
from swafactory.kvcache.quant import quantize

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

F8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 1 / 8, 1 / 32


def _needs_kernel():
    from swafactory.kernels.cuda.launch import cuda_kernels_available
    if not cuda_kernels_available(torch.device("cuda")) or \
            torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the fp8 decode kernel needs nvcc and a Hopper GPU")


def _batch(lens, window, *, hq, hkv, d, seed=0):
    """(the e4m3 batch, the batch of its dequantized values) for requests of ``lens`` keys, each
    list in shuffled position order for odd requests (the kernel masks by position)."""
    rng = random.Random(seed)
    reqs = []
    for i, n in enumerate(lens):
        pos = list(range(0 if window is None else max(0, n - window - 40), n))
        if i % 2:
            rng.shuffle(pos)
        reqs.append(Req(kv_pos=pos, q_pos=[n - 1]))
    b = make_batch(reqs, hq=hq, hkv=hkv, d=d, dtype=torch.bfloat16, seed=seed, device="cuda")
    kq, vq = quantize(b.k_buf, K_SCALE, F8), quantize(b.v_buf, V_SCALE, F8)
    stored = dataclasses.replace(b, k_buf=kq, v_buf=vq)
    logical = dataclasses.replace(b, k_buf=kq.float() * K_SCALE, v_buf=vq.float() * V_SCALE)
    return stored, logical


GEOMETRIES = {"swa256": (32, 16, 256, 1024), "full512": (32, 4, 512, None)}


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("bs,top,splits", [(1, 3000, None), (3, 2000, 2), (8, 2100, None),
                                           (64, 300, None), (5, 90, 4), (2, 5000, 8)])
def test_fp8_decode_equals_the_oracle_and_the_triton_decode(geometry, with_sinks, bs, top,
                                                            splits):
    _needs_kernel()
    from swafactory.kernels.triton.decode import decode_attention

    hq, hkv, d, window = GEOMETRIES[geometry]
    lens = [top] + [max(1, top - 131 * i) for i in range(1, bs)]
    stored, logical = _batch(lens, window, hq=hq, hkv=hkv, d=d, seed=bs + d)
    assert torch.isnan(stored.k_buf[0].float()).all()  # the dummy row is poisoned
    sinks = torch.randn(hq, device="cuda") * 2 if with_sinks else None
    kw = dict(window=window, scale=d ** -0.5, sinks=sinks, num_splits=splits,
              k_scale=K_SCALE, v_scale=V_SCALE)
    want = oracle_outputs(logical, window=window, scale=d ** -0.5, sinks=sinks)
    o, lse = decode_attention(*stored.args(), **kw, cuda=True)
    ref_o, ref_lse = decode_attention(*stored.args(), **kw, cuda=False)
    torch.testing.assert_close(o.float().cpu(), want, **tol(torch.bfloat16))
    torch.testing.assert_close(o, ref_o, **tol(torch.bfloat16))
    torch.testing.assert_close(lse, ref_lse, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("hq,hkv,d", [(32, 4, 256), (16, 16, 512), (24, 4, 512)])
def test_fp8_decode_other_gqa_groups(hq, hkv, d):
    _needs_kernel()
    from swafactory.kernels.triton.decode import decode_attention

    stored, logical = _batch([2500, 1200, 77], None, hq=hq, hkv=hkv, d=d, seed=hq)
    want = oracle_outputs(logical, window=None, scale=0.05)
    o, _ = decode_attention(*stored.args(), window=None, scale=0.05, k_scale=K_SCALE,
                            v_scale=V_SCALE, cuda=True)
    torch.testing.assert_close(o.float().cpu(), want, **tol(torch.bfloat16))


def test_fp8_decode_misses_by_far_without_its_scales_and_shows_a_visible_nan():
    _needs_kernel()
    from swafactory.kernels.triton.decode import decode_attention

    stored, logical = _batch([900, 400], None, hq=32, hkv=4, d=512, seed=3)
    want = oracle_outputs(logical, window=None, scale=0.05)
    o, _ = decode_attention(*stored.args(), window=None, scale=0.05, cuda=True)  # scales dropped
    assert (o.float().cpu() - want).abs().max() > 1.0
    # a visible pool row of NaN reaches every head of its KV head, and no other
    stored.k_buf[int(stored.kv_indices[5]), 2] = math.nan
    o, _ = decode_attention(*stored.args(), window=None, scale=0.05, k_scale=K_SCALE,
                            v_scale=V_SCALE, cuda=True)
    assert torch.isnan(o[0, 16:24]).all() and torch.isfinite(o[0, :16]).all()
    assert torch.isfinite(o[1]).all()


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_fp8_decode_replays_from_a_cuda_graph(geometry):
    _needs_kernel()
    from swafactory.kernels.triton.decode import decode_attention

    hq, hkv, d, window = GEOMETRIES[geometry]
    stored, _ = _batch([3000 - 17 * i for i in range(16)], window, hq=hq, hkv=hkv, d=d, seed=1)

    def call():
        return decode_attention(*stored.args(), window=window, scale=0.05, k_scale=K_SCALE,
                                v_scale=V_SCALE, cuda=True)[0]

    assert_graph_replays_equal(call, call())


def test_fp8_decode_is_what_the_triton_backend_runs():
    """The route: a plain call (cuda=None) over an e4m3 pool at head_dim 512 reaches the kernel."""
    _needs_kernel()
    from swafactory.kernels.cuda.decode_fp8 import decode_fp8_kernel, fp8_tile
    from swafactory.kernels.triton.decode import decode_attention

    stored, _ = _batch([700, 500], None, hq=32, hkv=4, d=512, seed=5)
    bn, stages, _ = fp8_tile(512)
    kern = decode_fp8_kernel(512, 8, 1, bn, stages)
    before = kern.launches
    decode_attention(*stored.args(), window=None, scale=0.05, k_scale=K_SCALE, v_scale=V_SCALE,
                     num_splits=1)
    assert kern.launches == before + 1
