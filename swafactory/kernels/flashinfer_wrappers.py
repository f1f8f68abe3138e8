"""FlashInfer pass planning: one pass's tables → a `Pass`, and its wrapper made and planned.

The host half of `flashinfer.Adapter` (a mixin: it shares the adapter's state). For one pass of
one layer group it chooses the kernel (decode, causal prefill or masked prefill), converts the
planner's tables to FlashInfer's (int32 indices, the pool's pages where P > 1, a packed mask),
pads them to a CUDA-graph bucket's fixed shapes, and runs ``wrapper.plan`` once per forward.

Tensors: ``qo_host`` / ``kv_host`` int64 [B + 1] host indptrs; ``indices`` int32 [keys] pool
rows (or page ids when P > 1); ``last`` int32 [B] last-page lengths; ``mask`` uint8 packed bits
with ``mask_off`` int64 [B + 1] their offsets (`flashinfer_tables`).
"""
from __future__ import annotations

import torch

from swafactory.kernels import flashinfer_replan as replan
from swafactory.kernels.flashinfer_passes import (Pass, Signature, graph_buffers, pad_to_bucket,
                                                  prefill_backend)
from swafactory.kernels.flashinfer_tables import packed_custom_mask, page_table
from swafactory.window import flashinfer_window_left

__all__ = ["WORKSPACE_BYTES", "WrapperPlanning"]

# Split-KV partials of one prefill pass: a 256-token chunk of Gemma 4's full layers (32 q heads ×
# 512) needed 138 MB on the H200, past FlashInfer's usual 128 MB, so take 512 MB once.
WORKSPACE_BYTES = 512 * 1024 * 1024


class WrapperPlanning:
    """`Adapter`'s pass preparation and wrapper planning; the state (``_page``, ``_ones``,
    ``_wrappers``, ``_staging``, …) is the adapter's, set in its ``__init__``."""

    def _prepare(self, key: str, role: str, t, window: int | None,
                 graph: tuple[int, int] | None) -> Pass:
        qo_host, kv_host = t.qo_host, t.kv_host
        B = qo_host.numel() - 1
        # a graph's kernel is fixed at capture by the bucket alone: decode for 1-token buckets
        decode = t.mask is None and t.max_q_len == 1 if graph is None else graph[1] == 1
        if decode and t.mask is not None:
            raise ValueError("a 1-token graph bucket runs FlashInfer's decode kernel, which takes "
                             "no structure mask: capture tokens >= 2 for masked batches")
        indices = (t.kv_indices_i32 if t.kv_indices_i32 is not None  # the planner's int32 rows
                   else t.kv_indices.tensor.to(torch.int32))
        # Plain chunks (keys: consecutive positions ending at the last query) run FlashInfer's
        # own causal rule and window, exact there; only trees and blocks need a mask, whose
        # bits (q_len · kv_len of them) a long chunk could not afford. A graph bucket's kernel
        # is fixed at capture, before it knows what it will replay: causal where the spec makes
        # only chains (a chain spec's verify and draft extend), else the mask.
        causal = not decode and (t.natural if graph is None else self._chain_bucket())
        if graph is not None and causal and not t.natural and not self._capturing:
            raise ValueError(f"graph bucket {graph} was captured causal for plain chains (the "
                             "spec makes no trees), but this batch is not one (a tree, a block "
                             "or prefix-only queries): run it eagerly, or capture with a tree "
                             "spec")
        mask = mask_off = None
        if not decode and not causal:
            mask, mask_off = packed_custom_mask(t, window, "bit_offsets" if graph is None
                                                else "dense")
        if graph is not None:
            if B > graph[0] or t.max_q_len > graph[1]:
                raise ValueError(f"a graph bucket of {graph[0]} requests × {graph[1]} queries "
                                 f"cannot hold {B} requests of up to {t.max_q_len} queries")
            qo_host, kv_host, indices, mask, mask_off = pad_to_bucket(
                graph, causal, qo_host, kv_host, indices, mask, mask_off)
        kv_dev = None
        if self._page == 1:
            last = self._last(qo_host.numel() - 1)
            if decode and graph is None:
                kv_dev = t.kv_indptr
        else:  # the pool's own pages (padding requests: the dummy page 0, one key)
            kv_host, indices, last = page_table(kv_host, indices, self._page)
        tokens = t.max_q_len if graph is None else graph[1]
        return Pass(key, role, window, decode, qo_host, kv_host, indices, last, mask, mask_off,
                    graph=graph, page=self._page, kv_dev=kv_dev, causal=causal,
                    backend=prefill_backend(causal, tokens))

    def _keys(self, window: int | None, tokens: int) -> int:
        """Most keys one request of a graph bucket reads (`graph_keys`, else the largest
        sub-pool's rows)."""
        return self._max_rows if self.graph_keys is None else self.graph_keys(window, tokens)

    def _chain_bucket(self) -> bool:
        """Whether this forward's graph bucket holds plain chains (captured causal)."""
        return self.graph_chains and self._mode in ("target_verify", "draft_extend")

    def _last(self, n: int) -> torch.Tensor:
        if self._ones.numel() < n:
            ones = torch.ones(max(n, 2 * self._ones.numel()), dtype=torch.int32)
            self._ones = ones.pin_memory() if torch.cuda.is_available() else ones
        return self._ones[:n]

    def _wrapper(self, p: Pass, device: torch.device):
        import flashinfer

        if self._workspace is None or self._workspace.device != device:
            self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            self._wrappers.clear()
            self._mask_off.clear()
            self._graph_bufs.clear()
        k = p.key
        if k in self._wrappers:
            return self._wrappers[k]
        kw = {}
        if p.graph is not None:  # fixed buffers, sized for the bucket's worst case: what a
            # request of it can read, never the pool's rows (a 1M-row pool made bucket 64's
            # indices 256 MB each)
            kw = graph_buffers(p, self._keys(p.window, p.graph[1]), self._page, device)
            if "mask_indptr_buf" in kw:
                self._mask_off[k] = kw["mask_indptr_buf"]
        if p.decode:  # tensor cores: the fast path for GQA, and the one that serves D = 512
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD",
                                                              use_tensor_cores=True, **kw)
        else:
            w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD",
                                                               backend=p.backend, **kw)
        self._wrappers[k] = w
        if p.graph is not None:
            self._graph_bufs[k] = [b for b in kw.values() if isinstance(b, torch.Tensor)]
        return w

    def _plan_wrapper(self, p: Pass, sig: Signature, device: torch.device) -> None:
        hq, hkv, d, q_dtype, kv_dtype, scale, softcap = sig
        w = self._wrapper(p, device)
        common = dict(q_data_type=q_dtype, kv_data_type=kv_dtype, sm_scale=scale,
                      logits_soft_cap=softcap)
        wkey = p.key
        fast = p.kv_dev is not None and replan.fast_decode_plan() is not None
        self._staging.begin(w, device)  # a host that runs ahead never rewrites a queued copy
        if fast and self._full_plan.get(wkey) == (w, sig):
            # FlashInfer's own fast path (sglang plans its decode steps with it): the same
            # scheduler, without plan()'s Python max() over the host lengths (one item() per
            # request), its dtype resolution and its host-to-device copies; the kernel reads the
            # planner's device indptr and indices. It keeps the module and dtypes of the
            # wrapper's last full plan, whose signature this one equals.
            # Where the wrapper has FlashInfer 0.6's internals, its scheduler call alone.
            self._replan(w, p.kv_dev, p.indices, p.kv_host, sig, flashinfer_window_left(p.window))
            self.fast_plans += 1
        elif p.decode:
            w.plan(p.kv_host, p.indices, p.last, hq, hkv, d, p.page,
                   window_left=flashinfer_window_left(p.window), **common)
        elif p.causal:  # keys end at the last query: FlashInfer's window and causality are exact
            w.plan(p.qo_host, p.kv_host, p.indices, p.last, hq, hkv, d, p.page, causal=True,
                   window_left=flashinfer_window_left(p.window), **common)
        else:  # the window is inside the mask: FlashInfer's own would count from kv_len - q_len
            w.plan(p.qo_host, p.kv_host, p.indices, p.last, hq, hkv, d, p.page,
                   packed_custom_mask=p.mask, window_left=-1, **common)
            if p.graph is not None:  # its plan wrote bit offsets: the kernel reads byte offsets
                off = self._mask_off[p.key]
                off.copy_(p.mask_off.pin_memory() if off.is_cuda else p.mask_off,
                          non_blocking=True)
        self._staging.end(device)
        if p.decode:
            self._full_plan[wkey] = (w, sig)
        p.wrapper, p.planned_for = w, sig
