"""fp8 e4m3 K/V with per-layer scales through every kernel that declares it: the torch reference
and our Triton decode / extend (interpreter on CPU, compiled with ``-m gpu``).

Each one reads pool buffers that hold ``K / k_scale`` in e4m3 and must equal the fp32 oracle over
the dequantized values (``stored · scale``), with the same tolerance as bf16; a kernel that
drops either scale misses by far more (the scales here are 1/8 and 1/32, so a dropped one is off
by 8× or 32×, which the last test checks is caught).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kernel_batches import Req, make_batch, oracle_outputs, tree_parents
from swafactory.harness.oracle import tree_visibility
from swafactory.kernels.torch_ref import attention_reference
from swafactory.kvcache.quant import quantize

F8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 1 / 8, 1 / 32


def _q_dtype(batch) -> torch.dtype:
    """bf16 (what engines pair with fp8 KV); fp16 in Triton's CPU interpreter, whose bf16 is
    wrong (triton 3.9: a bf16 decode misses the oracle by 8e8, with no fp8 involved)."""
    return torch.bfloat16 if batch.q.is_cuda else torch.float16


def _fp8(batch):
    """``batch`` with fp8 buffers (NaN rows stay NaN) and q in `_q_dtype`, and the batch whose
    buffers are those values dequantized (what the oracle reads)."""
    dtype = _q_dtype(batch)
    kq, vq = quantize(batch.k_buf, K_SCALE, F8), quantize(batch.v_buf, V_SCALE, F8)
    stored = dataclasses.replace(batch, q=batch.q.to(dtype), k_buf=kq, v_buf=vq)
    logical = dataclasses.replace(batch, q=batch.q.to(dtype), k_buf=kq.float() * K_SCALE,
                                  v_buf=vq.float() * V_SCALE)
    return stored, logical


def _check(fn, batch, *, window=None, sinks=None, **kw):
    stored, logical = _fp8(batch)
    assert torch.isnan(stored.k_buf.float()).any()  # the unowned rows stayed poisoned
    scale = batch.q.shape[-1] ** -0.5
    o, lse = fn(*stored.args(), **stored.masks(), window=window, scale=scale, sinks=sinks,
                k_scale=K_SCALE, v_scale=V_SCALE, **kw)
    assert o.dtype == stored.q.dtype and not torch.isnan(o).any()
    want = oracle_outputs(logical, window=window, scale=scale, sinks=sinks)
    torch.testing.assert_close(o.float().cpu(), want, rtol=2e-2, atol=2e-2)
    return o, lse, want


def _reqs(n_req: int, ctx: int, q_len: int, tree: bool = False) -> list[Req]:
    out = []
    for i in range(n_req):
        prefix = list(range(ctx + 3 * i))
        if not tree:
            q = list(range(len(prefix), len(prefix) + q_len))
            out.append(Req(prefix + q, q))
            continue
        parents = tree_parents(2, q_len // 2, seed=i)
        depth = [0] * len(parents)
        for j, p in enumerate(parents):
            depth[j] = 0 if p == -1 else depth[p] + 1
        pos = [len(prefix) + d for d in depth]
        out.append(Req(prefix + pos, pos, tree_visibility(len(prefix), parents)))
    return out


def _kernels():
    pytest.importorskip("triton")
    from swafactory.kernels.triton.decode import decode_attention
    from swafactory.kernels.triton.extend import extend_attention

    return decode_attention, extend_attention


@pytest.mark.parametrize("window", [None, 8])
def test_reference_reads_fp8_with_its_scales(window) -> None:
    batch = make_batch(_reqs(3, 20, 4), hq=8, hkv=2, d=16)
    _check(attention_reference, batch, window=window)


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("sinks", [False, True])
def test_triton_decode_reads_fp8(splits, sinks) -> None:
    decode, _ = _kernels()
    batch = make_batch(_reqs(3, 20, 1), hq=8, hkv=2, d=16, page_size=4)
    sk = torch.randn(8) if sinks else None
    _check(decode, batch, window=8, sinks=sk, num_splits=splits)


@pytest.mark.parametrize("tree", [False, True])
def test_triton_extend_reads_fp8(tree) -> None:
    _, extend = _kernels()
    batch = make_batch(_reqs(2, 24, 4, tree=tree), hq=8, hkv=2, d=16, with_mask=tree)
    _check(extend, batch, window=16, max_q_len=4)


def test_a_dropped_scale_is_far_outside_the_tolerance() -> None:
    """The check above can fail: the same kernel told the scales are 1 misses the oracle."""
    batch = make_batch(_reqs(2, 12, 1), hq=4, hkv=1, d=16)
    stored, logical = _fp8(batch)
    scale = 16 ** -0.5
    o, _ = attention_reference(*stored.args(), **stored.masks(), scale=scale)  # scales dropped
    want = oracle_outputs(logical, window=None, scale=scale)
    assert (o.float() - want).abs().max() > 1.0


@pytest.mark.gpu
@pytest.mark.parametrize("d,hq,hkv", [(64, 64, 8), (256, 32, 16), (512, 32, 4)])
@pytest.mark.parametrize("q_len", [1, 8])
def test_triton_fp8_at_model_geometries_on_the_gpu(d, hq, hkv, q_len) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    decode, extend = _kernels()
    batch = make_batch(_reqs(4, 700, q_len), hq=hq, hkv=hkv, d=d, device="cuda")
    fn = decode if q_len == 1 else extend
    kw = {} if q_len == 1 else {"max_q_len": q_len}
    _check(fn, batch, window=None if d == 512 else 128, **kw)
