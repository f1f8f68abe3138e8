"""A CPU stand-in for the two FlashInfer wrappers the adapter uses, with FlashInfer's semantics.

It reproduces exactly what the adapter has to get right, so the adapter's plumbing (masks,
windows, index lists, the base-2 LSE, sinks, cascade) is tested on machines without a GPU:

* paged NHD caches ``[pages, page_size, Hkv, D]`` read through page ``indices`` and
  ``last_page_len`` (a request's keys: its pages' slots in order, ``(n - 1) · page_size + last``
  of them); the cache's page size must be the planned one, and every run records it in
  ``runs`` (a test can tell a page-size-1 view of a paged pool);
* ``window_left`` counted from ``kv_len - q_len + i`` (query i's *list* position, not its token
  position): the reason the adapter puts windows into the custom mask for tree and block passes;
* a prefill plan's ``causal=True`` (with no mask): query i sees list keys ``j <= kv_len - q_len +
  i``, from the same origin as the window (a padding row with fewer keys than queries sees none
  for its first rows: o = 0, lse = -inf, as FlashInfer's kernels leave an empty row);
* a custom mask, flattened per request, row-major ``[q_len, kv_len]``; given packed
  (``packed_custom_mask``), 0.6.18's quirk: plan sets ``mask_indptr`` to the *bit* offsets
  ``sum q_len·kv_len`` while the kernel reads request b's bits from *byte* ``mask_indptr[b]``,
  and a CUDA-graph wrapper reads the ``mask_indptr_buf`` / ``custom_mask_buf`` it was given at
  run time (so whatever the caller writes there after plan counts);
* the LSE in base 2 (``m·log2e + log2 d``, as FlashInfer's kernels write it);
* a decode wrapper's internals as FlashInfer 0.6 has them (``_cached_module.plan``, the
  workspaces, ``_backend`` resolved by ``plan``): after a re-plan by the scheduler call alone
  (`swafactory.kernels.flashinfer_replan`), ``run`` reads the tables and window from the
  buffers the caller pointed it at (``_Decode.internals = False`` removes them);
* ``decode.fast_decode_plan(wrapper, ...)``: re-plans a decode wrapper's tables, window, scale
  and soft-cap but keeps the dtypes (the kernel module) of its last ``plan``, which must have
  run; the host indptr comes from ``global_override_indptr_cpu`` (without it the real one reads
  the device indptr back).

The real kernels are checked against the oracle on the GPU (`test_flashinfer_vs_oracle.py`).
"""
from __future__ import annotations

import math
import types

import torch
from fake_softmax import attend

__all__ = ["module", "runs"]

runs: list[int] = []
"""The page size of every run's cache, in order."""


class _Wrapper:
    def __init__(self, workspace: torch.Tensor, layout: str = "NHD", **kw) -> None:
        assert layout == "NHD"
        self.decode = False
        self.plans = 0
        self.graph = kw.get("use_cuda_graph", False)
        self.backend = kw.get("backend", "auto")
        assert self.backend in ("auto", "fa2", "fa3"), self.backend
        self.mask_buf, self.mask_indptr_buf = kw.get("custom_mask_buf"), kw.get("mask_indptr_buf")
        self.packed = self.mask_indptr = None

    def _common(self, hq, hkv, d, page_size, window_left=-1, sm_scale=None,
                logits_soft_cap=None, q_data_type=None, kv_data_type=None, custom_mask=None,
                causal=False):
        assert hq % hkv == 0
        assert not (causal and self.decode), "the decode wrapper's plan takes no causal"
        self.causal = causal
        self.hq, self.hkv, self.d, self.page = hq, hkv, d, page_size
        self.window_left, self.scale = window_left, sm_scale or d ** -0.5
        self.softcap = logits_soft_cap or 0.0
        self.q_dtype, self.kv_dtype = q_data_type, kv_data_type
        self.mask = None if custom_mask is None else custom_mask.cpu().bool()
        self.plans += 1

    def run(self, q, paged_kv_cache, return_lse=False, k_scale=None, v_scale=None):
        k_cache, v_cache = paged_kv_cache
        assert q.dtype == self.q_dtype and k_cache.dtype == self.kv_dtype
        assert k_cache.shape[1] == self.page, (k_cache.shape, self.page)
        runs.append(self.page)
        k_cache, v_cache = k_cache.flatten(0, 1)[:, None], v_cache.flatten(0, 1)[:, None]
        # FlashInfer reads fp8 caches with the caller's scales (1.0 when none is given)
        ks, vs = (k_scale or 1.0), (v_scale or 1.0)
        qo = self.qo.tolist() if not self.decode else list(range(self.kv.numel()))
        kv = self.kv.tolist()  # per-request key rows from the pages
        o = torch.zeros(q.shape, dtype=torch.float32)
        lse = torch.full(q.shape[:2], -math.inf)
        mask_off = 0
        for b in range(len(kv) - 1):
            q0, q1, k0, k1 = qo[b], qo[b + 1], kv[b], kv[b + 1]
            nq, nk = q1 - q0, k1 - k0
            rows = self.rows[k0:k1]
            k = k_cache[rows, 0].float() * ks  # [nk, Hkv, D]
            v = v_cache[rows, 0].float() * vs
            i = torch.arange(nq)[:, None]
            j = torch.arange(nk)[None, :]
            ok = torch.ones(nq, nk, dtype=torch.bool)
            if self.mask is not None:
                ok = self.mask[mask_off:mask_off + nq * nk].view(nq, nk)
                mask_off += nq * nk
            elif self.packed is not None:  # bits from byte mask_indptr[b], read at run time
                e = torch.arange(nq * nk)
                byte = self.packed.cpu()[int(self.mask_indptr.cpu()[b]) + e // 8].long()
                ok = ((byte >> (e % 8)) & 1).bool().view(nq, nk)
            elif getattr(self, "causal", False):  # FlashInfer: from the list's end, like the window
                ok = j <= nk - nq + i
            if self.window_left >= 0:  # FlashInfer: relative to the query's index in the list
                ok = ok & (j + nq + self.window_left >= nk + i)
            o[q0:q1], m = attend(q[q0:q1], k, v, ok.expand(nq, nk), self.scale, self.softcap)
            lse[q0:q1] = (m / math.log(2.0)).T  # base 2
        o = o.to(q.dtype)
        return (o, lse) if return_lse else o


def _key_rows(indptr, indices, last, P: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's page table → (key offsets [B+1], key rows of the flattened cache)."""
    indptr, indices, last = indptr.cpu().long(), indices.cpu().long(), last.cpu().long()
    n = indptr[1:] - indptr[:-1]
    assert bool(((last >= 1) & (last <= P)).all()), last
    kv_len = torch.where(n > 0, (n - 1) * P + last, 0)
    rows = [(indices[indptr[b]:indptr[b + 1], None] * P + torch.arange(P)).reshape(-1)[:kv_len[b]]
            for b in range(n.numel())]
    off = torch.zeros(n.numel() + 1, dtype=torch.int64)
    off[1:] = torch.cumsum(kv_len, 0)
    return off, torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)


class _Module:
    """The compiled module's scheduler (``_cached_module.plan``) of a tensor-core decode
    wrapper: checks the arguments FlashInfer 0.6's fast_decode_plan gives it and returns a
    fresh plan-info marker."""

    def __init__(self, wrapper: "_Decode") -> None:
        self.w = wrapper
        self.calls = 0

    def plan(self, fws, iws, pinned, qo_host, kv_host, kv_lens, rows, b, hq, hkv, page, graph,
             dqk, dvo, causal, window_left, *fa2):
        w = self.w
        assert fws is w._float_workspace_buffer and iws is w._int_workspace_buffer
        assert pinned is w._pin_memory_int_workspace_buffer and not graph and not causal
        assert qo_host.device.type == kv_host.device.type == kv_lens.device.type == "cpu"
        assert torch.equal(qo_host, torch.arange(b + 1, dtype=torch.int32)) and rows == b
        lens = torch.clamp(kv_host[1:] - kv_host[:-1] - 1, min=0) + 1  # its get_seq_lens, page 1
        assert kv_lens.dtype == torch.int32 and torch.equal(kv_lens, lens), (kv_lens, lens)
        assert page == 1 and dqk == dvo == w.d and (hq, hkv) == (w.hq, w.hkv)
        assert fa2 == ((-1, False, 0, 0) if w._backend == "fa2" else ()), fa2
        self.calls += 1
        return ("plan", self.calls, kv_host.clone(), window_left)


class _Decode(_Wrapper):
    internals = True
    """Whether wrappers carry FlashInfer 0.6's internals (the adapter's `replan_decode`)."""

    def __init__(self, workspace, layout="NHD", use_tensor_cores=False, **kw) -> None:
        super().__init__(workspace, layout)
        self.decode = True
        self.fast = 0
        if self.internals:
            self.use_tensor_cores, self.is_cuda_graph_enabled = use_tensor_cores, self.graph
            self._float_workspace_buffer, self._int_workspace_buffer = workspace, object()
            self._pin_memory_int_workspace_buffer, self._backend = object(), "auto"
            self._cached_module, self._plan_info = _Module(self), None
        self._seen_info = None

    def plan(self, indptr, indices, last_page_len, hq, hkv, d, page_size, **kw) -> None:
        assert "custom_mask" not in kw
        self.kv, self.rows = _key_rows(indptr, indices, last_page_len, page_size)
        self._common(hq, hkv, d, page_size, **kw)
        if self.internals:
            self._backend = "fa2"  # resolved by plan, as FlashInfer's
            self._plan_info = self._seen_info = ("full", self.plans)

    def run(self, q, paged_kv_cache, return_lse=False, **kw):
        info = getattr(self, "_plan_info", None)
        if info is not self._seen_info:  # re-planned by its scheduler alone: read the buffers
            _, _, kv_host, window_left = info
            assert torch.equal(self._paged_kv_indptr_buf.cpu(), kv_host)
            assert torch.equal(self._qo_indptr_buf.cpu(), torch.arange(kv_host.numel(),
                                                                       dtype=torch.int32))
            assert self._window_left == window_left and self._q_len_per_req == 1
            self.kv, self.rows = _key_rows(kv_host, self._paged_kv_indices_buf,
                                           self._paged_kv_last_page_len_buf, 1)
            self.page, self.window_left = 1, window_left
            self.scale, self.softcap = self._sm_scale, self._logits_soft_cap
            self._seen_info = info
        return super().run(q, paged_kv_cache, return_lse=return_lse, **kw)


class _Prefill(_Wrapper):
    def plan(self, qo_indptr, kv_indptr, indices, last_page_len, hq, hkv, d, page_size,
             packed_custom_mask=None, **kw) -> None:
        self.qo = qo_indptr.cpu()
        self.kv, self.rows = _key_rows(kv_indptr, indices, last_page_len, page_size)
        self._common(hq, hkv, d, page_size, **kw)
        self.packed = None
        if packed_custom_mask is not None:
            # FlashInfer ignores causal beside a mask: a caller that passes both means neither
            assert not kw.get("causal"), "causal=True with a custom mask"
            assert "custom_mask" not in kw and packed_custom_mask.dtype == torch.uint8
            q = self.qo[1:] - self.qo[:-1]
            k = self.kv[1:] - self.kv[:-1]
            bits = torch.zeros(q.numel() + 1, dtype=torch.int32)
            bits[1:] = torch.cumsum(q * k, 0)  # _compute_page_mask_indptr: bit counts
            if self.graph:
                self.mask_buf[:packed_custom_mask.numel()].copy_(packed_custom_mask)
                self.mask_indptr_buf.copy_(bits)
                self.packed, self.mask_indptr = self.mask_buf, self.mask_indptr_buf
            else:
                self.packed, self.mask_indptr = packed_custom_mask, bits


def _fast_decode_plan(self, indptr, indices, last_page_len, hq, hkv, d, page_size,
                      window_left=-1, logits_soft_cap=None, q_data_type=None, kv_data_type=None,
                      sm_scale=None, non_blocking=True, global_override_indptr_cpu=None,
                      **kw) -> None:
    assert isinstance(self, _Decode) and self.plans >= 1, "fast_decode_plan needs a prior plan"
    assert global_override_indptr_cpu is not None, "without it FlashInfer reads indptr back"
    assert torch.equal(global_override_indptr_cpu.cpu(), indptr.cpu())
    assert hq % hkv == 0 and (hq, hkv, d) == (self.hq, self.hkv, self.d)
    self.kv, self.rows = _key_rows(global_override_indptr_cpu, indices, last_page_len, page_size)
    self.page, self.window_left = page_size, window_left
    self.scale, self.softcap = sm_scale or d ** -0.5, logits_soft_cap or 0.0
    self.fast += 1  # dtypes: the last plan's
    self._seen_info = getattr(self, "_plan_info", None)


def module() -> types.ModuleType:
    """A module object to install as ``sys.modules['flashinfer']``."""
    mod = types.ModuleType("flashinfer")
    mod.decode = types.ModuleType("flashinfer.decode")
    mod.decode.fast_decode_plan = _fast_decode_plan
    mod.BatchDecodeWithPagedKVCacheWrapper = _Decode
    mod.BatchPrefillWithPagedKVCacheWrapper = _Prefill
    mod.__version__ = "0.6.18.post1"  # the tested version (`kernels.flashinfer_check`)
    return mod
