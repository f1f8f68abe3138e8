"""Sizing of the hybrid pools: analytic bytes per request, and pool sizes from a memory budget.

Per request, a full layer holds every context token; a sliding layer of a hybrid pool holds at
most `swa_tokens_per_request` slots: the window, what one forward adds, the eviction lag and page
slack. That function is the one statement of the per-request SWA need: the plan (`pool_sizing`),
the budget check, `swafactory.kvcache.size_pools` and the conformance harness all call it. A
full-only pool keeps every token in every layer. `size_from_budget` turns a byte budget into
sub-pool sizes (DESIGN invariant 6); `build_pools` allocates them (it imports torch; this module
does not).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from swafactory.config.schema import KV_DTYPE_BYTES, SwaFactoryConfig
from swafactory.errors import CapacityError
from swafactory.kvcache.draft import draft_layer_types

if TYPE_CHECKING:
    import torch

__all__ = ["GroupBytes", "PoolSizing", "pool_sizing", "swa_tokens_per_request",
           "full_tokens_per_request", "step_nodes", "effective_ratio", "BudgetSizing",
           "size_from_budget", "build_pools"]


@dataclass(frozen=True)
class GroupBytes:
    """One layer group's share of the KV bytes."""

    kind: str
    """`swa` or `full`."""
    pool: str
    """Sub-pool that holds it: `swa`, `full`, or `full (window as mask)`."""
    layers: tuple[int, ...]
    """Model layer ids."""
    num_kv_heads: int
    head_dim: int
    window: int | None
    """HF W, or None for full layers."""
    bytes_per_token_layer: int
    """K + V bytes of one token in one layer."""
    tokens_per_request: int
    """Tokens of one request this group's pool holds at `context_len`."""

    @property
    def bytes_per_request(self) -> int:
        """All layers of the group, one request at `context_len`."""
        return self.bytes_per_token_layer * len(self.layers) * self.tokens_per_request


@dataclass(frozen=True)
class PoolSizing:
    """Bytes of the hybrid pools for one request at `context_len`, against a full-only pool."""

    context_len: int
    groups: tuple[GroupBytes, ...]
    draft_bytes_per_request: int
    """The draft worker's own pool (full-index space, target full geometry; a split one, as the
    target's groups); 0 when none."""

    @property
    def bytes_per_token_full_only(self) -> int:
        """K + V bytes of one token over all layers when every layer keeps every token."""
        return sum(g.bytes_per_token_layer * len(g.layers) for g in self.groups)

    @property
    def hybrid_bytes_per_request(self) -> int:
        """Target pools, hybrid layout."""
        return sum(g.bytes_per_request for g in self.groups)

    @property
    def full_only_bytes_per_request(self) -> int:
        """Target pools if every layer kept every token."""
        return self.bytes_per_token_full_only * self.context_len

    @property
    def saving(self) -> float:
        """full-only / hybrid (≥ 1)."""
        return self.full_only_bytes_per_request / max(1, self.hybrid_bytes_per_request)


def step_nodes(spec: Any) -> int:
    """Slots one request takes beyond its committed tokens in one decode or spec step: 1 for a
    decode, the whole drafted tree (root included) for a tree, the verified tokens for a chain or
    a DFlash block. ``spec``: a `SpecConfig`."""
    if spec.algorithm == "none":
        return 1
    if spec.is_tree:
        return 1 + spec.topk * spec.num_steps
    return spec.num_draft_tokens


def full_tokens_per_request(max_context: int, step_tokens: int, page_size: int) -> int:
    """Full slots one running request holds at most, a multiple of ``page_size``: its whole
    context and one step's not yet verified nodes (position p lives in page ``p // page_size``)."""
    return -(-(max_context + step_tokens) // page_size) * page_size


def swa_tokens_per_request(window: int, step_tokens: int, page_size: int,
                           eviction_interval: int = 1) -> int:
    """SWA slots one running request holds at most, a multiple of ``page_size``.

    ``W + step_tokens + eviction_interval + page_size + 1``, rounded up to whole pages, plus one
    page: the window the next query sees; what one forward adds before eviction can run (a
    prefill chunk, or one step's nodes: `step_nodes`); the dead positions that wait while the
    frontier advances by less than ``eviction_interval``; the page that straddles the frontier
    (SWA pages are freed whole) and the position L-1 a FROZEN_KV draft re-reads; the partly
    filled last page. `RequestSlots` bookkeeping peaks at ``P⌈(W+n+P-1)/P⌉ + P⌊(I-1)/P⌋`` (the
    re-read included), which this bounds (tests/test_sizing.py drives it).
    """
    P = page_size
    return P * (-(-(window + step_tokens + eviction_interval + P + 1) // P) + 1)


def effective_ratio(cfg: SwaFactoryConfig) -> float:
    """The workload's SWA/full ratio; `auto` = just enough SWA slots for each request's window
    at `context_len` (the plan's sizing)."""
    r = cfg.workload.swa_full_tokens_ratio
    if r != "auto":
        return float(r)
    m, ctx = cfg.model, cfg.workload.context_len
    if not (m.swa_layers and m.hybrid_pool and m.sliding_window):
        return 1.0
    return min(1.0, _steady_swa_need(cfg) / ctx)


def _steady_swa_need(cfg: SwaFactoryConfig) -> int:
    """`swa_tokens_per_request` of a decoding request (one step's nodes; a prefilling request
    also holds its chunk: `swafactory.kvcache.size_pools` takes it)."""
    m = cfg.model
    assert m.sliding_window is not None
    return swa_tokens_per_request(m.sliding_window, step_nodes(cfg.spec), cfg.backend.page_size,
                                  cfg.workload.eviction_interval)


def pool_sizing(cfg: SwaFactoryConfig, context_len: int | None = None) -> PoolSizing:
    """Per-group bytes for ``context_len`` tokens per request (default: the workload's)."""
    m, b = cfg.model, cfg.backend
    ctx = cfg.workload.context_len if context_len is None else context_len
    elt = KV_DTYPE_BYTES[b.kv_dtype]
    groups = []
    if m.swa_layers:
        assert m.swa is not None and m.sliding_window is not None
        split = m.hybrid_pool
        keep = _steady_swa_need(cfg)
        groups.append(GroupBytes(
            "swa", "swa" if split else "full (window as mask)", m.swa_layers, m.swa.num_kv_heads,
            m.swa.head_dim, m.sliding_window, 2 * m.swa.num_kv_heads * m.swa.head_dim * elt,
            min(ctx, keep) if split else ctx))
    if m.full_layers:
        assert m.full is not None
        groups.append(GroupBytes("full", "full", m.full_layers, m.full.num_kv_heads, m.full.head_dim,
                                 None, 2 * m.full.num_kv_heads * m.full.head_dim * elt, ctx))
    draft = 0
    n_full, n_swa = _draft_layers(cfg, bool(m.swa_layers) and m.hybrid_pool)
    if n_swa:  # a split own pool (DFlash draft_pool_split): each group as the target's
        draft = sum(g.bytes_per_token_layer * g.tokens_per_request * (n_swa if g.kind == "swa"
                                                                       else n_full) for g in groups)
    elif cfg.spec.draft_kv == "own_pool":
        geo = m.full or m.swa
        assert geo is not None
        draft = cfg.spec.draft_num_layers * 2 * geo.num_kv_heads * geo.head_dim * elt * ctx
    return PoolSizing(ctx, tuple(groups), draft)


# ---------------------------------------------------------------- sizes from a memory budget
@dataclass(frozen=True)
class BudgetSizing:
    """Sub-pool sizes (slots, page multiples) that fit a byte budget."""

    full_tokens: int
    """Slots of the full index space. Virtual (no buffers) when ``full_is_virtual``."""
    swa_tokens: int
    """Slots of the SWA sub-pool; 0 when the pool is not split."""
    full_is_virtual: bool
    """All layers slide: the full space only numbers slots (see `SWAAllocator`)."""
    bytes_used: int
    """K + V bytes of target and draft pools at these sizes (dummy pages excluded)."""


def _page_floor(n: float, page: int) -> int:
    return int(n) // page * page


def size_from_budget(cfg: SwaFactoryConfig, budget_bytes: int, *, ratio: float | None = None,
                     max_running_requests: int | None = None, window: int | None = None,
                     draft_tokens: int | None = None, page_size: int | None = None
                     ) -> BudgetSizing:
    """Pool sizes for ``budget_bytes`` (sglang ``HybridSWAPoolConfigurator``), defaults from cfg.

    Split pool: ``cell = full_bpt·(n_full + n_draft_full) + r·swa_bpt·(n_swa + n_draft_swa)``,
    ``full = page_floor(budget / cell)``, ``swa = page_floor(full · r)``; the draft's own pool
    (full-indexed, target full size) is part of the cell (sglang #29622). All-SWA: the virtual
    full space holds every running request's context, and the budget left after an own draft
    pool goes to SWA. Unsplit: every layer at full size. Raises `CapacityError` when the SWA pool
    cannot hold ``max_running · swa_tokens_per_request(W, draft_tokens, page, interval)`` slots;
    ``draft_tokens`` defaults to `step_nodes` (what one decode or spec step adds).
    """
    m, b, s, w = cfg.model, cfg.backend, cfg.spec, cfg.workload
    r = effective_ratio(cfg) if ratio is None else ratio
    reqs = w.max_running_requests if max_running_requests is None else max_running_requests
    W = m.sliding_window if window is None else window
    d = step_nodes(s) if draft_tokens is None else draft_tokens
    I = w.eviction_interval
    P = b.page_size if page_size is None else page_size
    if not 0 < r <= 1:
        raise ValueError(f"swa_full_tokens_ratio must lie in (0, 1], got {r}")
    elt = KV_DTYPE_BYTES[b.kv_dtype]
    bpt = {k: 2 * g.num_kv_heads * g.head_dim * elt for k, g in (("swa", m.swa), ("full", m.full))
           if g is not None}
    split = bool(m.swa_layers) and m.hybrid_pool
    n_full = len(m.full_layers) if split else m.num_layers
    n_swa = len(m.swa_layers) if split else 0
    full_bpt = bpt.get("full", bpt.get("swa", 0)) if not split or m.full_layers else 0
    draft_full, draft_swa = _draft_layers(cfg, split)
    draft_bpt = bpt.get("full", bpt.get("swa", 0))  # an own pool takes the full geometry
    if split and not m.full_layers:  # all-SWA: a virtual full space of every running context
        full = reqs * full_tokens_per_request(w.context_len, d, P)
        left = budget_bytes - draft_full * draft_bpt * full
        swa = _page_floor(left / (bpt["swa"] * (n_swa + draft_swa)), P) if left > 0 else 0
        used = draft_full * draft_bpt * full + bpt["swa"] * (n_swa + draft_swa) * swa
        _check_swa(swa, reqs, W, d, P, I, budget_bytes, r)
        return BudgetSizing(full, swa, True, used)
    cell = full_bpt * n_full + draft_bpt * draft_full + \
        (r * bpt["swa"] * (n_swa + draft_swa) if split else 0)
    full = _page_floor(budget_bytes / cell, P)
    if full < P:
        raise CapacityError(f"a budget of {budget_bytes} bytes holds no page of {P} tokens "
                            f"(one full token costs {cell:.0f} bytes)")
    swa = _page_floor(full * r, P) if split else 0
    if split:
        _check_swa(swa, reqs, W, d, P, I, budget_bytes, r)
    used = (full_bpt * n_full + draft_bpt * draft_full) * full + \
        (bpt["swa"] * (n_swa + draft_swa) * swa if split else 0)
    return BudgetSizing(full, swa, False, used)


def _draft_layers(cfg: SwaFactoryConfig, split: bool) -> tuple[int, int]:
    """Draft layers budgeted as (full-size, SWA-size) layers."""
    s = cfg.spec
    if s.draft_kv != "own_pool":
        return 0, 0  # FROZEN_KV reads the target's KV: no bytes of its own
    types = draft_layer_types(cfg)
    if split and "sliding_attention" in types:  # split or window-retained: on the target's SWA slots
        n_swa = sum(t == "sliding_attention" for t in types)
        return len(types) - n_swa, n_swa
    return s.draft_num_layers, 0


def _check_swa(swa: int, reqs: int, W: int, d: int, P: int, I: int, budget: int,
               r: float) -> None:
    one = swa_tokens_per_request(W, d, P, I)
    need = reqs * one
    if swa < need:
        raise CapacityError(
            f"the SWA pool gets {swa} slots from a budget of {budget} bytes at ratio {r}, but "
            f"{reqs} running requests × {one} (window {W} + step {d} + eviction interval {I} + "
            f"page slack, swa_tokens_per_request) need {need}. Raise "
            "the budget or workload.swa_full_tokens_ratio, or lower "
            "workload.max_running_requests.")


def build_pools(cfg: SwaFactoryConfig, size_full: int, size_swa: int,
                device: torch.device | str = "cpu", check_mode: bool = False) -> tuple[Any, Any]:
    """``(HybridSWAPool, allocator)`` for ``cfg``; see `swafactory.kvcache.factory.build_pools`."""
    from swafactory.kvcache.factory import build_pools as _build  # imports torch

    return _build(cfg, size_full, size_swa, device, check_mode)
