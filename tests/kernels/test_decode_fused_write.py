"""The decode kernel writing this step's K/V itself (``new_kv``), against the fp32 oracle and the
torch reference, in the Triton interpreter (and at GPT-OSS's geometry on the GPU).

Method as in test_triton_kernels.py: shuffled paged pools whose unowned rows (row 0 included)
are NaN, so a stray read shows. The fused write is checked by poisoning the new tokens' rows
before the call: the output can only be right if the new keys came from ``new_kv``, and the rows
must hold ``new_kv`` afterwards.
"""
from __future__ import annotations

import math

import pytest
import torch

from swafactory.kernels.torch_ref import attention_reference
from kernel_batches import Req, assert_graph_replays_equal, make_batch, oracle_outputs, tol

pytest.importorskip("triton")
from swafactory.kernels.triton.decode import decode_attention  # noqa: E402
from swafactory.kernels.triton.ops import paged_attention  # noqa: E402


def _reqs(lens, trim_to=None):
    return [Req(kv_pos=list(range(0 if trim_to is None else max(0, n - trim_to), n)),
                q_pos=[n - 1]) for n in lens]


def _run(batch, **kw):
    return decode_attention(*batch.args(), **kw)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_fused_decode_matches_oracle_and_reference(splits, window, with_sinks, softcap):
    # group 8 (GPT-OSS's); lengths across the window edge and the key tiles
    batch = make_batch(_reqs([1, 7, 8, 9, 40]), hq=16, hkv=2, d=16, seed=splits + 3)
    sinks = torch.randn(16, generator=torch.Generator().manual_seed(1)) * 2 if with_sinks else None
    last = batch.kv_indptr[1:].long() - 1
    slots = batch.kv_indices[last].long()
    new = (batch.k_buf[slots].clone(), batch.v_buf[slots].clone(), slots)
    want = oracle_outputs(batch, window=window, scale=0.3, softcap=softcap, sinks=sinks)
    ro, rl = attention_reference(*batch.args(), window=window, scale=0.3, softcap=softcap,
                                 sinks=sinks)
    batch.k_buf[slots] = math.nan
    o, lse = _run(batch, window=window, scale=0.3, softcap=softcap, sinks=sinks,
                  num_splits=splits, new_kv=new)
    torch.testing.assert_close(o, want, **tol(torch.float32))
    torch.testing.assert_close(lse, rl, **(tol(torch.float32) | {"equal_nan": True}))


@pytest.mark.parametrize("d,hq,hkv", [(256, 4, 2), (512, 8, 1)])
@pytest.mark.parametrize("splits", [1, 2])
def test_fused_decode_at_gemma_head_dims(d, hq, hkv, splits):
    # head_dim 512 takes the tail in the loop's MMA layouts (DOT_TAIL), 256 the broadcast sum
    batch = make_batch(_reqs([1, 33, 70]), hq=hq, hkv=hkv, d=d, seed=d + splits)
    last = batch.kv_indptr[1:].long() - 1
    slots = batch.kv_indices[last].long()
    new = (batch.k_buf[slots].clone(), batch.v_buf[slots].clone(), slots)
    want = oracle_outputs(batch, window=None, scale=0.05, softcap=3.0)
    batch.k_buf[slots] = math.nan  # the new rows can only come from new_kv
    batch.v_buf[slots] = math.nan
    o, _ = _run(batch, scale=0.05, softcap=3.0, num_splits=splits, new_kv=new)
    torch.testing.assert_close(o, want, **tol(torch.float32))
    assert torch.equal(batch.k_buf[slots], new[0]) and torch.equal(batch.v_buf[slots], new[1])


def test_fused_registers_cap_only_fused_eight_warp_launches(monkeypatch):
    import swafactory.kernels.triton.decode as dec

    monkeypatch.setattr(dec, "interpreting", lambda: False)
    assert dec.fused_registers(True, 8) == {"maxnreg": 128}  # two 256-thread CTAs an SM
    assert dec.fused_registers(False, 8) == {} and dec.fused_registers(True, 4) == {}
    monkeypatch.setattr(dec, "interpreting", lambda: True)
    assert dec.fused_registers(True, 8) == {}


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_write_stores_the_new_rows_and_attends_to_them_from_registers(splits, dtype):
    batch = make_batch(_reqs([1, 9, 30], trim_to=8), hq=8, hkv=4, d=32, seed=9, dtype=dtype,
                       page_size=4)
    last = batch.kv_indptr[1:].long() - 1
    slots = batch.kv_indices[last].long()
    kn, vn = batch.k_buf[slots].clone(), batch.v_buf[slots].clone()
    want = oracle_outputs(batch, window=8, scale=0.2)
    batch.k_buf[slots] = math.nan  # the pool holds no new row yet: reading one would show
    batch.v_buf[slots] = math.nan
    o, _ = _run(batch, window=8, scale=0.2, new_kv=(kn, vn, slots), dummy_rows=4,
                num_splits=splits)
    torch.testing.assert_close(o.float(), want, **tol(dtype))
    assert torch.equal(batch.k_buf[slots], kn) and torch.equal(batch.v_buf[slots], vn)


def test_padding_writes_to_the_dummy_page_are_dropped():
    # a graph's padding request: one key at the dummy row 0, position 0, writing row 0
    batch = make_batch([Req(kv_pos=[0, 1, 2], q_pos=[2]), Req(kv_pos=[0], q_pos=[0])],
                       hq=4, hkv=2, d=16, seed=2)
    batch.kv_indices[3] = 0
    batch.q_pos[1] = 0
    kn = torch.randn(2, 2, 16)
    vn = torch.randn(2, 2, 16)
    slots = torch.tensor([int(batch.kv_indices[2]), 0])
    o, _ = _run(batch, window=None, scale=0.25, new_kv=(kn, vn, slots), num_splits=2)
    assert torch.isnan(batch.k_buf[0]).all() and torch.isnan(batch.v_buf[0]).all()
    torch.testing.assert_close(o[1], vn[1].repeat_interleave(2, 0))  # its only key: its own
    assert torch.isfinite(o).all()


def test_paged_attention_stores_first_where_the_decode_kernel_does_not_serve():
    # an extend pass (two queries) with new_kv: stored before the kernel, the dummy page kept
    batch = make_batch([Req(kv_pos=list(range(6)), q_pos=[4, 5])], hq=4, hkv=2, d=16, seed=8)
    slots = batch.kv_indices[4:6].long()
    new = (batch.k_buf[slots].clone(), batch.v_buf[slots].clone(),
           torch.cat([slots[:1], torch.zeros(1, dtype=torch.long)]))  # the 2nd to the dummy
    want, _ = attention_reference(*batch.args(), window=None, scale=0.25)
    batch.k_buf[slots[0]] = math.nan
    o, _ = paged_attention(*batch.args(), window=None, scale=0.25, max_q_len=2, new_kv=new)
    torch.testing.assert_close(o, want, **tol(torch.float32))
    assert torch.isnan(batch.k_buf[0]).all()  # the dummy row kept its poison


def test_fused_write_refuses_fp8_pools_and_wrong_shapes():
    batch = make_batch(_reqs([4]), hq=4, hkv=2, d=16, seed=1)
    k8 = batch.k_buf.to(torch.float8_e4m3fn)
    slots = batch.kv_indices[3:4].long()
    with pytest.raises(ValueError, match="not fp8"):
        decode_attention(batch.q, k8, k8, *batch.args()[3:], scale=0.1,
                         new_kv=(k8[slots], k8[slots], slots))
    with pytest.raises(ValueError, match=r"new_kv must be \[1, 2, 16\]"):
        _run(batch, scale=0.1, new_kv=(batch.k_buf[:2], batch.v_buf[:2], slots))


@pytest.mark.gpu
@pytest.mark.parametrize("cuda", [False, None])  # the Triton kernel; the CUDA one where it serves
@pytest.mark.parametrize("bs", [3, 8])
@pytest.mark.parametrize("window", [None, 128])
def test_gpt_oss_geometry_on_the_gpu_fused_and_replayed_from_a_graph(bs, window, cuda):
    """GPT-OSS's layers (64 heads over 8 KV heads of 64, sinks) at 3000 keys: the fused kernel
    against fp32 attention over the logical history, then captured in a CUDA graph and replayed
    twice: the same output."""
    lens = [3000 - 37 * i for i in range(bs)]
    batch = make_batch(_reqs(lens, trim_to=window), hq=64, hkv=8, d=64, dtype=torch.bfloat16,
                       seed=bs, device="cuda")
    sinks = torch.randn(64, device="cuda")
    last = batch.kv_indptr[1:].long() - 1
    slots = batch.kv_indices[last].long()
    kn, vn = batch.k_buf[slots].clone(), batch.v_buf[slots].clone()
    want = oracle_outputs(batch, window=window, scale=0.125, sinks=sinks)
    batch.k_buf[slots] = math.nan
    batch.v_buf[slots] = math.nan

    def call():
        return _run(batch, window=window, scale=0.125, sinks=sinks, new_kv=(kn, vn, slots),
                    cuda=cuda)[0]

    o = call()
    torch.testing.assert_close(o.float().cpu(), want, **tol(torch.bfloat16))
    assert torch.equal(batch.k_buf[slots], kn)
    assert_graph_replays_equal(call, o)


@pytest.mark.gpu
@pytest.mark.parametrize("d,hkv,window", [(256, 16, 1024), (512, 4, None)])
def test_gemma4_geometry_on_the_gpu_fused(d, hkv, window):
    """Gemma 4's layers (32 heads; SWA: 16 KV heads of 256, W 1024; full: 4 of 512) at 2000
    keys, the fused kernel under its register cap against fp32 attention."""
    lens = [2000 - 129 * i for i in range(5)]
    batch = make_batch(_reqs(lens, trim_to=window), hq=32, hkv=hkv, d=d, dtype=torch.bfloat16,
                       seed=d, device="cuda")
    last = batch.kv_indptr[1:].long() - 1
    slots = batch.kv_indices[last].long()
    kn, vn = batch.k_buf[slots].clone(), batch.v_buf[slots].clone()
    want = oracle_outputs(batch, window=window, scale=1.0)
    batch.k_buf[slots] = math.nan
    batch.v_buf[slots] = math.nan
    o = _run(batch, window=window, scale=1.0, new_kv=(kn, vn, slots))[0]
    torch.testing.assert_close(o.float().cpu(), want, **tol(torch.bfloat16))
    assert torch.equal(batch.k_buf[slots], kn) and torch.equal(batch.v_buf[slots], vn)
