"""What the FlashInfer adapter plans per pass (`Pass`), which passes our verify tile serves
(`uses_triton_verify`, `bucket_tiled`), and a CUDA-graph bucket's side of a pass: its wrapper's
fixed buffers (`graph_buffers`) and the host tables padded to the bucket (`pad_to_bucket`).
`kernels/flashinfer.py` is the adapter that uses them.

CUDA graphs (`Adapter.plan(…, graph=(bucket, tokens))`): passes are padded to ``bucket``
requests (padding requests have ``tokens`` query rows and read the pool's dummy row 0: one key,
or under the causal rule one per query) and run through ``use_cuda_graph`` wrappers, one per
(group, pass, bucket, tokens), whose fixed buffers the captured kernels read; `plan` refills
them in place for every replay. A bucket's kernel is fixed at capture, before it knows what it
replays: where the spec makes only chains, a verify or draft-extend bucket is the causal prefill
eager runs them with; otherwise the masked prefill, which serves trees too. Requests may have
fewer queries than ``tokens`` (draft extend): the rows past the batch's are padding.

Verify on our tile. A multi-query pass of at most `TILE_MAX_ROWS` rows per KV head (queries ×
the GQA group: chain and tree verify, DFlash blocks, draft extend) runs swafactory's extend tile on
the same tables instead of FlashInfer's prefill, eagerly and in CUDA graphs: at head_dim 512 its
dense run through our CUDA kernel where nvcc is present (`kernels/cuda/verify_d512.cu`), the other
keys through the Triton tile. A graph bucket whose tokens put it there runs the same tile over
static tables (`triton.adapter.StaticTables`, refilled in place), so its replay runs eager's
kernels, which FlashInfer's own graph plans cannot promise (below). Measured: Gemma 4 full layers
(H200, bs 64, ctx 8192, 8 tokens) the dense run 1.20 ms, the Triton tile 2.01, FlashInfer's custom
mask 2.23, its decode of the same K/V 0.99 (bench/results/probe-verify-cuda-d79e545.md); GPT-OSS-20b
chain verify (H100, bs 64) the Triton step 5.79 ms against FlashInfer's FA2 6.14 eager and 8.21
replayed. ``backend.kernels.<group>.verify=library`` keeps FlashInfer's prefill (autotune times
both).

FA2 for short passes. A causal pass of at most `FA2_MAX_QUERIES` queries per request (chain
verify, draft extend, a chunk's tail) asks FlashInfer for its FA2 prefill, which tiles a KV head's
whole query group together. FlashInfer's own choice on Hopper, FA3, tiles each query head apart
and so reads each KV head once per query head: GPT-OSS-20b chain verify (8 tokens, bs 64, ctx
8192, H100) ran 47.8 ms under FA3's causal prefill against 15.6 ms for the masked FA2 one.
Longer chunks keep FlashInfer's choice (FA3 is the faster prefill there); masked passes are FA2
anyway. A graph bucket's FA2 prefill is not eager's kernel: FlashInfer 0.6.18's scheduler
(`PrefillSplitQOKVIndptr`) always splits KV under ``use_cuda_graph`` (a merge kernel follows) and
sizes its query tile for the worst ragged batch the bucket could hold; GPT-OSS-20b chain verify
at bs 64 replays in 8.21 ms against eager's 6.14 (H100). Its way out, ``disable_split_kv``,
stores an unbounded chunk size in an int32 and allocates no valid-block mask for a graph's padding
CTAs: it faulted (an illegal memory access), so it is not used.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from swafactory.registry.kernel_choice import TILE_MAX_ROWS  # the policy's bound, declared there

__all__ = ["TILE_MAX_ROWS", "FA2_MAX_QUERIES", "Signature", "Pass",
           "prefill_backend", "uses_triton_verify", "bucket_tiled", "graph_buffers",
           "held_bytes", "pad_to_bucket"]


FA2_MAX_QUERIES = 16
"""Most queries per request for which a causal pass asks for FlashInfer's FA2 prefill."""


@dataclass(eq=False)
class Pass:
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
    """[B] int32 on the host: keys in each request's last page (all ones at page size 1)."""
    mask: torch.Tensor | None
    """Packed visibility, uint8 on the device (prefill passes only; `packed_custom_mask`)."""
    mask_off: torch.Tensor | None = None
    """[B+1] int32 on the host: each request's first mask byte in a graph's dense packing."""
    planned_for: tuple | None = None
    wrapper: object = field(default=None, repr=False)
    graph: tuple[int, int] | None = None
    """(bucket, tokens per request) when planned for a CUDA-graph bucket, else None."""
    page: int = 1
    """The pool's page size: ``kv_host``/``indices`` count pages of it, ``last`` keys."""
    triton: bool = False
    """Served by the Triton extend tile (`uses_triton_verify`): no FlashInfer tables or plan."""
    static: object = None
    """A graph bucket's Triton pass: its `triton.adapter.StaticTables`, refilled in place."""
    kv_dev: torch.Tensor | None = None
    """[B+1] int32 on the device: ``kv_host``'s twin (the planner's), which FlashInfer's
    ``fast_decode_plan`` takes as the kernel's indptr (eager decode at page size 1 only)."""
    causal: bool = False
    """A plain multi-query pass (`AttnTables.natural`, eager): FlashInfer's prefill with
    ``causal=True, window_left=W-1`` and no mask."""
    backend: str = "auto"
    """The prefill wrapper's FlashInfer backend: ``fa2`` for a short causal pass (see above)."""

    @property
    def key(self) -> tuple:
        """Its wrapper's key: a wrapper's backend (FA2/FA3) is fixed at its first plan (from
        whether a mask is given, or ours), so causal, masked and short passes keep their own."""
        return (self.group, self.role, self.decode, self.causal, self.graph, self.backend)


def prefill_backend(causal: bool, tokens: int) -> str:
    """`Pass.backend` for a pass of up to ``tokens`` queries per request (FA2 for short causal)."""
    return "fa2" if causal and tokens <= FA2_MAX_QUERIES else "auto"


Signature = tuple
"""(q heads, KV heads, head_dim, q dtype, KV dtype, scale, soft-cap): what ``wrapper.plan`` needs
beyond the tables; the same for every layer of a group."""


def bucket_tiled(sig: Signature, tokens: int) -> bool:
    """`uses_triton_verify` for a graph bucket of ``tokens`` queries per request."""
    hq, hkv = sig[:2]
    return 1 < tokens and tokens * (hq // hkv) <= TILE_MAX_ROWS


def uses_triton_verify(sig: Signature, t) -> bool:
    """Whether a pass of ``t`` under ``sig`` runs our extend tile: a masked or multi-query pass
    (FlashInfer's prefill) of at most `TILE_MAX_ROWS` rows per KV head."""
    hq, hkv = sig[:2]
    prefill = t.mask is not None or t.max_q_len > 1
    return prefill and t.max_q_len * (hq // hkv) <= TILE_MAX_ROWS


def graph_buffers(p: Pass, keys: int, page: int, device: torch.device) -> dict:
    """The fixed buffers a graph bucket's wrapper is built with (``use_cuda_graph=True``): sized
    for ``p.graph`` = (n requests, tokens) reading at most ``keys`` keys each, in pages of
    ``page``. A masked prefill's ``mask_indptr_buf`` is the adapter's to rewrite after plan."""
    n, tokens = p.graph
    i32 = dict(dtype=torch.int32, device=device)
    max_kv = n * keys
    pages = max_kv if page == 1 else n * -(-keys // page)
    kw = dict(use_cuda_graph=True)
    if p.decode:
        kw.update(paged_kv_indptr_buffer=torch.zeros(n + 1, **i32),
                  paged_kv_indices_buffer=torch.zeros(pages, **i32),
                  paged_kv_last_page_len_buffer=torch.ones(n, **i32))
        return kw
    kw.update(qo_indptr_buf=torch.zeros(n + 1, **i32),
              paged_kv_indptr_buf=torch.zeros(n + 1, **i32),
              paged_kv_indices_buf=torch.zeros(pages, **i32),
              paged_kv_last_page_len_buf=torch.ones(n, **i32))
    if not p.causal:  # a chain bucket holds no mask
        kw.update(custom_mask_buf=torch.zeros((tokens * max_kv + 7) // 8 + n,
                                              dtype=torch.uint8, device=device),
                  mask_indptr_buf=torch.zeros(n + 1, **i32))
    return kw


def held_bytes(graph_bufs: dict, wrappers: dict, static: dict) -> int:
    """Bytes of the graph wrappers' fixed buffers (``graph_bufs``: wrapper key → its buffers) and
    their own int workspaces (FlashInfer gives each wrapper one; the float workspace is shared
    with eager passes, not counted), and of the static tables of tiled buckets."""
    held = {}  # data pointer → bytes: a buffer counted once
    for k, bufs in graph_bufs.items():
        ws = getattr(wrappers.get(k), "_int_workspace_buffer", None)
        for b in (*bufs, *((ws,) if isinstance(ws, torch.Tensor) else ())):
            held[b.data_ptr()] = b.numel() * b.element_size()
    return sum(held.values()) + sum(st.nbytes for st in static.values())


def pad_to_bucket(graph: tuple[int, int], causal: bool, qo_host: torch.Tensor,
                  kv_host: torch.Tensor, indices: torch.Tensor, mask: torch.Tensor | None,
                  mask_off: torch.Tensor | None) -> tuple:
    """A pass's host indptrs ([B+1] int32), key rows ([total_kv] int32, device) and packed mask
    (uint8, device, with its host byte offsets [B+1]) padded to the bucket's ``n`` requests of
    ``tokens`` queries: padding requests read the dummy row 0, one key each, or under the
    causal rule one per query (each query then sees one). Returns the five, padded."""
    n, tokens = graph
    pad = n - (qo_host.numel() - 1)
    step = torch.arange(1, pad + 1, dtype=torch.int32)
    qo_host = torch.cat([qo_host, qo_host[-1] + tokens * step])
    per_pad = tokens if causal else 1
    kv_host = torch.cat([kv_host, kv_host[-1] + per_pad * step])
    indices = torch.cat([indices, indices.new_zeros(pad * per_pad)])
    if mask is not None:  # a padding request sees its one key (bits past it unread)
        per = (tokens + 7) // 8
        mask = torch.cat([mask, mask.new_full((pad * per,), 255)])
        mask_off = torch.cat([mask_off, mask_off[-1] + per * step])
    return qo_host, kv_host, indices, mask, mask_off
