"""Our CUDA verify tile (``kernels/cuda/verify_d512.cu``) on a GPU at Gemma 4's full-layer
geometry (32 q / 4 KV heads × 512), bf16, against the fp32 reference and the Triton tile.
Unowned pool rows are NaN, so a stray read shows. Run: ``pytest -m gpu tests/kernels``.
"""
from __future__ import annotations

import random

import pytest
import torch

from kernel_batches import Req, depths, make_batch, tol, tree_parents
from swafactory.harness.oracle import tree_visibility
from swafactory.kernels.torch_ref import attention_reference

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

HQ, HKV, D = 32, 4, 512


def _needs_tile():
    from swafactory.kernels.cuda.launch import cuda_kernels_available
    if not cuda_kernels_available(torch.device("cuda")):
        pytest.skip("the CUDA tile needs nvcc and a GPU of compute capability ≥ 8.0")


def _batch(bs: int, top: int, kind: str, seed: int):
    rng = random.Random(seed)
    lens = [top] + [rng.randint(1, top) for _ in range(bs - 1)]
    reqs = []
    g = torch.Generator().manual_seed(seed)
    for i, n in enumerate(lens):
        if kind == "chain":
            reqs.append(Req(kv_pos=list(range(n + 8)), q_pos=list(range(n, n + 8))))
        elif kind == "tree":
            parents = tree_parents(2, 4, seed=i)  # 8 nodes: 64 rows
            pos = [n + x for x in depths(parents)]
            reqs.append(Req(kv_pos=list(range(n)) + pos, q_pos=pos,
                            structure=tree_visibility(n, parents)))
        else:  # holes in the prefix cut the dense run; shuffled positions on odd requests
            kv_pos = list(range(n + 8))
            if i % 2:
                head = torch.randperm(n, generator=g).tolist()
                kv_pos = [kv_pos[j] for j in head] + kv_pos[n:]
            st = torch.ones(8, n + 8, dtype=torch.bool)
            st[:, n:] = torch.tril(torch.ones(8, 8, dtype=torch.bool))
            for c in torch.randint(0, n, (3,), generator=g).tolist():
                st[torch.randint(0, 8, (1,), generator=g), c] = False
            reqs.append(Req(kv_pos=kv_pos, q_pos=list(range(n, n + 8)), structure=st))
    return make_batch(reqs, hq=HQ, hkv=HKV, d=D, dtype=torch.bfloat16, page_size=1,
                      device="cuda", seed=seed)


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("kind,bs,top", [("chain", 64, 8192), ("chain", 3, 3000),
                                         ("tree", 16, 4096), ("holes", 8, 3000)])
def test_cuda_tile_equals_the_reference_and_the_triton_tile(kind, bs, top, with_sinks):
    from swafactory.kernels.triton.extend import extend_attention

    _needs_tile()
    batch = _batch(bs, top, kind, seed=bs)
    sinks = (torch.randn(HQ, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
             if with_sinks else None)
    kw = dict(**batch.masks(), window=None, scale=D ** -0.5, sinks=sinks, max_q_len=8)
    o, lse = extend_attention(*batch.args(), cuda=True, **kw)
    ot, lt = extend_attention(*batch.args(), cuda=False, **kw)
    ro, rl = attention_reference(*batch.args(), **{k: v for k, v in kw.items()
                                                   if k != "max_q_len"})
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(o.float(), ro.float(), **tol(torch.bfloat16))
    torch.testing.assert_close(lse, rl, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(o.float(), ot.float(), **tol(torch.bfloat16))
    # the default route takes the tile where it serves
    od, _ = extend_attention(*batch.args(), **kw)
    assert torch.equal(od, o)


def test_a_nan_in_the_dense_run_poisons_exactly_the_rows_the_triton_tile_poisons():
    from swafactory.kernels.triton.extend import extend_attention

    _needs_tile()
    batch = _batch(4, 2000, "chain", seed=11)
    kv0 = batch.kv_indptr[1].item()
    bad_row = batch.kv_indices[kv0 + 100].item()  # request 1's key 100: in its dense run
    batch.v_buf[bad_row, 2, 7] = float("nan")     # KV head 2, one column of one half
    kw = dict(**batch.masks(), window=None, scale=D ** -0.5, max_q_len=8)
    o, _ = extend_attention(*batch.args(), cuda=True, **kw)
    ot, _ = extend_attention(*batch.args(), cuda=False, **kw)
    assert torch.equal(torch.isnan(o), torch.isnan(ot))
    q0, q1 = batch.qo_indptr[1].item(), batch.qo_indptr[2].item()
    assert torch.isnan(o[q0:q1, 16:24]).all()     # every column of KV head 2's rows
    assert not torch.isnan(o[:q0]).any() and not torch.isnan(o[q1:]).any()


def test_the_tile_is_captured_and_replayed_in_a_cuda_graph():
    from swafactory.kernels.triton.extend import extend_attention

    _needs_tile()
    batch = _batch(8, 3000, "chain", seed=3)
    kw = dict(**batch.masks(), window=None, scale=D ** -0.5, max_q_len=8, cuda=True)
    want, _ = extend_attention(*batch.args(), **kw)  # builds and loads the kernel
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = extend_attention(*batch.args(), **kw)
    batch.q.mul_(0.5)
    want2, _ = extend_attention(*batch.args(), **kw)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want2) and not torch.equal(want, want2)
