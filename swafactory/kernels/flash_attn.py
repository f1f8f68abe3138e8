"""flash-attn-4 (CuTe DSL): `flash_attn_varlen_func` over the pool's pages, short passes on a
64 × 128 tile through `_flash_attn_fwd` (`pass_tile`).

Layout. Pool buffers ``[rows, Hkv, D]`` viewed as ``[rows / P, P, Hkv, D]`` are FA4's paged
cache at the pool's page size P, so a request's pages are its ``page_table`` row and
``seqused_k`` its key count (natural passes). Expanded passes list keys one by one, so they read
a page-size-1 view ``[rows, 1, Hkv, D]`` whose page table holds rows. FA4 aligns causality and
its window bottom-right in *index* space (query i of a sequence sees key j iff
``j ≤ i + kv_len − q_len`` and ``j ≥ i + kv_len − q_len − left``).

Two shapes of a pass, chosen once per forward (`Adapter.plan`) from what the planner knows on
the host (`AttnTables.natural`), so planning reads nothing back:

* ``natural``: no structure mask, each request's keys are consecutive positions that end with its
  queries (decode, extend, chain verify, draft extend). Index space equals position space there,
  so ``causal=True, window_size=(W-1, 0)`` is exact, trimmed SWA lists included.
* ``expanded``: everything else (trees, DFlash blocks, cascade halves). Each query row becomes a
  sequence of one query whose page-table row lists exactly the keys it sees (structure & window,
  the shared rule of `flex.padded_pass`), run non-causal. Any mask is exact this way. Its page
  table is as wide as the longest key list (a host number): a row's entries past its count are
  never read, and a tree's rows see nearly every key anyway.

Known library limit (4.0.0b9, SM90): the non-TMA paged loader sizes a per-thread page buffer as
``tile_n // 128``, which is 0 for head_dim 256 (tile_n 64/80), hence "Expected size in shape to be
strictly positive, but got 0" (flash-attention PR #2446; fixed upstream in #2745, first released
in fa4-v4.0.0.beta26). Head dims above 128 therefore run without a page table: each layer's keys
are gathered into ``[B, S, Hkv, D]`` with ``seqused_k``. head_dim 512 is refused by the library on
SM90 and so by the registry. Sinks use the exact LSE epilogue (`triton.sinks.sink_output`, one
launch on CUDA): ``learnable_sink`` takes bf16 sinks only, and the models' sinks are fp32. A
forward that wants no LSE (every layer's, but a cascade's halves) asks FA4 for none unless the
sinks need it.

Tile. b9's public functions take no tile; a natural pass of at most 64 GQA-packed query rows per
KV head (decode) on SM90 at head_dim ≤ 64 calls `_flash_attn_fwd` (the function
`flash_attn_varlen_func` wraps, same tensors, window as two ints) with ``tile_mn=(64, 128)``
(`pass_tile` says why). A library without it runs the default tile, with the reason in
`Adapter.tile_fallback` and a warning; `Adapter.runs` records each run's view and tile.
"""
from __future__ import annotations

import functools
import importlib
import warnings
from dataclasses import dataclass

import torch

from swafactory.kernels.flex import padded_pass
from swafactory.metadata.plan import PassCache
from swafactory.kernels.torch_ref import apply_sinks, merge_state
from swafactory.kernels.triton.sinks import sink_output
from swafactory.registry.capabilities import Capabilities
from swafactory.window import flash_attn_window_size

__all__ = ["CAPABILITIES", "Adapter", "PAGED_MAX_HEAD_DIM", "SHORT_PASS_TILE", "pass_tile"]

PAGED_MAX_HEAD_DIM = 128
"""Largest head dim FA4 4.0.0b9 serves through ``page_table`` at page size 1 on SM90."""

SHORT_PASS_TILE = (64, 128)
"""FA4 ``tile_mn`` for short passes (`pass_tile`): the smallest wgmma M, b9's own tile_n."""


def pass_tile(packed_rows: int, head_dim: int, arch: int | None) -> tuple[int, int] | None:
    """FA4's ``tile_mn`` for a natural pass whose GQA-packed query rows per KV head
    (``max_seqlen_q × group``) are ``packed_rows``; None: the library's default tile.

    Why: b9 picks 192 × 128 on SM90 at head_dim ≤ 64, and a decode tile packs only ``group``
    rows (8 for GPT-OSS), so most of each MMA is padding. GPT-OSS full-layer decode on the H200
    (bs 64, ctx 8192, D 64, group 8; commit 54316e4, bench/results/probes-54316e4.md) read its
    K/V at 53% of copy bandwidth with the default tile and at 91% with ``tile_mn=(64, 128)`` at
    page 128 (70% at page 1), outputs identical. The rule keeps to what was measured: SM90
    (arch 90), head_dim ≤ 64, at most 64 rows (one M block: the tile changes no arithmetic).
    """
    m = SHORT_PASS_TILE[0]
    return SHORT_PASS_TILE if arch == 90 and head_dim <= 64 and packed_rows <= m else None


@functools.lru_cache(maxsize=16)
def _arch(device: torch.device) -> int | None:
    """FA4's arch number of ``device`` (90 for H100/H200); None off CUDA (the CPU fakes).
    Cached: every layer's `run` asks, and the device's properties do not change."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


CAPABILITIES = Capabilities(
    name="flash_attn",
    summary="flash-attn-4 varlen over the pool's page table; masks as per-query key lists",
    kernel="flash-attn-4 varlen (cute)",
    devices=frozenset({"cuda"}),
    cuda_archs=frozenset({90, 100, 103}),
    arch_note="flash-attn-4's CuTe kernels target Hopper and Blackwell",
    requires=(("flash_attn.cute", "swafactory[flash-attn]"),),
    max_head_dim=256,
    head_dim_note="flash-attn-4 refuses head_dim > 256 on SM90 ('head_dim must be between 8 and 256')",
    tree_masks=frozenset({"custom_mask", "cascade"}),
    sinks=True,
    sinks_note="applied exactly from the returned LSE (learnable_sink takes bf16 sinks only)",
    softcap=True,
    kv_dtypes=frozenset({"float16", "bfloat16"}),
)


@dataclass(eq=False)
class _FaPass:
    """One planned pass in FA4's terms (device tensors, int32)."""

    natural: bool
    cu_seqlens_q: torch.Tensor
    """[n+1] int32: n = requests (natural) or query rows (expanded)."""
    max_seqlen_q: int
    page_table: torch.Tensor
    """[n, S] int32 pool rows; entries past seqused_k are never read."""
    seqused_k: torch.Tensor
    """[n] int32 key counts."""
    rows: torch.Tensor
    """page_table as int64, for the head dims that gather their keys (no page table)."""
    empty: torch.Tensor | None
    """[total_q] bool: rows that see no key (expanded passes: a cascade half's, a prefix-only
    query past its window), or None (natural passes: every query sees its own key)."""
    window: int | None
    pages: torch.Tensor | None = None
    """[n, ceil(S / P)] int32 page ids of the pool's own pages (natural passes at page size P >
    1: each list starts on a page start and runs through its pages in order), else None."""
    page: int = 1
    """P: the pool's page size that ``pages`` indexes."""


def plan_pass(tables, window: int | None, page: int = 1) -> _FaPass:
    """FA4 arguments for one pass. tables: `metadata.AttnTables`; page: the pool's page size.

    A natural pass at ``page`` > 1 reads the pool's own pages: its key lists start on a page
    start (the planner floors SWA starts to a page) and run through their pages' slots in order
    (the allocator's rule), so every ``page``-th row names a page. Expanded passes list each
    query's keys one by one, which pages cannot express: they keep the page-size-1 view.

    No host sync: the shape comes from the planner's host facts (``natural``, the host indptrs),
    sizes from host numbers, and rows are selected by gathers, never by a boolean index."""
    pp = padded_pass(tables, window, "flash_attn")
    b, qmax, kvmax = pp.shape
    dev = tables.qo_indptr.device
    kv_rows = pp.kv_index.view(b, kvmax)
    if tables.natural:  # the planner's host fact: keys consecutive, ending with the queries
        kv_len = pp.kv_valid.view(b, kvmax).sum(1)
        pages = None
        if page > 1:  # FA4 asserts stride(-1) == 1, which a [B, 1] slice's .contiguous() keeps
            ids = kv_rows[:, ::page] // page
            pages = torch.empty(ids.shape, dtype=torch.int32, device=dev).copy_(ids)
        return _FaPass(True, tables.qo_indptr.to(torch.int32), qmax, kv_rows.to(torch.int32),
                       kv_len.to(torch.int32), kv_rows, None, window, pages, page)
    vis = pp.vis.view(b * qmax, kvmax)[pp.q_slots]  # [total_q, kvmax], a gather
    counts = vis.sum(1)
    # each row's visible keys first, in key order; the width is kvmax (host-known), not the
    # largest count, which only a read back would give
    order = torch.sort((~vis).to(torch.uint8), dim=1, stable=True).indices
    table = torch.gather(kv_rows[pp.q_slots // qmax], 1, order)
    n = vis.shape[0]
    return _FaPass(False, torch.arange(n + 1, device=dev, dtype=torch.int32), 1,
                   table.to(torch.int32), counts.to(torch.int32), table, counts == 0, window)


def _fa4_call(tile):
    """(the FA4 function a run calls, why the tile was dropped or None). A tile needs
    `_flash_attn_fwd`; the public varlen function takes none."""
    interface = importlib.import_module("flash_attn.cute.interface")
    if tile is None:
        return interface.flash_attn_varlen_func, None
    fwd = getattr(interface, "_flash_attn_fwd", None)  # private in b9: may go or move
    if fwd is None:
        return interface.flash_attn_varlen_func, (
            "flash_attn.cute.interface has no _flash_attn_fwd (written against flash-attn-4 "
            f"4.0.0b9): short passes run FA4's default tile, not tile_mn={tile}")
    return fwd, None


class Adapter:
    """Wires planner tables to flash-attn-4; holds no pool logic."""

    capabilities = CAPABILITIES

    def __init__(self) -> None:
        self._passes: PassCache = PassCache("flash_attn")
        self.runs: dict[tuple[int | None, tuple[int, int] | None], int] = {}
        """(page size of the K/V view, 1 the page-size-1 view, None gathered keys; ``tile_mn``
        passed to `_flash_attn_fwd`, None FA4's default via the varlen function) → runs."""
        self.tile_fallback: str | None = None
        """Why a pass that `pass_tile` gives a tile ran the default one; None if none did."""

    @property
    def runs_by_page(self) -> dict[int, int]:
        """Page size of the cache view → paged runs (1: the page-size-1 view), for the tests."""
        out: dict[int, int] = {}
        for (page, _), n in self.runs.items():
            if page is not None:
                out[page] = out.get(page, 0) + n
        return out

    def plan(self, forward_plan, pool, *, sigs=None, graph=None) -> None:
        """FA4 arguments for every pass of ``forward_plan`` (once per forward)."""
        del sigs, graph  # no host-planned kernel signature; no graph path
        self._passes.clear()
        page = pool.sub_pools[0].page_size if pool is not None else 1
        for g in forward_plan.groups.values():
            for _, t in g.passes:
                self._passes.put(t, plan_pass(t, g.window, page))

    def run(self, tables, q, k_buf, v_buf, *, window, scale, softcap=None, sinks=None,
            lse: bool = True):
        """One pass → (o [total_q, Hq, D] in q's dtype, lse [total_q, Hq] fp32 natural log, or
        None when ``lse`` is False: the kernel is then asked for none unless the sinks need it).

        q: [total_q, Hq, D]; k_buf, v_buf: [rows, Hkv, D] (bf16/fp16); sinks: [Hq] or None.
        """
        p = self._passes.of(tables)
        if window != p.window:
            raise ValueError(f"pass planned for window {p.window}, run with {window}")
        want = lse or sinks is not None  # no LSE is asked of the kernel where nothing needs it
        kw = dict(cu_seqlens_q=p.cu_seqlens_q, max_seqlen_q=p.max_seqlen_q,
                  seqused_k=p.seqused_k, softmax_scale=scale, causal=p.natural, return_lse=want)
        left, right = flash_attn_window_size(window) if p.natural else (None, None)
        if q.shape[-1] <= PAGED_MAX_HEAD_DIM and p.pages is not None:  # the pool's own pages
            k, v = (b.view(b.shape[0] // p.page, p.page, *b.shape[1:]) for b in (k_buf, v_buf))
            kw["page_table"] = p.pages
        elif q.shape[-1] <= PAGED_MAX_HEAD_DIM:
            k, v = k_buf.unsqueeze(1), v_buf.unsqueeze(1)  # [rows, page_size 1, Hkv, D]
            kw["page_table"] = p.page_table
        else:  # b9's paged loader is broken for tile_n < 128 (see the module docstring)
            k, v = k_buf[p.rows], v_buf[p.rows]  # [n, S, Hkv, D]
        tile = (pass_tile(p.max_seqlen_q * (q.shape[1] // k_buf.shape[1]), q.shape[-1],
                          _arch(q.device)) if p.natural else None)
        fn, why = _fa4_call(tile)
        if why is not None:
            tile = None
            if self.tile_fallback is None:  # once per adapter, and kept for the record
                warnings.warn(why, RuntimeWarning, stacklevel=2)
            self.tile_fallback = why
        if tile is None:
            o, ln = fn(q, k, v, window_size=(left, right), softcap=softcap or 0.0, **kw)
        else:  # b9's `_flash_attn_fwd`: the window as two ints, softcap None for none
            o, ln = fn(q, k, v, window_size_left=left, window_size_right=right,
                       softcap=softcap or None, tile_mn=tile, **kw)
        view = k.shape[1] if "page_table" in kw else None
        self.runs[view, tile] = self.runs.get((view, tile), 0) + 1
        if p.empty is not None:  # a cascade half that sees nothing: the contract's (0, -inf)
            o = torch.where(p.empty[:, None, None], 0, o)
        if not want:
            return o.to(q.dtype), None
        ln = ln.float().transpose(0, 1)  # FA4 varlen LSE is [Hq, total_q]
        if p.empty is not None:
            ln = torch.where(p.empty[:, None], float("-inf"), ln)
        if not lse:  # the sinks alone: one launch on CUDA, not seven
            return sink_output(o.to(q.dtype), ln, sinks), None
        if sinks is not None:
            o, ln = apply_sinks(o, ln, sinks)
        return o.to(q.dtype), ln

    def merge(self, o1, lse1, o2, lse2, sinks=None):
        """Cascade merge → o (the sink joins once, here)."""
        return merge_state(o1, lse1, o2, lse2, sinks)[0]
