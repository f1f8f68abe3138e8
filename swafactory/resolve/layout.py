"""The plan a validated config would build: which part serves which layers, from which pool.

Pure data from the config (nothing is allocated); the CLI renders it and writes it as plan.json.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from swafactory.config.schema import KV_DTYPE_BYTES, SwaFactoryConfig
from swafactory.graphs.sizing import graph_state_estimate
from swafactory.kvcache.draft import draft_layer_types
from swafactory.kvcache.sizing import effective_ratio, pool_sizing, step_nodes
from swafactory.registry.device import DeviceInfo
from swafactory.registry.table import get_capabilities
from swafactory.window import narrowed

__all__ = ["GroupRow", "PlanSummary", "describe", "frozen_draft_binding", "compress_ids"]


class GroupRow(BaseModel):
    """One layer group of one worker."""

    model_config = ConfigDict(frozen=True)
    worker: str
    """`target` or `draft`."""
    group: str
    """`swa` or `full`."""
    layers: str
    """Layer ids, compressed (`0-4,6-10`)."""
    num_layers: int
    pool: str
    """The sub-pool whose buffers the layers read and write."""
    index_space: str
    """Space of the locations its kernels get: `full`, or `swa` (translated from full)."""
    kv_heads: int
    head_dim: int
    window: int | None
    backend: str
    """Registry key of the kernel that serves the group (`backend.groups` may differ per group)."""
    kernel: str
    tree: str
    resolver: str
    bytes_per_token_layer: int
    tokens_per_request: int
    bytes_per_request: int


class PlanSummary(BaseModel):
    """Everything `run=plan` prints; also written as plan.json."""

    model_config = ConfigDict(frozen=True)
    combination: str
    device: str
    backend: str
    page_size: int
    kv_dtype: str
    spec: str
    draft_kv: str
    context_len: int
    max_running_requests: int
    rows: list[GroupRow]
    hybrid_bytes_per_token: int
    """Marginal bytes of one more context token past the window (full layers only)."""
    full_only_bytes_per_token: int
    hybrid_bytes_per_request: int
    full_only_bytes_per_request: int
    saving: float
    draft_bytes_per_request: int
    full_pool_tokens: int
    swa_pool_tokens: int
    graph_state_bytes: int = 0
    """Estimated bytes of the target's CUDA-graph state with every bucket captured at start-up
    (`graph_sizing.graph_state_estimate`: buckets 1-64, decode plus the spec step, at
    context_len); it does not grow with the pool."""
    graph_tokens: tuple[int, ...] = (1,)
    """Queries per request of the buckets that estimate counts."""
    passes: list[str] = []
    """What serves each pass × group and why (`backend.kernels` resolved on this host: nvcc,
    benchmark overrides), e.g. ``verify/full: cuda verify_d512 + triton extend tile (auto: nvcc
    present)``. A built backend may still fall back where a kernel does not build (warned)."""


def compress_ids(ids: tuple[int, ...] | list[int]) -> str:
    """`(0,1,2,4)` → `0-2,4`."""
    out, start, prev = [], None, None
    for i in ids:
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            out.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = i
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ",".join(out)


def frozen_draft_binding(cfg: SwaFactoryConfig) -> tuple[int, ...]:
    """Target layer each FROZEN_KV draft layer reads: the draft mirrors the target's last layers."""
    n, k = cfg.model.num_layers, cfg.spec.draft_num_layers
    return tuple(range(n - min(k, n), n))


def describe(cfg: SwaFactoryConfig, device: DeviceInfo) -> PlanSummary:
    """The plan for a validated (auto-resolved) config."""
    m, b, s = cfg.model, cfg.backend, cfg.spec
    def kernel(window: int | None) -> dict[str, str]:  # a group's kernel: its key and its words
        name = b.kernel_for(window is not None)
        return dict(backend=name, kernel=get_capabilities(name).kernel)

    tree = b.tree_mask if s.is_tree else "-"
    sizing = pool_sizing(cfg)
    rows = []
    for g in sizing.groups:
        translated = g.kind == "swa" and m.hybrid_pool
        rows.append(GroupRow(
            worker="target", group=g.kind, layers=compress_ids(g.layers), num_layers=len(g.layers),
            pool=g.pool,
            index_space="swa" if translated else "full", kv_heads=g.num_kv_heads,
            head_dim=g.head_dim, window=g.window, **kernel(g.window), tree=tree, resolver=b.resolver,
            bytes_per_token_layer=g.bytes_per_token_layer, tokens_per_request=g.tokens_per_request,
            bytes_per_request=g.bytes_per_request))
    rows.extend(_draft_rows(cfg, kernel, tree, sizing.draft_bytes_per_request))
    hybrid_marginal = sum(g.bytes_per_token_layer * len(g.layers) for g in sizing.groups
                          if g.tokens_per_request == sizing.context_len)
    full_tokens = cfg.workload.max_running_requests * cfg.workload.context_len
    split = bool(m.swa_layers) and m.hybrid_pool
    g_tokens = (1,) if s.algorithm == "none" else (1, 1 << (max(step_nodes(s), 2) - 1).bit_length())
    return PlanSummary(
        combination=cfg.combination, device=device.describe(), backend=b.name, page_size=b.page_size,
        kv_dtype=b.kv_dtype, spec=s.name, draft_kv=_draft_kv(s), context_len=sizing.context_len,
        max_running_requests=cfg.workload.max_running_requests, rows=rows,
        hybrid_bytes_per_token=hybrid_marginal,
        full_only_bytes_per_token=sizing.bytes_per_token_full_only,
        hybrid_bytes_per_request=sizing.hybrid_bytes_per_request,
        full_only_bytes_per_request=sizing.full_only_bytes_per_request, saving=sizing.saving,
        draft_bytes_per_request=sizing.draft_bytes_per_request,
        full_pool_tokens=full_tokens if m.full_layers else 0,
        swa_pool_tokens=int(full_tokens * effective_ratio(cfg)) if split else 0,
        graph_state_bytes=graph_state_estimate(cfg, tokens=g_tokens), graph_tokens=g_tokens,
        passes=_passes(cfg, device))


def _passes(cfg: SwaFactoryConfig, device: DeviceInfo) -> list[str]:
    """`backend.kernels` resolved for this host (nothing is built)."""
    from swafactory.kernels.cuda.launch import env_override, nvcc_path
    from swafactory.registry.kernel_choice import resolve_passes

    override = {"decode": env_override(decode=True), "verify": env_override(),
                "extend": env_override()}
    return [str(r) for r in resolve_passes(cfg, device, nvcc=nvcc_path() is not None,
                                           override=override)]


def _draft_kv(s) -> str:
    """Who owns the draft's K/V, and its window and retention when set: ``own_pool, window 32
    (+4 sink keys), its K/V on the target's SWA slots``."""
    if s.draft_window is None:
        return s.draft_kv
    sink = f" (+{s.draft_sink} sink keys)" if s.draft_sink else ""
    kept = ", its K/V on the target's SWA slots" if s.draft_kv_retention == "window" else \
        ", its K/V kept in full" if s.draft_kv == "own_pool" else ""
    return f"{s.draft_kv}, window {s.draft_window}{sink}{kept}"


def _split_draft_rows(cfg: SwaFactoryConfig, kernel, tree: str) -> list[GroupRow]:
    """An own draft pool split like the target's (DFlash ``draft_pool_split``): its sliding
    layers read their window from the draft's SWA sub-pool through the target's mapping, the
    others its full sub-pool; each group as many slots a request as the target's of its kind."""
    m, b = cfg.model, cfg.backend
    types = draft_layer_types(cfg)
    per = {g.kind: g for g in pool_sizing(cfg).groups}
    rows = []
    for kind, t in (("swa", "sliding_attention"), ("full", "full_attention")):
        mine = [j for j, x in enumerate(types) if x == t]
        if not mine:
            continue
        geo, g = (m.swa, per["swa"]) if kind == "swa" else (m.full, per["full"])
        window = narrowed(m.sliding_window if kind == "swa" else None, cfg.spec.draft_window)
        rows.append(GroupRow(
            worker="draft", group=kind, layers=compress_ids(mine), num_layers=len(mine),
            pool=f"draft {kind} (own, the target's mapping)" if kind == "swa" else
            "draft full (own)", index_space=kind, kv_heads=geo.num_kv_heads,
            head_dim=geo.head_dim, window=window, **kernel(window), tree=tree,
            resolver=f"{b.resolver} → active pool" if kind == "swa" else b.resolver,
            bytes_per_token_layer=g.bytes_per_token_layer, tokens_per_request=g.tokens_per_request,
            bytes_per_request=g.bytes_per_token_layer * g.tokens_per_request * len(mine)))
    return rows


def _draft_rows(cfg: SwaFactoryConfig, kernel, tree: str, draft_bytes: int) -> list[GroupRow]:
    """The draft runner's rows; ``kernel(window)`` names the kernel of a group."""
    m, s, b = cfg.model, cfg.spec, cfg.backend
    if s.draft_kv == "own_pool" and "sliding_attention" in draft_layer_types(cfg):
        return _split_draft_rows(cfg, kernel, tree)
    if s.draft_kv == "own_pool":
        geo = m.full or m.swa
        assert geo is not None
        return [GroupRow(
            worker="draft", group="own", layers=compress_ids(range(s.draft_num_layers)),
            num_layers=s.draft_num_layers, pool="draft (own)",
            index_space="full", kv_heads=geo.num_kv_heads, head_dim=geo.head_dim,
            window=s.draft_window, **kernel(s.draft_window), tree=tree,
            resolver=f"{b.resolver} → none",
            bytes_per_token_layer=2 * geo.num_kv_heads * geo.head_dim * KV_DTYPE_BYTES[b.kv_dtype],
            tokens_per_request=cfg.workload.context_len, bytes_per_request=draft_bytes)]
    if s.draft_kv != "target_pool":
        return []
    rows = []
    bound = frozen_draft_binding(cfg)
    for kind, layers in (("swa", m.swa_layers), ("full", m.full_layers)):
        mine = [j for j, t in enumerate(bound) if t in layers]
        if not mine:
            continue
        geo = m.swa if kind == "swa" else m.full
        assert geo is not None
        split = kind == "swa" and m.hybrid_pool
        window = narrowed(m.sliding_window if kind == "swa" else None, s.draft_window)
        rows.append(GroupRow(
            worker="draft", group=kind, layers=f"{compress_ids(mine)} → target "
                                               f"{compress_ids([bound[j] for j in mine])}",
            num_layers=len(mine), pool=f"target {'swa' if split else 'full'} (read)",
            index_space="swa" if split else "full", kv_heads=geo.num_kv_heads,
            head_dim=geo.head_dim, window=window, **kernel(window),
            tree=tree, resolver=f"{b.resolver} → allocator" if split else b.resolver,
            bytes_per_token_layer=0, tokens_per_request=0, bytes_per_request=0))
    return rows
