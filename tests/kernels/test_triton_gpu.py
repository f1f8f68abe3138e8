"""Triton kernels on a GPU at real shapes, bf16, against ``reference.py`` (fp32 on the same GPU).

Geometries: Gemma 4 SWA layers (32 q / 16 KV heads × 256, W = 1024) and full layers (32 q / 4 KV
heads × 512); GPT-OSS (64 q / 8 KV heads × 64, sinks, W = 128). Batches up to 64 requests with
contexts up to 8K; unowned pool rows are NaN, so any stray read fails the NaN check.
Run: ``TRITON_INTERPRET=0 pytest -m gpu tests/kernels``.
"""
from __future__ import annotations

import random

import pytest
import torch

from kernel_batches import Req, depths, make_batch, tol, tree_parents
from swafactory.harness.oracle import tree_visibility
from swafactory.kernels.torch_ref import attention_reference, merge_state

pytestmark = pytest.mark.gpu
triton = pytest.importorskip("triton")

GEOMS = {  # name: (Hq, Hkv, D, window, sinks)
    "gemma4_swa": (32, 16, 256, 1024, False),
    "gemma4_full": (32, 4, 512, None, False),
    "gptoss_swa": (64, 8, 64, 128, True),
    "gptoss_full": (64, 8, 64, None, True),
}


def _lens(bs: int, top: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [top] + [rng.randint(1, top) for _ in range(bs - 1)]  # one request at the full context


def _compare(fn, batch, window, sinks, **kw):
    scale = batch.q.shape[-1] ** -0.5
    o, lse = fn(*batch.args(), **batch.masks(), window=window, scale=scale, sinks=sinks, **kw)
    torch.cuda.synchronize()
    ro, rl = attention_reference(*batch.args(), **batch.masks(), window=window, scale=scale,
                                 sinks=sinks)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(o.float(), ro.float(), **tol(torch.bfloat16))
    torch.testing.assert_close(lse, rl, rtol=1e-3, atol=1e-3, equal_nan=False)
    return o, lse


def _sinks(hq: int, on: bool):
    return torch.randn(hq, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) if on else None


@pytest.mark.parametrize("trim", [False, True])
@pytest.mark.parametrize("geom", list(GEOMS))
def test_decode_real_shapes(geom, trim):
    from swafactory.kernels.triton.decode import decode_attention

    hq, hkv, d, window, with_sinks = GEOMS[geom]
    bs, ctx = (64, 8192) if d <= 256 else (32, 8192)
    reqs = []
    for n in _lens(bs, ctx, seed=hkv):
        first = max(0, n - window) if (trim and window) else 0
        reqs.append(Req(kv_pos=list(range(first, n)), q_pos=[n - 1]))
    batch = make_batch(reqs, hq=hq, hkv=hkv, d=d, dtype=torch.bfloat16, page_size=16,
                       device="cuda", seed=1)
    _compare(decode_attention, batch, window, _sinks(hq, with_sinks))


@pytest.mark.parametrize("geom", list(GEOMS))
def test_chain_verify_8_tokens(geom):
    from swafactory.kernels.triton.extend import extend_attention

    hq, hkv, d, window, with_sinks = GEOMS[geom]
    reqs = [Req(kv_pos=list(range(n + 8)), q_pos=list(range(n, n + 8)))
            for n in _lens(16, 4096, seed=d)]
    batch = make_batch(reqs, hq=hq, hkv=hkv, d=d, dtype=torch.bfloat16, page_size=1,
                       device="cuda", seed=2)
    _compare(extend_attention, batch, window, _sinks(hq, with_sinks), max_q_len=8)


@pytest.mark.parametrize("topk", [2, 4])
@pytest.mark.parametrize("geom", ["gemma4_swa", "gemma4_full", "gptoss_swa"])
def test_tree_verify_and_cascade(geom, topk):
    from swafactory.kernels.triton.extend import extend_attention
    from swafactory.kernels.triton.merge import merge_attention_states

    hq, hkv, d, window, with_sinks = GEOMS[geom]
    sinks = _sinks(hq, with_sinks)
    prefixes = _lens(8, 2048, seed=topk)
    trees = [tree_parents(topk, 4, seed=i) for i in range(len(prefixes))]
    reqs = []
    for n, parents in zip(prefixes, trees):
        pos = [n + x for x in depths(parents)]
        reqs.append(Req(kv_pos=list(range(n)) + pos, q_pos=pos, structure=tree_visibility(n, parents)))
    batch = make_batch(reqs, hq=hq, hkv=hkv, d=d, dtype=torch.bfloat16, page_size=16,
                       device="cuda", seed=3)
    o_full, lse_full = _compare(extend_attention, batch, window, sinks)
    # cascade on the same rows: prefix pass (causal, no mask) + expand pass (tree) + merge
    kv = batch.kv_indices
    cut = [sum(prefixes[:i]) + i * len(trees[0]) for i in range(len(prefixes) + 1)]
    pre_idx = torch.cat([kv[cut[i]:cut[i] + prefixes[i]] for i in range(len(prefixes))])
    exp_idx = torch.cat([kv[cut[i] + prefixes[i]:cut[i + 1]] for i in range(len(prefixes))])
    pre = make_batch([Req(kv_pos=list(range(n)), q_pos=r.q_pos) for n, r in zip(prefixes, reqs)],
                     hq=hq, hkv=hkv, d=16, device="cuda")
    exp = make_batch([Req(kv_pos=r.q_pos, q_pos=r.q_pos, structure=tree_visibility(0, p))
                      for r, p in zip(reqs, trees)], hq=hq, hkv=hkv, d=16, device="cuda")
    scale = d ** -0.5
    o1, l1 = extend_attention(batch.q, batch.k_buf, batch.v_buf, pre.qo_indptr, pre.kv_indptr,
                              pre_idx, batch.q_pos, pre.kv_pos, window=window, scale=scale)
    o2, l2 = extend_attention(batch.q, batch.k_buf, batch.v_buf, exp.qo_indptr, exp.kv_indptr,
                              exp_idx, batch.q_pos, exp.kv_pos, **exp.masks(), window=window,
                              scale=scale)
    o, lse = merge_attention_states(o1, l1, o2, l2, sinks=sinks)
    torch.testing.assert_close(o.float(), o_full.float(), **tol(torch.bfloat16))
    torch.testing.assert_close(lse, lse_full, rtol=1e-3, atol=1e-3)
    ro, rl = merge_state(o1, l1, o2, l2, sinks=sinks)
    torch.testing.assert_close(o.float(), ro.float(), **tol(torch.bfloat16))


@pytest.mark.parametrize("geom", ["gemma4_swa", "gptoss_full"])
def test_prefill_with_a_cached_prefix(geom):
    from swafactory.kernels.triton.extend import extend_attention

    hq, hkv, d, window, with_sinks = GEOMS[geom]
    reqs = [Req(kv_pos=list(range(n)), q_pos=list(range(n - m, n)))
            for n, m in [(3000, 1000), (1500, 1500), (777, 13), (2048, 511)]]
    batch = make_batch(reqs, hq=hq, hkv=hkv, d=d, dtype=torch.bfloat16, page_size=16,
                       device="cuda", seed=4)
    _compare(extend_attention, batch, window, _sinks(hq, with_sinks))


@pytest.mark.parametrize("geom", ["gemma4_swa", "gemma4_full"])
def test_verify_with_holes_in_the_prefix_and_shuffled_positions(geom):
    # the dense run (keys every query sees) is cut by holes in the structure, by the window edge
    # and by out-of-order positions: the rest must take the general tiles, exactly
    from swafactory.kernels.triton.extend import extend_attention

    hq, hkv, d, window, with_sinks = GEOMS[geom]
    g = torch.Generator().manual_seed(5)
    reqs = []
    for i, n in enumerate(_lens(8, 3000, seed=7)):
        kv_pos = list(range(n + 8))
        if i % 2:
            head = torch.randperm(n, generator=g).tolist()
            kv_pos = [kv_pos[j] for j in head] + kv_pos[n:]
        st = torch.ones(8, n + 8, dtype=torch.bool)
        st[:, n:] = torch.tril(torch.ones(8, 8, dtype=torch.bool)) & (torch.rand(8, 8, generator=g) < 0.7)
        st[:, n:] |= torch.eye(8, dtype=torch.bool)
        for c in torch.randint(0, n, (4,), generator=g).tolist():
            st[torch.randint(0, 8, (1,), generator=g), c] = False
        reqs.append(Req(kv_pos=kv_pos, q_pos=list(range(n, n + 8)), structure=st))
    batch = make_batch(reqs, hq=hq, hkv=hkv, d=d, dtype=torch.bfloat16, page_size=1,
                       device="cuda", seed=6)
    _compare(extend_attention, batch, window, _sinks(hq, with_sinks), max_q_len=8)


def test_a_new_split_count_compiles_nothing():
    """The split count follows the batch; each count must not JIT its own kernel mid-serving
    (with a compiled count, a smoke run's steady steps took 0.5-1.5 s of compiles each)."""
    from swafactory.kernels.triton.decode import _kernel, decode_attention
    from swafactory.kernels.triton.merge import _kernels

    batch = make_batch([Req(list(range(300)), [299]) for _ in range(3)], hq=8, hkv=2, d=64,
                       dtype=torch.bfloat16, device="cuda")

    def variants():
        stage1, combine = _kernel(False), _kernels(False)[0]
        return sum(len(c[0]) for c in stage1.device_caches.values()), \
            sum(len(c[0]) for c in combine.device_caches.values())

    _compare(decode_attention, batch, None, None, num_splits=3)
    before = variants()
    for n in (5, 6, 7, 9, 11):
        _compare(decode_attention, batch, None, None, num_splits=n)
    assert variants() == before


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("bs", [3, 64])
def test_wide_verify_at_gemma4_full_layers_equals_the_reference_and_the_one_kernel_tile(
        bs, with_sinks):
    """The two-kernel path (`verify_wide`, opt-in) at bs 3 (splits) and 64, a tree mask, sinks,
    against the reference and the one-kernel tile; unowned rows are NaN, so a stray read of
    either kernel shows."""
    from swafactory.kernels.triton.extend import extend_attention

    hq, hkv, d = 32, 4, 512
    parents = tree_parents(2, 4, seed=bs)  # 8 nodes: 64 rows
    reqs = []
    for n in _lens(bs, 8192 if bs > 8 else 2048, seed=bs):
        pos = [n + dpt for dpt in depths(parents)]
        reqs.append(Req(kv_pos=list(range(n)) + pos, q_pos=pos,
                        structure=tree_visibility(n, parents)))
    batch = make_batch(reqs, hq=hq, hkv=hkv, d=d, dtype=torch.bfloat16, page_size=1,
                       device="cuda", seed=7)
    sinks = _sinks(hq, with_sinks)
    o, lse = _compare(extend_attention, batch, None, sinks, max_q_len=len(parents), wide=True)
    o1, _ = extend_attention(*batch.args(), **batch.masks(), window=None, scale=d ** -0.5,
                             sinks=sinks, max_q_len=len(parents))
    torch.testing.assert_close(o.float(), o1.float(), **tol(torch.bfloat16))
