"""FlashInfer: BatchDecode / BatchPrefill (custom mask) wrappers, one set per layer group.

Layout. Pool buffers ``[rows, Hkv, D]`` are FlashInfer's NHD paged cache with page size 1 once
viewed as ``[rows, 1, Hkv, D]``: ``kv_indices`` are our slot rows, ``last_page_len`` is all ones.
Whatever the pool's own page size, the planner's tables are a page-size-1 view of it.

Kernels. A forward whose requests all have one query and no structure mask (decode) runs the
tensor-core decode wrapper with ``window_left = W - 1``: the key list ends at the query's own
position, which is what FlashInfer's window is relative to, so that is exact. Every other forward
(extend, chain/tree verify, draft, DFlash block) runs the prefill wrapper with a host-built custom
mask ``structure & (q_pos - kv_pos < W)`` and ``window_left = -1``, because FlashInfer measures
its window from ``kv_len - q_len + i``, which is wrong for trimmed SWA lists and tree nodes at
``prefix + depth`` (DESIGN invariant 4).

Planning. `plan(forward_plan, pool)` (once per forward) does the host work: host indptrs, int32
indices, masks. The FlashInfer ``wrapper.plan`` call needs the query head count, dtypes, scale
and soft-cap, which only the first layer's `run` knows; it happens there, once per pass per
forward (all layers of a group share them), and again only if a later layer differs.

Sinks are served by an exact epilogue on the returned LSE (``o · σ(lse - sink)``): FlashInfer
0.6.18's FA2/FA3 paged runs accept ``sinks=`` but drop it (only trtllm-gen, SM100+, reads it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from swafactory.registry.capabilities import Capabilities
from swafactory.window import flashinfer_window_left

__all__ = ["CAPABILITIES", "Adapter", "custom_mask", "apply_sinks"]

_LN2 = math.log(2.0)
# Split-KV partials of one prefill pass: a 256-token chunk of Gemma 4's full layers (32 q heads ×
# 512) needed 138 MB on the H200, past FlashInfer's usual 128 MB, so take 512 MB once.
_WORKSPACE_BYTES = 512 * 1024 * 1024

CAPABILITIES = Capabilities(
    name="flashinfer",
    summary="FlashInfer paged decode + prefill with custom tree masks; one wrapper per layer group",
    kernel="FlashInfer BatchDecode/BatchPrefill",
    devices=frozenset({"cuda"}),
    cuda_archs=frozenset({80, 86, 89, 90, 100, 103, 120}),
    arch_note="FlashInfer's FA2/FA3 templates (SM80+)",
    requires=(("flashinfer", "swafactory[flashinfer]"),),
    head_dims=frozenset({64, 128, 256, 512}),
    head_dim_note="FlashInfer compiles head dims 64, 128, 256 and 512",
    tree_masks=frozenset({"custom_mask", "cascade"}),
    sinks=True,
    sinks_note="FlashInfer 0.6.18 reads sinks only in its trtllm-gen kernels (SM100+); on SM90 the "
               "adapter applies them exactly after the kernel from the LSE, o·σ(lse − sink) "
               "(checked against the oracle on the H200)",
    softcap=True,
    cuda_graph=False,  # the adapter has no graph-captured variants yet
    kv_dtypes=frozenset({"float16", "bfloat16"}),
)


def custom_mask(tables, window: int | None) -> torch.Tensor:
    """The visibility mask FlashInfer's custom-mask prefill needs, flattened per request.

    tables: `metadata.AttnTables`. Returns bool ``[sum_b q_len_b * kv_len_b]`` on the tables'
    device, request b's ``[q_len_b, kv_len_b]`` block row-major (FlashInfer's mask layout):
    ``structure & (q_pos - kv_pos < W)``; with no structure mask, causal by position. Built on the
    host (small per-request ops beat hundreds of tiny device launches), moved once.
    """
    qo, kv = tables.qo_indptr.tolist(), tables.kv_indptr.tolist()
    qp, kp = tables.q_pos.cpu().long(), tables.kv_pos.cpu().long()
    structure = tables.mask.cpu().bool() if tables.mask is not None else None
    mi = tables.mask_indptr.tolist() if structure is not None else None
    blocks = []
    for b in range(len(qo) - 1):
        q0, q1, k0, k1 = qo[b], qo[b + 1], kv[b], kv[b + 1]
        d = qp[q0:q1, None] - kp[None, k0:k1]
        vis = structure[mi[b]:mi[b + 1]].view(q1 - q0, k1 - k0) if structure is not None else d >= 0
        if window is not None:
            vis = vis & (d < window)
        blocks.append(vis.reshape(-1))
    return torch.cat(blocks).to(tables.qo_indptr.device)


def apply_sinks(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Add one sink logit per head to the softmax denominator, after the fact (exact).

    o: [n, H, D]; lse: [n, H] natural-log fp32 (-inf = no visible key); sinks: [H].
    With ``Z = exp(lse)`` the sinkless denominator, the sink-aware output is
    ``o · Z / (Z + exp(sink)) = o · σ(lse - sink)`` and its LSE is ``logaddexp(lse, sink)``.
    """
    s = sinks.float().view(1, -1)
    w = torch.sigmoid(lse - s)
    return (o.float() * w[..., None]).to(o.dtype), torch.logaddexp(lse, s)


@dataclass(eq=False)
class _Pass:
    """One planned pass (a group's tables, or a cascade half) in this forward."""

    group: str
    role: str
    """``main`` (the group's tables), ``pre`` / ``exp`` (cascade prefix / expand)."""
    window: int | None
    decode: bool
    qo_host: torch.Tensor
    """[B+1] int32 on the host: FlashInfer's plan reads indptrs on the host anyway."""
    kv_host: torch.Tensor
    indices: torch.Tensor
    """[total_kv] int32 slot rows on the device."""
    last: torch.Tensor
    """[B] int32 ones on the host (page size 1; plan checks it beside the host indptrs)."""
    mask: torch.Tensor | None
    """Flattened bool visibility (prefill passes only)."""
    planned_for: tuple | None = None
    wrapper: object = field(default=None, repr=False)


class Adapter:
    """Wires planner tables to FlashInfer wrappers; holds no pool logic.

    Wrappers are kept per (group, pass role, decode/prefill) and re-planned every forward; the
    float workspace is one buffer shared by all of them (they run one after another on a stream).
    """

    capabilities = CAPABILITIES

    def __init__(self) -> None:
        self._workspace: torch.Tensor | None = None
        self._wrappers: dict[tuple[str, str, bool], object] = {}
        self._passes: dict[int, _Pass] = {}

    def plan(self, forward_plan, pool) -> None:
        """Host work for every pass of ``forward_plan`` (once per forward)."""
        del pool  # geometry is read from the buffers each layer actually reads (run)
        self._passes.clear()
        for key, g in forward_plan.groups.items():
            passes = [("main", g.tables)]
            if g.cascade is not None:
                passes += [("pre", g.cascade[0]), ("exp", g.cascade[1])]
            for role, t in passes:
                # keyed by id: the plan holds the tables alive for the whole forward
                self._passes[id(t)] = self._prepare(key, role, t, g.window)

    def _prepare(self, key: str, role: str, t, window: int | None) -> _Pass:
        dev = t.qo_indptr.device
        qo_host = t.qo_indptr.to("cpu", torch.int32)
        kv_host = t.kv_indptr.to("cpu", torch.int32)
        q_lens = (qo_host[1:] - qo_host[:-1]).tolist()
        decode = t.mask is None and all(n == 1 for n in q_lens)
        return _Pass(key, role, window, decode, qo_host, kv_host,
                     t.kv_indices.tensor.to(dev, torch.int32),
                     torch.ones(len(q_lens), dtype=torch.int32),
                     None if decode else custom_mask(t, window))

    def _wrapper(self, p: _Pass, device: torch.device):
        import flashinfer

        if self._workspace is None or self._workspace.device != device:
            self._workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            self._wrappers.clear()
        k = (p.group, p.role, p.decode)
        if k not in self._wrappers:
            if p.decode:  # tensor cores: the fast path for GQA, and the one that serves D = 512
                w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD",
                                                                  use_tensor_cores=True)
            else:
                w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
            self._wrappers[k] = w
        return self._wrappers[k]

    def _plan_wrapper(self, p: _Pass, q: torch.Tensor, k_buf: torch.Tensor, scale: float,
                      softcap: float | None) -> None:
        hq, d = q.shape[1], q.shape[2]
        hkv = k_buf.shape[1]
        w = self._wrapper(p, q.device)
        common = dict(q_data_type=q.dtype, kv_data_type=k_buf.dtype, sm_scale=scale,
                      logits_soft_cap=softcap)
        if p.decode:
            w.plan(p.kv_host, p.indices, p.last, hq, hkv, d, 1,
                   window_left=flashinfer_window_left(p.window), **common)
        else:  # the window is inside the mask: FlashInfer's own would count from kv_len - q_len
            w.plan(p.qo_host, p.kv_host, p.indices, p.last, hq, hkv, d, 1,
                   custom_mask=p.mask, window_left=-1, **common)
        p.wrapper = w

    def run(self, tables, q, k_buf, v_buf, *, window, scale, softcap=None, sinks=None):
        """One pass → (o [total_q, Hq, D] in q's dtype, lse [total_q, Hq] fp32, natural log).

        q: [total_q, Hq, D]; k_buf, v_buf: [rows, Hkv, D] (bf16/fp16); sinks: [Hq] or None.
        """
        p = self._passes.get(id(tables))
        if p is None:
            raise RuntimeError("flashinfer adapter: these tables were not planned in this "
                               "forward (call AttentionBackend.init_forward_metadata first)")
        if window != p.window:
            raise ValueError(f"group {p.group!r} was planned for window {p.window}, run with "
                             f"{window}")
        sig = (q.shape[1], k_buf.shape[1], q.shape[2], q.dtype, k_buf.dtype, scale, softcap)
        if p.planned_for != sig:
            self._plan_wrapper(p, q, k_buf, scale, softcap)
            p.planned_for = sig
        o, lse = p.wrapper.run(q, (k_buf.unsqueeze(1), v_buf.unsqueeze(1)), return_lse=True)
        lse = lse * _LN2  # FlashInfer's LSE is base 2 (m·log2e + log2 d in its kernels)
        if sinks is not None:
            o, lse = apply_sinks(o, lse, sinks)
        return o, lse

    def merge(self, o1, lse1, o2, lse2, sinks=None):
        """Cascade merge → o (the sink joins once, here)."""
        from swafactory.kernels.torch_ref import merge_states

        return merge_states(o1, lse1, o2, lse2, sinks)
