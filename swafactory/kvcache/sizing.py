"""Analytic sizing of the hybrid pools against a full-only pool (DESIGN invariant 6).

Per request, a full layer holds every context token; a sliding layer of a hybrid pool holds at
most ``W + draft tokens + page_size`` (the window, the draft tokens of one step, and the page that
straddles the eviction frontier). A full-only pool keeps every token in every layer.
"""
from __future__ import annotations

from dataclasses import dataclass

from swafactory.config.schema import KV_DTYPE_BYTES, SwaFactoryConfig

__all__ = ["GroupBytes", "PoolSizing", "pool_sizing", "swa_tokens_per_request"]


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
    """The draft worker's own pool (full-index space, target full geometry); 0 when none."""

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


def swa_tokens_per_request(window: int, draft_tokens: int, page_size: int) -> int:
    """SWA slots one request needs at most: the window, one step's draft tokens, page slack."""
    return window + draft_tokens + page_size


def pool_sizing(cfg: SwaFactoryConfig, context_len: int | None = None) -> PoolSizing:
    """Per-group bytes for ``context_len`` tokens per request (default: the workload's)."""
    m, b = cfg.model, cfg.backend
    ctx = cfg.workload.context_len if context_len is None else context_len
    elt = KV_DTYPE_BYTES[b.kv_dtype]
    groups = []
    if m.swa_layers:
        assert m.swa is not None and m.sliding_window is not None
        split = m.hybrid_pool
        keep = swa_tokens_per_request(m.sliding_window, cfg.spec.draft_tokens_per_step, b.page_size)
        groups.append(GroupBytes(
            "swa", "swa" if split else "full (window as mask)", m.swa_layers, m.swa.num_kv_heads,
            m.swa.head_dim, m.sliding_window, 2 * m.swa.num_kv_heads * m.swa.head_dim * elt,
            min(ctx, keep) if split else ctx))
    if m.full_layers:
        assert m.full is not None
        groups.append(GroupBytes("full", "full", m.full_layers, m.full.num_kv_heads, m.full.head_dim,
                                 None, 2 * m.full.num_kv_heads * m.full.head_dim * elt, ctx))
    draft = 0
    if cfg.spec.draft_kv == "own_pool":
        geo = m.full or m.swa
        assert geo is not None
        draft = cfg.spec.draft_num_layers * 2 * geo.num_kv_heads * geo.head_dim * elt * ctx
    return PoolSizing(ctx, tuple(groups), draft)
