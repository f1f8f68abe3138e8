"""Builders of kernel-contract batches over a paged pool, and the per-request oracle check.

A batch is a list of requests, each given by its keys' positions (logical order), its queries'
positions and an optional structure ([nq, nk] bool; None = causal). The pool is paged: every
request takes whole pages from a shuffled page list (page 0, the dummy, is never handed out),
slot = page * page_size + offset. Every row that no request owns, row 0 included, is NaN, so
a stray read shows up as NaN instead of a plausible number.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from swafactory.harness.oracle import oracle_attention

__all__ = ["Req", "Batch", "make_batch", "oracle_outputs", "tree_parents", "depths", "tol"]


@dataclass
class Req:
    kv_pos: list[int]
    q_pos: list[int]
    structure: torch.Tensor | None = None  # [nq, nk] bool; None = causal by position


@dataclass
class Batch:
    q: torch.Tensor
    k_buf: torch.Tensor
    v_buf: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    q_pos: torch.Tensor
    kv_pos: torch.Tensor
    mask: torch.Tensor | None
    mask_indptr: torch.Tensor | None
    reqs: list[Req]

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.q, self.k_buf, self.v_buf, self.qo_indptr, self.kv_indptr, self.kv_indices,
                self.q_pos, self.kv_pos)

    def masks(self) -> dict:
        return {"mask": self.mask, "mask_indptr": self.mask_indptr}


def _indptr(lens: list[int], device) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def make_batch(reqs: list[Req], *, hq: int, hkv: int, d: int, dtype=torch.float32,
               page_size: int = 1, seed: int = 0, device="cpu", with_mask: bool | None = None,
               index_dtype=torch.int32) -> Batch:
    """Random q/K/V for ``reqs`` in a shuffled paged pool; ``with_mask`` forces a flat mask
    (causal blocks written out) even where every structure is None."""
    rng = random.Random(seed)
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    # on a GPU the pool is drawn there in its dtype (GBs at real shapes); on CPU in fp32, then cast
    rdt = torch.float32 if dev.type == "cpu" else dtype
    need = [math.ceil(len(r.kv_pos) / page_size) for r in reqs]
    n_pages = sum(need) + 3
    pages = list(range(1, n_pages))
    rng.shuffle(pages)
    rows = n_pages * page_size
    k_buf = torch.randn(rows, hkv, d, generator=gen, device=dev, dtype=rdt)
    v_buf = torch.randn(rows, hkv, d, generator=gen, device=dev, dtype=rdt)
    owned = torch.zeros(rows, dtype=torch.bool)
    indices, it = [], iter(pages)
    for r, npg in zip(reqs, need):
        slots = [p * page_size + o for p in [next(it) for _ in range(npg)] for o in range(page_size)]
        slots = slots[:len(r.kv_pos)]
        owned[slots] = True
        indices += slots
    owned = owned.to(dev)
    k_buf[~owned] = math.nan
    v_buf[~owned] = math.nan
    total_q = sum(len(r.q_pos) for r in reqs)
    q = torch.randn(total_q, hq, d, generator=gen, device=dev, dtype=rdt)
    use_mask = with_mask if with_mask is not None else any(r.structure is not None for r in reqs)
    mask = mask_indptr = None
    if use_mask:
        blocks = [r.structure if r.structure is not None else
                  torch.tensor(r.kv_pos)[None, :] <= torch.tensor(r.q_pos)[:, None] for r in reqs]
        mask = torch.cat([b.reshape(-1) for b in blocks]).to(device)
        mask_indptr = _indptr([b.numel() for b in blocks], device)
    return Batch(
        q=q.to(device, dtype), k_buf=k_buf.to(device, dtype), v_buf=v_buf.to(device, dtype),
        qo_indptr=_indptr([len(r.q_pos) for r in reqs], device),
        kv_indptr=_indptr([len(r.kv_pos) for r in reqs], device),
        kv_indices=torch.tensor(indices, dtype=index_dtype, device=device),
        q_pos=torch.tensor([p for r in reqs for p in r.q_pos], dtype=torch.int32, device=device),
        kv_pos=torch.tensor([p for r in reqs for p in r.kv_pos], dtype=torch.int32, device=device),
        mask=mask, mask_indptr=mask_indptr, reqs=reqs)


def oracle_outputs(batch: Batch, *, window, scale, softcap=None, sinks=None) -> torch.Tensor:
    """The fp32 oracle per request, on its logical K/V gathered from the pool by hand."""
    outs = []
    qo, kv = batch.qo_indptr.tolist(), batch.kv_indptr.tolist()
    for i, r in enumerate(batch.reqs):
        rows = batch.kv_indices[kv[i]:kv[i + 1]].long()
        qp = torch.tensor(r.q_pos)
        kp = torch.tensor(r.kv_pos)
        st = r.structure if r.structure is not None else kp[None, :] <= qp[:, None]
        outs.append(oracle_attention(batch.q[qo[i]:qo[i + 1]].cpu(), batch.k_buf[rows].cpu(),
                                     batch.v_buf[rows].cpu(), qp, kp, st, window=window,
                                     scale=scale, softcap=softcap,
                                     sinks=None if sinks is None else sinks.cpu()))
    return torch.cat(outs)


def tree_parents(topk: int, depth: int, seed: int) -> list[int]:
    """An EAGLE-style draft tree: ``topk`` nodes per depth, each a child of a random node of the
    previous depth (depth 1: children of the prefix, parent -1). Nodes listed depth by depth."""
    rng = random.Random(seed)
    parents: list[int] = []
    prev: list[int] = [-1]
    for _ in range(depth):
        start = len(parents)
        parents += [rng.choice(prev) for _ in range(topk)]
        prev = list(range(start, len(parents)))
    return parents


def depths(parents: list[int]) -> list[int]:
    """Depth of each node, 0 for children of the prefix (so node i sits at prefix_len + depth)."""
    out: list[int] = []
    for p in parents:
        out.append(0 if p == -1 else out[p] + 1)
    return out


def tol(dtype: torch.dtype) -> dict:
    """assert_close tolerances by dtype; NaN never passes (equal_nan=False)."""
    return {torch.float32: dict(rtol=2e-4, atol=2e-4), torch.float16: dict(rtol=5e-3, atol=5e-3),
            torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}[dtype] | {"equal_nan": False}


def assert_graph_replays_equal(call, want: torch.Tensor, replays: int = 2) -> None:
    """Captures ``call`` (→ a tensor) in a CUDA graph and replays it ``replays`` times, the
    output zeroed before each: every replay must equal ``want`` bit for bit."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = call()
    for _ in range(replays):
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, want, rtol=0, atol=0)
