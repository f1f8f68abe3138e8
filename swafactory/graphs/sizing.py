"""How many keys a CUDA-graph bucket's buffers hold, and the graph state a config asks for.

A bucket of ``bs`` requests × ``tokens`` queries reads at most ``bs · max_context`` keys in a full
layer group and ``bs · (W + tokens + page)`` in a window group: its buffers are sized by that,
never by the pool's rows (a 1M-row pool once made one FlashInfer index buffer of bucket 64
256 MB). `bucket_keys` is the one statement of that bound (`state` sizes and checks
replays with it); `graph_state_estimate` is `run=plan`'s figure of the bytes an engine's
start-up capture of every bucket holds. No torch here: `run=plan` imports it.
"""
from __future__ import annotations

__all__ = ["bucket_keys", "graph_state_estimate", "BUCKETS", "FLASHINFER_INT_WORKSPACE"]

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
"""Requests per captured graph: the one list both graph drivers use (the engine runner's start-up
capture, `graphs.GraphedAttention`'s default); a larger batch runs eagerly."""
FLASHINFER_INT_WORKSPACE = 8 * 1024 * 1024
"""Bytes of the int workspace each FlashInfer 0.6 wrapper allocates for itself."""


def bucket_keys(window: int | None, tokens: int, max_context: int, page: int,
                nodes: int = 1) -> int:
    """Most keys one request of a graph bucket lists in a layer group: its whole context for a
    full group; for a window W, the W − 1 keys before its first query, the step's nodes (its
    ``tokens`` queries, or ``nodes``, the most a step adds, when more: a tree draft's later
    level queries a few of them and sees them all) and the page its list may start in (the
    planner floors SWA list starts to a page start), capped by the context."""
    if window is None:
        return max_context
    return min(max_context, window + max(tokens, nodes) + page)


def _bucket_bytes(kernel: str, n: int, tokens: int, keys: int, page: int) -> int:
    """Static bytes of one (group, bucket) in ``kernel``'s adapter (writes not included)."""
    pages = n * -(-keys // page)
    if kernel == "flashinfer":
        if tokens == 1:  # decode wrapper: indptr, indices (pages), last-page lengths
            own = 4 * (n + 1) + 4 * pages + 4 * n
        else:  # prefill: qo/kv indptr, mask offsets, indices, last-page lengths, packed mask
            own = 12 * (n + 1) + 4 * pages + 4 * n + (tokens * n * keys + 7) // 8 + n
        return own + FLASHINFER_INT_WORKSPACE
    if kernel == "triton" and tokens == 1:  # StaticTables: 2 indptrs, rows + positions, q_pos
        return 4 * (2 * (n + 1) + n + 2 * n * keys)
    return 0


def graph_state_estimate(cfg, *, buckets=BUCKETS, tokens=(1,),
                         max_context: int | None = None) -> int:
    """Bytes of the target runner's graph state once every bucket in ``buckets`` is captured
    for each query count in ``tokens``: write slots (int64) and each group's kernel buffers, at
    ``max_context`` (default ``workload.context_len``). Per TP rank; drafts not included."""
    from swafactory.kvcache.sizing import step_nodes

    m, b = cfg.model, cfg.backend
    ctx = cfg.workload.context_len if max_context is None else max_context
    nodes = step_nodes(cfg.spec)
    groups = []
    if m.swa_layers:
        groups.append(m.sliding_window)
    if m.full_layers:
        groups.append(None)
    total = 0
    for t in tokens:
        for n in buckets:
            for window in groups:
                keys = bucket_keys(window, t, ctx, b.page_size, nodes)
                kernel = b.family_for(window is not None, "decode" if t == 1 else "verify")
                total += 8 * n * t + _bucket_bytes(kernel, n, t, keys, b.page_size)
    return total
