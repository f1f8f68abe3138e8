"""Re-plan an eager FlashInfer tensor-core decode pass with only its scheduler call.

A decode step re-plans every group's wrapper. FlashInfer's ``fast_decode_plan`` (what sglang's
decode steps use) already skips ``plan``'s per-request ``max()`` and its index copies, but it
still copies a constant ``[B+1]`` query indptr from pageable memory to the device, rebuilds the
key lengths with three CPU tensor ops, makes two dtype-probe tensors and enters a device
context: about 40 µs of host time per group on the H200's host, once per group per step, while
the scheduler itself (the module's ``plan``) takes a few µs.

`replan_decode` makes only the scheduler call, with the same arguments ``fast_decode_plan``
gives it, and points the wrapper at this forward's device tables (the planner's indptr and
int32 rows, a cached all-ones last-page buffer, a cached query indptr). It keeps everything
``fast_decode_plan`` keeps from the wrapper's last full ``plan``, whose signature the caller
has checked is this one's. It reads FlashInfer 0.6's wrapper internals, so it first checks that
they are there (`supported`) and the adapter otherwise calls ``fast_decode_plan``.
"""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["supported", "replan_decode", "fast_decode_plan", "DecodeReplanner"]

_NEEDS = ("_cached_module", "_float_workspace_buffer", "_int_workspace_buffer",
          "_pin_memory_int_workspace_buffer", "_backend", "use_tensor_cores",
          "is_cuda_graph_enabled", "_plan_info")


def supported(wrapper) -> bool:
    """Whether ``wrapper`` (planned once in full) has the internals `replan_decode` sets: an
    eager tensor-core decode wrapper of FlashInfer 0.6 on its FA2/FA3 path."""
    return (all(hasattr(wrapper, a) for a in _NEEDS) and wrapper.use_tensor_cores
            and not wrapper.is_cuda_graph_enabled and wrapper._backend in ("fa2", "fa3"))


def fast_decode_plan():
    """FlashInfer's ``decode.fast_decode_plan`` (0.6.x, 0.7.x), or None where it has none."""
    import flashinfer

    return getattr(getattr(flashinfer, "decode", None), "fast_decode_plan", None)


class DecodeReplanner:
    """Re-plans eager decode passes at page size 1 (`replan_decode`, else FlashInfer's
    ``fast_decode_plan``) and holds what they share across passes and forwards, never written:
    ``[0, 1, …]`` int32 on the host and the device (a decode pass's query indptr) and int32
    ones on the device (its last-page lengths), each grown on demand and sliced per pass."""

    def __init__(self) -> None:
        self._ones: torch.Tensor | None = None
        self._range: tuple[torch.Tensor, torch.Tensor] | None = None
        self.direct = 0
        """Passes re-planned by `replan_decode` (the rest by ``fast_decode_plan``)."""

    def _grown(self, n: int, device: torch.device) -> None:
        if self._ones is None or self._ones.numel() < n or self._ones.device != device:
            size = max(n, 64, 2 * (0 if self._ones is None else self._ones.numel()))
            self._ones = torch.ones(size, dtype=torch.int32, device=device)
            host = torch.arange(size, dtype=torch.int32)  # pinned: copied without a host sync
            host = host.pin_memory() if device.type == "cuda" else host
            self._range = (host, host.to(device, non_blocking=True))

    def __call__(self, wrapper, kv_dev: torch.Tensor, indices: torch.Tensor,
                 kv_host: torch.Tensor, sig: tuple, window_left: int) -> None:
        """Re-plan ``wrapper`` for one pass: kv_dev / kv_host the [B+1] int32 key indptr on
        the device / host, indices the [total_kv] int32 rows on the device; sig the group's
        (q heads, KV heads, head_dim, q dtype, KV dtype, scale, soft-cap), the one of the
        wrapper's last full plan."""
        b = kv_host.numel() - 1
        self._grown(b + 1, kv_dev.device)
        last = self._ones[:b]
        hq, hkv, d, q_dtype, kv_dtype, scale, softcap = sig
        if supported(wrapper):
            qo = (self._range[0][:b + 1], self._range[1][:b + 1])
            replan_decode(wrapper, kv_dev, indices, last, kv_host, qo, hq, hkv, d, window_left,
                          scale, softcap)
            self.direct += 1
        else:
            fast_decode_plan()(wrapper, kv_dev, indices, last, hq, hkv, d, 1,
                               window_left=window_left, global_override_indptr_cpu=kv_host,
                               q_data_type=q_dtype, kv_data_type=kv_dtype, sm_scale=scale,
                               logits_soft_cap=softcap)


def replan_decode(wrapper, kv_dev: torch.Tensor, indices: torch.Tensor, last_dev: torch.Tensor,
                  kv_host: torch.Tensor, qo: tuple[torch.Tensor, torch.Tensor], hq: int,
                  hkv: int, head_dim: int, window_left: int, sm_scale: float,
                  softcap: float | None) -> None:
    """Plan one eager decode pass at page size 1 (``supported(wrapper)`` holds).

    kv_dev: [B+1] int32 key indptr on the device; indices: [total_kv] int32 rows on the device;
    last_dev: [B] int32 ones on the device; kv_host: [B+1] int32, the same indptr on the host;
    qo: ``[0, 1, …, B]`` int32 on the host and on the device.
    """
    b = kv_host.numel() - 1
    # key lengths from the host indptr as FlashInfer's get_seq_lens makes them at page size 1
    # with last-page lengths of 1: (pages - 1) + 1, and 1 for a request with no page
    h = kv_host.numpy()
    lens = torch.from_numpy(np.maximum(np.subtract(h[1:], h[:-1]), 1))
    args = [wrapper._float_workspace_buffer, wrapper._int_workspace_buffer,
            wrapper._pin_memory_int_workspace_buffer, qo[0], kv_host, lens, b, b, hq, hkv, 1,
            False, head_dim, head_dim, False, window_left]
    if wrapper._backend == "fa2":  # no fixed split, split-KV on, no co-located CTAs, 1 query
        args += [-1, False, 0, 0]
    dev = kv_dev.device  # the scheduler copies its plan on the current device's stream
    if dev.type == "cuda" and dev.index != torch.cuda.current_device():
        with torch.cuda.device(dev):
            wrapper._plan_info = wrapper._cached_module.plan(*args)
    else:
        wrapper._plan_info = wrapper._cached_module.plan(*args)
    wrapper._paged_kv_indptr_buf = kv_dev
    wrapper._paged_kv_indices_buf = indices
    wrapper._paged_kv_last_page_len_buf = last_dev
    wrapper._qo_indptr_buf = qo[1]
    wrapper._pos_encoding_mode = "NONE"
    wrapper._window_left = window_left
    wrapper._logits_soft_cap = 0.0 if softcap is None else softcap
    wrapper._sm_scale = sm_scale
    wrapper._rope_scale = wrapper._rope_theta = None
    wrapper._q_len_per_req = 1
