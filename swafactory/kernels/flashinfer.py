"""FlashInfer: BatchDecode / BatchPrefill (custom mask) wrappers, one set per layer group.

Layout. Pool buffers ``[rows, Hkv, D]`` with page size P are FlashInfer's NHD paged cache once
viewed as ``[rows / P, P, Hkv, D]``: the pool's own pages, never a page-size-1 view of them when
P > 1. The planner starts every key list on a page start and a request's slots run through its
pages in order, so its page ids are every P-th listed row // P, and ``last_page_len`` is what its
list leaves in the last page (`page_table`). Keys of the first page before the window are still
allocated (eviction frees whole pages) and masked by position like every other backend's.

Kernels. FlashInfer counts causality and its window from ``kv_len - q_len + i`` (query i's
place in its request's key list), which is the token position exactly when the keys are
consecutive positions ending at the request's last query (`AttnTables.natural`: the planner's
lists of chains, SWA lists trimmed to a page start included, since the trim moves the start, not
the end). So:

* decode (one query per request, no mask): the tensor-core decode wrapper, ``window_left = W-1``;
* plain multi-query passes (prefill chunks, extend, chain verify, chain draft, draft extend):
  the prefill wrapper with ``causal=True, window_left = W-1`` and no mask: nothing per
  (query, key) is built, whatever the chunk (planning memory is the key lists');
* trees, DFlash blocks, prefix-only queries and cascade halves: the prefill wrapper with a
  host-built custom mask ``structure & (q_pos - kv_pos < W)`` and ``window_left = -1``, since
  there the list index is not the position (tree nodes at ``prefix + depth``, DESIGN invariant 4);
* verify and draft passes of at most 64 rows per KV head (queries × GQA group): our extend
  tile, eagerly and in CUDA graphs alike (`flashinfer_passes`);
* CUDA-graph buckets of several tokens past that: the causal prefill where the spec makes only
  chains, else the masked one.

Causal and masked passes use separate wrappers: FlashInfer picks a wrapper's FA2/FA3 backend at
its first plan from whether a mask is given.

Planning. `plan(forward_plan, pool, sigs=…)` (once per forward, from
`AttentionBackend.init_forward_metadata`) does all the host work: the planner's host indptrs
(never read back from the device), int32 indices, masks built on the device, and FlashInfer's
``wrapper.plan`` with each group's signature (query heads, dtypes, scale, soft-cap: the backend
knows them from the config and the pool). A layer whose `run` brings another signature re-plans
its pass there (eagerly; inside a CUDA-graph capture that is an error). An eager decode pass at
page size 1 whose wrapper was planned before with the same signature is re-planned without
``plan`` (its Python ``max()`` over the host lengths is one ``item()`` per request): by the
wrapper's scheduler call alone where it has FlashInfer 0.6's internals
(`flashinfer_replan`), else through FlashInfer's ``fast_decode_plan`` (what sglang's decode
steps use).

CUDA graphs (`plan(…, graph=(bucket, tokens))`), verify on our tile and FA2 for short
causal passes: `flashinfer_passes`. One pass's tables → FlashInfer's, and ``wrapper.plan``:
`flashinfer_wrappers`.

Masks travel packed, at host-known offsets (`flashinfer_tables`: 0.6.18's bit-offset quirk).

Sinks are served by an exact epilogue on the returned LSE (``o · σ(lse - sink)``): FlashInfer
0.6.18's FA2/FA3 paged runs accept ``sinks=`` but drop it (only trtllm-gen, SM100+, reads it).

``backend.kernels.<group>.verify`` chooses what serves verify (``library``: FlashInfer's
prefill; ``triton``: no CUDA dense run); `run=plan` shows it. The FlashInfer version and its mask
layout are checked at start (`flashinfer_check`).
"""
from __future__ import annotations

import math

import torch

from swafactory.kernels import flashinfer_replan as replan
from swafactory.kernels.cuda import KernelEnv, running_under
from swafactory.kernels.flashinfer_check import check_at_start, check_version
from swafactory.kernels.flashinfer_passes import (Pass, Signature, bucket_tiled, held_bytes,
                                                  uses_triton_verify)
from swafactory.kernels.flashinfer_staging import StagingRing
from swafactory.kernels.flashinfer_tables import custom_mask, packed_custom_mask, page_table
from swafactory.kernels.flashinfer_wrappers import WrapperPlanning
from swafactory.kernels.static_tables import chain_bucket, static_tables
from swafactory.kernels.torch_ref import apply_sinks, merge_state
# looked up here at each call, so a test's monkeypatch of this module's name takes effect
from swafactory.kernels.triton.ops import paged_attention
from swafactory.kernels.triton.sinks import sink_output
from swafactory.metadata.batch import MODE_PASS
from swafactory.metadata.plan import PassCache
from swafactory.registry.capabilities import Capabilities

__all__ = ["CAPABILITIES", "Adapter", "page_table", "custom_mask", "packed_custom_mask",
           "apply_sinks", "uses_triton_verify"]  # the last five: re-exported for callers

_LN2 = math.log(2.0)

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
    cuda_graph=True,  # every mode, through AttentionBackend.init_forward_metadata_capture/replay
    kv_dtypes=frozenset({"float16", "bfloat16", "fp8_e4m3"}),
    fp8_max_head_dim=256,
    fp8_limited_archs=frozenset({80, 86, 89, 90}),
    fp8_note="FlashInfer 0.6.18 builds its fp8-KV kernels at head_dim 512 for SM100+ only: 'No "
             "supported CUDA architectures found for major versions [10, 11, 12]' on the H200",
)


class Adapter(WrapperPlanning):
    """Wires planner tables to FlashInfer wrappers; holds no pool logic.

    Wrappers are kept per (group, pass role, decode/prefill, graph bucket) and re-planned every
    forward; the float workspace is one buffer shared by all of them (they run one after another
    on a stream, and graphs replay one at a time).
    """

    capabilities = CAPABILITIES

    @property
    def direct_plans(self) -> int:
        """Decode passes re-planned by `flashinfer_replan.replan_decode`."""
        return self._replan.direct

    def __init__(self) -> None:
        self._workspace: torch.Tensor | None = None
        self._wrappers: dict[tuple, object] = {}
        self._mask_off: dict[tuple, torch.Tensor] = {}
        """A graph prefill wrapper's ``mask_indptr`` buffer (ours: rewritten after its plan)."""
        self._passes: PassCache = PassCache("flashinfer")
        self._ones = torch.ones(0, dtype=torch.int32)
        """Last-page lengths (page size 1: all ones), pinned where CUDA is: one buffer sliced
        per pass instead of a new pageable tensor FlashInfer's plan copies each forward."""
        self._max_rows = 0
        self._views: dict[int, tuple] = {}
        """id of a layer's K buffer [rows, Hkv, D] → (it, its V buffer, their [rows / P, P, Hkv,
        D] page views): a view op costs 2 µs of host time per buffer per layer; cleared when the
        planned pool changes."""
        self._views_pool = None
        self._page = 1  # the planned pool's page size
        self.replans = 0
        """Passes re-planned inside `run` because a layer's signature differed from the one
        given to `plan` (0 in an engine whose config matches its model)."""
        self._full_plan: dict[tuple, tuple] = {}
        """Wrapper key → (the wrapper, the signature of its last ``plan``): what
        ``fast_decode_plan`` keeps (the kernel module, dtypes) is that plan's."""
        self.fast_plans = 0
        """Decode passes re-planned without ``plan`` (FlashInfer's ``fast_decode_plan``, or its
        scheduler call alone: ``direct_plans`` of them)."""
        self._replan = replan.DecodeReplanner()
        self.graph_keys = None
        """(window, tokens) → most keys one request of a graph bucket lists (set by
        `AttentionBackend.init_cuda_graph_state`); None: the largest sub-pool's rows."""
        self._graph_bufs: dict[tuple, list[torch.Tensor]] = {}
        """Graph wrapper key → the fixed buffers given to it (`graph_bytes`)."""
        self._capturing = False  # the planned forward is a graph capture's shapes
        self.graph_chains = False
        """The spec drafts chains (set by `AttentionBackend.init_cuda_graph_state`): a verify
        or draft-extend bucket holds plain chains, so it is captured causal, as eager runs
        them, not masked (spec=none and tree specs keep the mask)."""
        self._static: dict[tuple, object] = {}
        """A graph bucket's Triton passes' static tables, by (group, role, bucket, tokens, pool
        id) (`triton.adapter.static_tables`)."""
        self._staging = StagingRing()
        """The pinned plan staging, one buffer per in-flight plan (`flashinfer_staging`)."""
        self.kernels = None
        """The backend's `registry.kernel_choice.KernelPolicy` (set by `build_backend`): whether
        our tiles serve verify (`uses_triton_verify`) and our CUDA dense run with them."""
        self._mode = None  # the planned forward's mode: which pass's choice serves it
        self.env = KernelEnv.read()
        """The environment overrides our tile obeys (`kernels.cuda.KernelEnv`), read once
        (`build_backend` sets its own snapshot): a layer's call reads no ``os.environ``."""
        check_version()  # a FlashInfer other than the tested one is refused here (importable only)

    def start(self, device: torch.device) -> None:
        """Once the backend is built: the version, and on CUDA the packed-mask layout the
        installed FlashInfer reads (`flashinfer_check`, once per process)."""
        check_at_start(device)

    def plan(self, forward_plan, pool, *, sigs: dict[str, Signature] | None = None,
             graph: tuple[int, int] | None = None) -> None:
        """Host work for every pass of ``forward_plan`` (once per forward).

        sigs: group key → `Signature`; a group without one is planned by its first `run`.
        graph: (bucket, tokens per request) to pad for and plan a captured bucket's wrappers.
        """
        self._passes.clear()
        self._mode = getattr(forward_plan, "mode", None)
        self._capturing = getattr(forward_plan, "source_rule", None) == "graph capture"
        if pool is not self._views_pool:  # views of a former pool's buffers are let go
            self._views.clear()
            self._views_pool = pool  # held: its identity is not reused while these stand
            self._max_rows = max(sp.rows for sp in pool.sub_pools)
            self._page = pool.sub_pools[0].page_size
        for key, g in forward_plan.groups.items():
            sig = (sigs or {}).get(key)
            for role, t in g.passes:
                # a graph bucket decides by its own tokens, not the batch's: what it captured
                tiled = sig is not None and (uses_triton_verify(sig, t) if graph is None else
                                             bucket_tiled(sig, graph[1]))
                if tiled and (self.kernels is None
                              or self.kernels.ours(self._mode, g.window is not None)):
                    st = None
                    if graph is not None:  # the same tile over static tables: eager's kernels
                        st = static_tables(self._static, (key, role, *graph, id(pool)), t,
                                           t.qo_indptr.device, self._keys(g.window, graph[1]),
                                           chain_bucket(self.graph_chains, self._mode)
                                           and g.cascade is None, self._capturing)
                    self._passes.put(t, Pass(key, role, g.window, False, t.qo_host, t.kv_host,
                                              t.kv_indices.tensor, self._ones[:0], None,
                                              planned_for=sig, graph=graph, triton=True,
                                              static=st))
                    continue
                p = self._passes.put(t, self._prepare(key, role, t, g.window, graph))
                if sig is not None:
                    self._plan_wrapper(p, sig, t.qo_indptr.device)

    def _paged(self, k_buf: torch.Tensor, v_buf: torch.Tensor) -> tuple:
        """(k_buf, v_buf) [rows, Hkv, D] as FlashInfer's NHD caches of the pool's pages
        [rows / P, P, Hkv, D]: made once per pair of buffers, one lookup per layer."""
        v = self._views.get(id(k_buf))
        if v is None or v[0] is not k_buf or v[1] is not v_buf:
            page = lambda b: b.view(b.shape[0] // self._page, self._page, *b.shape[1:])  # noqa: E731
            v = self._views[id(k_buf)] = (k_buf, v_buf, (page(k_buf), page(v_buf)))
        return v[2]

    def graph_route(self, mode: str, tokens: int) -> tuple[str, str]:
        """What a bucket of ``mode`` captures: a 1-token bucket, the decode wrapper whatever
        the mode (its buffers are one); else the pass (whose policy picks our tile or the
        library's wrapper) and the variant (causal for plain chains, else masked)."""
        if tokens == 1:
            return ("decode",)
        variant = ("causal" if self.graph_chains and mode in ("target_verify", "draft_extend")
                   else "masked")
        return MODE_PASS.get(mode, "extend"), variant

    def graph_binding(self) -> tuple:
        """Which passes (wrappers, our tile's static tables) the current plan's launches read
        (`AttentionBackend.bound_as`: an emulated replay runs over its capture's)."""
        return dict(self._passes), self._mode, self._capturing

    def restore_binding(self, state: tuple) -> None:
        self._passes.clear()
        self._passes.update(state[0])
        self._mode, self._capturing = state[1], state[2]

    def graph_bytes(self) -> int:
        """Bytes this adapter holds for CUDA graphs (`flashinfer_passes.held_bytes`)."""
        return held_bytes(self._graph_bufs, self._wrappers, self._static)

    def run(self, tables, q, k_buf, v_buf, *, window, scale, softcap=None, sinks=None,
            lse: bool = True, k_scale: float = 1.0, v_scale: float = 1.0):
        """One pass → (o [total_q, Hq, D] in q's dtype, lse [total_q, Hq] fp32 natural log, or
        None when ``lse`` is False and no sink needs it: the kernel then writes none).

        q: [total_q, Hq, D]; k_buf, v_buf: [rows, Hkv, D], bf16/fp16 or fp8 e4m3 read with the
        layer's ``k_scale``/``v_scale`` (folded in by FlashInfer); sinks: [Hq] or None.
        """
        p = self._passes.of(tables)
        if window != p.window:
            raise ValueError(f"group {p.group!r} was planned for window {p.window}, run with "
                             f"{window}")
        qs, ks = q.shape, k_buf.shape
        sig = (qs[1], ks[1], qs[2], q.dtype, k_buf.dtype, scale, softcap)
        if p.triton and p.planned_for == sig:  # the same rows and rule (off CUDA: the reference)
            t = tables if p.static is None else p.static
            with running_under(self.env):  # our tile reads the snapshot, not the environment
                return paged_attention(q, k_buf, v_buf, t.qo_indptr, t.kv_indptr, t.kv_rows,
                                       t.q_pos, t.kv_pos, mask=t.mask, mask_indptr=t.mask_indptr,
                                       window=window, scale=scale, softcap=softcap, sinks=sinks,
                                       max_q_len=t.max_q_len, k_scale=k_scale, v_scale=v_scale,
                                       cuda=None if self.kernels is None else
                                       self.kernels.cuda(self._mode, window is not None))
        if p.triton and p.static is not None:
            raise ValueError(f"group {p.group!r}: a graph bucket's Triton pass was planned for "
                             f"{p.planned_for} but a layer runs {sig}; set the backend's q_heads "
                             "to the model's heads on this rank")
        if p.triton:  # planned for another signature: FlashInfer's tables after all
            p = self._passes.put(tables, self._prepare(p.group, p.role, tables, p.window, None))
        if p.planned_for != sig:
            if q.is_cuda and torch.cuda.is_current_stream_capturing():
                raise ValueError(f"group {p.group!r} was planned for {p.planned_for} (q heads, "
                                 f"KV heads, head_dim, dtypes, scale, soft-cap) but a layer runs "
                                 f"{sig} inside a CUDA-graph capture; set the backend's q_heads "
                                 "to the model's heads on this rank")
            self._plan_wrapper(p, sig, q.device)
            self.replans += 1
        want = lse or sinks is not None
        paged = self._paged(k_buf, v_buf)
        out = (p.wrapper.run(q, paged, return_lse=want) if k_buf.dtype.itemsize > 1 else
               p.wrapper.run(q, paged, return_lse=want, k_scale=k_scale, v_scale=v_scale))
        if not want:
            return out, None
        o, l2 = out
        if not lse:  # the sinks alone: one launch on CUDA, not seven
            return sink_output(o, l2, sinks, lse_scale=_LN2), None
        ln = l2 * _LN2  # FlashInfer's LSE is base 2 (m·log2e + log2 d in its kernels)
        if sinks is not None:
            o, ln = apply_sinks(o, ln, sinks)
        return o, ln

    def merge(self, o1, lse1, o2, lse2, sinks=None):
        """Cascade merge → o (the sink joins once, here)."""
        return merge_state(o1, lse1, o2, lse2, sinks)[0]
