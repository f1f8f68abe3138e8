"""One entry point over the Triton kernels: decode when every request has one query and the
structure is causal, extend otherwise; the torch reference where Triton cannot run (CPU without
``TRITON_INTERPRET=1``). Every path takes and returns the same contract (``kernels/torch_ref.py``).
"""
from __future__ import annotations

import torch

from swafactory.kernels.triton.decode import decode_attention
from swafactory.kernels.triton.extend import extend_attention
from swafactory.kernels.triton.merge import interpreting
from swafactory.kernels.torch_ref import attention_reference

__all__ = ["paged_attention", "uses_decode", "store_keeping_dummy"]


def uses_decode(q: torch.Tensor, qo_indptr: torch.Tensor, mask: torch.Tensor | None,
                max_q_len: int | None) -> bool:
    """Whether the decode kernel serves the call: causal structure and qo_indptr = arange(B+1).

    With ``max_q_len`` given (the planner knows it), nothing is read from the device; without it
    the query counts are checked on qo_indptr (one sync on a GPU).
    """
    nb = qo_indptr.numel() - 1
    if mask is not None or q.shape[0] != nb:
        return False
    if max_q_len is not None:
        return max_q_len == 1
    return bool(((qo_indptr[1:] - qo_indptr[:-1]) == 1).all())


def paged_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                    qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                    q_pos: torch.Tensor, kv_pos: torch.Tensor, *, mask: torch.Tensor | None = None,
                    mask_indptr: torch.Tensor | None = None, window: int | None = None,
                    scale: float, softcap: float | None = None, sinks: torch.Tensor | None = None,
                    max_q_len: int | None = None, k_scale: float = 1.0,
                    v_scale: float = 1.0, new_kv: tuple | None = None,
                    dummy_rows: int = 1, num_splits: int | None = None,
                    skip_empty: bool | None = None,
                    cuda: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention under the kernel contract; returns (o [total_q, Hq, D] in q's dtype, lse
    [total_q, Hq] fp32). Shapes and dtypes as in ``kernels/torch_ref.py``; ``max_q_len`` is an optional
    host-side hint (the longest request's query count) that keeps the call free of device syncs.
    ``k_scale``/``v_scale``: an fp8 pool's layer scales (stored = K / k_scale).
    ``new_kv``: (k, v [total_q, Hkv, D] in the pool's dtype, slots [total_q] int64), this step's
    rows: the decode kernel writes them (`decode_attention`), other paths store them first;
    either way rows below ``dummy_rows`` (the dummy page, padding's target) keep their contents.
    ``num_splits``: the decode kernel's split count (default: planned from static sizes);
    ``skip_empty``: its tile skipping (`decode_attention`). ``cuda``: False keeps our CUDA
    kernels out (the pass's `backend.kernels` choice resolved to Triton); None lets them serve
    where a call's shapes fit.
    """
    kw = dict(mask=mask, mask_indptr=mask_indptr, window=window, scale=scale, softcap=softcap,
              sinks=sinks, k_scale=k_scale, v_scale=v_scale)
    args = (q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, q_pos, kv_pos)
    on_device = q.is_cuda or interpreting()
    if on_device and uses_decode(q, qo_indptr, mask, max_q_len):
        return decode_attention(*args, **kw, new_kv=new_kv, dummy_rows=dummy_rows,
                                num_splits=num_splits, skip_empty=skip_empty, cuda=cuda)
    if new_kv is not None:
        store_keeping_dummy(k_buf, v_buf, new_kv, dummy_rows)
    if not on_device:
        return attention_reference(*args, **kw)
    return extend_attention(*args, **kw, max_q_len=max_q_len, cuda=cuda)


def store_keeping_dummy(k_buf: torch.Tensor, v_buf: torch.Tensor, new_kv: tuple,
                        dummy_rows: int) -> None:
    """``index_copy_`` of new_kv = (k, v [n, Hkv, D], slots [n] int64) into the buffers, the
    first ``dummy_rows`` rows (the dummy page) left as they were, as the decode kernel leaves
    them."""
    k, v, slots = new_kv
    kept = k_buf[:dummy_rows].clone(), v_buf[:dummy_rows].clone()
    k_buf.index_copy_(0, slots, k)
    v_buf.index_copy_(0, slots, v)
    k_buf[:dummy_rows].copy_(kept[0])
    v_buf[:dummy_rows].copy_(kept[1])
