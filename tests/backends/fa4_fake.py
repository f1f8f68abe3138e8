"""A CPU stand-in for flash-attn-4's `flash_attn_varlen_func` and `_flash_attn_fwd` (the function
it wraps, which takes ``tile_mn``), with FA4 4.0.0b9's semantics and argument names.

What the adapter has to get right, reproduced so its plumbing is tested without a GPU:

* ``cu_seqlens_q`` varlen queries ``[total_q, Hq, D]``; keys either paged (``[pages, page_size,
  Hkv, D]`` read through an int32 ``page_table``: key j is slot j % page_size of page
  ``page_table[b, j // page_size]``) or batched ``[B, S, Hkv, D]``; ``seqused_k``
  per sequence; ``cu_seqlens_k`` refused beside a page table;
* causality and the window in *index* space, aligned bottom-right: query i sees key j iff
  ``i + sk - sq - left <= j <= i + sk - sq + right`` (None = unbounded, causal sets right = 0);
* the LSE as ``[Hq, total_q]`` in natural log;
* b9's SM90 paged-loader bug: head_dim > 128 with a page table raises the library's error;
* b9's TMA path (page size = tile_n, 128 for head_dim ≤ 128) loads whole pages: the rows of a
  request's last page past ``seqused_k`` are masked but multiplied by 0, so a NaN there is NaN;
* `_flash_attn_fwd` takes the window as ``window_size_left`` / ``window_size_right`` (no
  ``window_size``: a tuple passed there is a TypeError, as in b9) and ``tile_mn``, which only
  changes its tile_n here (the TMA rule above); each call's ``fn`` and ``tile_mn`` are recorded.

The real kernels are checked against the oracle on the GPU (`test_gpu_vs_oracle.py`).
"""
from __future__ import annotations

import math
import types

import torch
from fake_softmax import attend

__all__ = ["module", "calls"]

calls: list[dict] = []


def flash_attn_varlen_func(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                           max_seqlen_k=None, seqused_k=None, page_table=None, softmax_scale=None,
                           causal=False, window_size=(None, None), learnable_sink=None,
                           softcap=0.0, return_lse=False, **kw):
    assert not kw, f"unexpected arguments {sorted(kw)}"
    assert isinstance(window_size, tuple) and len(window_size) == 2
    return _attend("flash_attn_varlen_func", q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k,
                   page_table, softmax_scale, causal, window_size, softcap, return_lse, None)


def _flash_attn_fwd(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
                    seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None,
                    page_table=None, softmax_scale=None, causal=False, softcap=None,
                    window_size_left=None, window_size_right=None, learnable_sink=None,
                    tile_mn=None, mma_pv_is_rs=None, intra_wg_overlap=None, num_threads=384,
                    num_splits=1, pack_gqa=None, return_lse=False, out=None, lse=None):
    """b9's signature up to ``lse`` (its score/mask mods, block sparsity and gathers left out)."""
    assert qv is None and seqused_q is None and learnable_sink is None and out is None
    assert tile_mn is None or (isinstance(tile_mn, tuple) and len(tile_mn) == 2)
    return _attend("_flash_attn_fwd", q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table,
                   softmax_scale, causal, (window_size_left, window_size_right), softcap or 0.0,
                   return_lse, tile_mn)


def _attend(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table, softmax_scale, causal,
            window_size, softcap, return_lse, tile_mn):
    """Both entry points: attention in fp32, b9's index-space mask and TMA page loads."""
    assert cu_seqlens_q is not None and cu_seqlens_q.dtype == torch.int32
    assert seqused_k is not None and seqused_k.dtype == torch.int32
    calls.append(dict(fn=fn, tile_mn=tile_mn, causal=causal, window_size=window_size,
                      paged=page_table is not None,
                      page_size=k.shape[1] if page_table is not None else None,
                      return_lse=return_lse))
    d = q.shape[-1]
    if page_table is not None:
        assert cu_seqlens_k is None, "page_table is not supported with cu_seqlens_k"
        assert page_table.dtype == torch.int32 and k.dim() == 4
        assert page_table.stride(-1) == 1, "page_table must be contiguous in the last dimension"
        if d > 128:  # PagedKVManager: page_entry_per_thread = tile_n // 128 == 0
            raise ValueError("Expected size in shape to be strictly positive, but got 0")
    hq, hkv = q.shape[1], k.shape[-2]
    scale = softmax_scale or d ** -0.5
    left, right = window_size
    if causal:
        right = 0
    qo, used = cu_seqlens_q.tolist(), seqused_k.tolist()
    o = torch.zeros(q.shape, dtype=torch.float32)
    lse = torch.full((hq, q.shape[0]), -math.inf)
    for b in range(len(qo) - 1):
        q0, q1, sk = qo[b], qo[b + 1], used[b]
        sq = q1 - q0
        loaded = sk
        if page_table is not None:  # key j is slot j % P of page page_table[b, j // P]
            page = k.shape[1]
            if page == (tile_mn[1] if tile_mn else _tile_n(d)):  # TMA: whole pages, past sk too
                loaded = -(-sk // page) * page
            j = torch.arange(loaded)
            pages = page_table[b, j // page].long()
            kb, vb = k[pages, j % page].float(), v[pages, j % page].float()
        else:
            kb, vb = k[b, :sk].float(), v[b, :sk].float()
        i = torch.arange(sq)[:, None] + sk - sq
        j = torch.arange(loaded)[None, :]
        ok = (j < sk).expand(sq, loaded).clone()  # rows past sk: masked, weigh 0 (0·NaN = NaN)
        if right is not None:
            ok &= j <= i + right
        if left is not None:
            ok &= j >= i - left
        o[q0:q1], lse[:, q0:q1] = attend(q[q0:q1], kb, vb, ok, scale, softcap or 0.0)
    return o.to(q.dtype), (lse if return_lse else None)


def _tile_n(d: int) -> int:
    """b9's SM90 forward tile_n (`_tile_size_fwd_sm90`, causal): a page of this size takes the
    TMA path, which loads whole pages."""
    return 128 if d <= 128 else (96 if d <= 192 else 64)


def module() -> types.ModuleType:
    """A module object to install as ``sys.modules['flash_attn.cute.interface']``."""
    mod = types.ModuleType("flash_attn.cute.interface")
    mod.flash_attn_varlen_func = flash_attn_varlen_func
    mod._flash_attn_fwd = _flash_attn_fwd
    return mod
