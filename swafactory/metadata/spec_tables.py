"""`prepare_spec_page_table`: per-branch rows = a request's prefix row + the branch's draft slots.

Page-table kernels without a tree mask (flash-attn's cascade expand pass) read one row per draft
branch. Both inputs must already be in the index space of the pool the rows will index: this is
where sglang fed full-space tables to an SWA pool (FA3 + EAGLE3 topk > 1, #24402 → IMA), so an
untranslated table raises `SpaceError` here instead of reading the wrong rows.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Literal

import torch

from swafactory.errors import SpaceError
from swafactory.kvcache.locs import Locs

__all__ = ["prepare_spec_page_table"]


def _check_space(name: str, locs: Locs, pool: Any) -> None:
    if locs.space != pool.space or locs.pool_id != pool.indexed_by:
        hint = (" (translate the full slots with swafactory.kvcache.translate before building "
                "spec tables)" if pool.space == "swa" and locs.space == "full" else "")
        raise SpaceError(f"{name} table is in the {locs.space} space of {locs.pool_id!r}, but its "
                         f"rows will index {pool.pool_id!r} ({pool.space} space of "
                         f"{pool.indexed_by!r}){hint}")


def prepare_spec_page_table(prefix: Locs, prefix_lens: torch.Tensor, expand: Locs, topk: int,
                            pool: Any, *, impl: Literal["auto", "torch", "triton"] = "auto") -> Locs:
    """Concatenate each request's prefix row with each of its branches' draft entries.

    prefix: [B, max_prefix] slot or page ids; prefix_lens: [B] int (valid entries per row);
    expand: [B * topk, n_expand] ids of the same unit (branch j of request b at row b*topk + j);
    pool: the `KVPool` (sub-pool) the result will index. Returns [B * topk, max_prefix + n_expand]
    ids in the inputs' space and dtype: row b*topk + j = prefix[b, :len_b] ++ expand[b*topk + j]
    ++ 0 (the dummy slot).
    """
    _check_space("prefix", prefix, pool)
    _check_space("expand", expand, pool)
    if prefix.page_size != expand.page_size:
        raise SpaceError(f"prefix holds ids of page size {prefix.page_size}, expand of "
                         f"{expand.page_size}")
    p, e = prefix.tensor, expand.tensor
    if p.dim() != 2 or e.dim() != 2 or e.shape[0] != p.shape[0] * topk:
        raise ValueError(f"need prefix [B, P] and expand [B*topk, E]; got {list(p.shape)}, "
                         f"{list(e.shape)} with topk={topk}")
    lens = prefix_lens.to(device=p.device, dtype=torch.int64)
    use_triton = impl == "triton" or (impl == "auto" and p.is_cuda)
    out = _triton(p, lens, e, topk) if use_triton else _torch(p, lens, e, topk)
    return prefix._derive(out, prefix.page_size)


def _torch(p: torch.Tensor, lens: torch.Tensor, e: torch.Tensor, topk: int) -> torch.Tensor:
    rows, width = e.shape[0], p.shape[1] + e.shape[1]
    out = torch.zeros(rows, width, dtype=p.dtype, device=p.device)
    col = torch.arange(width, device=p.device)[None, :]
    plen = lens.repeat_interleave(topk)[:, None]
    src_p = p.repeat_interleave(topk, dim=0)
    in_prefix = col < plen
    out[:, : p.shape[1]] = torch.where(in_prefix[:, : p.shape[1]], src_p, out[:, : p.shape[1]])
    ecol = col - plen
    in_exp = (ecol >= 0) & (ecol < e.shape[1])
    gathered = torch.gather(e, 1, ecol.clamp(0, e.shape[1] - 1).expand(rows, width))
    return torch.where(in_exp, gathered.to(p.dtype), out)


@functools.cache
def _kernel(interpret: bool) -> Any:
    del interpret  # cache key: triton.jit reads TRITON_INTERPRET when decorating
    import triton
    import triton.language as tl

    @triton.jit
    def _concat(p_ptr, lens_ptr, e_ptr, out_ptr, p_width, e_width, width, TOPK: tl.constexpr,
                BLOCK: tl.constexpr):
        row = tl.program_id(0)
        req = row // TOPK
        plen = tl.load(lens_ptr + req)
        for start in range(0, width, BLOCK):
            col = start + tl.arange(0, BLOCK)
            live = col < width
            from_p = live & (col < plen)
            ecol = col - plen
            from_e = live & (ecol >= 0) & (ecol < e_width)
            pv = tl.load(p_ptr + req * p_width + col, mask=from_p, other=0)
            ev = tl.load(e_ptr + row * e_width + ecol, mask=from_e, other=0)
            tl.store(out_ptr + row * width + col, tl.where(from_p, pv, ev.to(pv.dtype)), mask=live)

    return _concat


def _triton(p: torch.Tensor, lens: torch.Tensor, e: torch.Tensor, topk: int) -> torch.Tensor:
    rows, width = e.shape[0], p.shape[1] + e.shape[1]
    out = torch.empty(rows, width, dtype=p.dtype, device=p.device)
    if rows:
        _kernel(os.environ.get("TRITON_INTERPRET", "0") == "1")[(rows,)](
            p.contiguous(), lens.contiguous(), e.to(p.dtype).contiguous(), out, p.shape[1],
            e.shape[1], width, TOPK=topk, BLOCK=128)
    return out
