"""Pool sizes for N running requests × a longest context × a prefill chunk: what an engine sizes.

`size_pools` gives each running request a share of each index space: its whole context (and one
step's drafts) in the full space, and in the SWA space `swa_tokens_per_request` of what one
forward adds at most (its prefill chunk, or one decode or spec step's nodes). Eviction keeps a
request inside its SWA share only if the engine runs `RequestSlots.evict_out_of_window` after
every step (docs/embedding.md). The conformance harness sizes its pools through this function.
No torch here: `swafactory.kvcache.factory.build_pools` allocates the sizes.
"""
from __future__ import annotations

from dataclasses import dataclass

from swafactory.config.schema import SwaFactoryConfig
from swafactory.errors import ConfigError, Reason
from swafactory.kvcache.sizing import full_tokens_per_request, step_nodes, swa_tokens_per_request

__all__ = ["PoolSizes", "size_pools", "admission_need"]


@dataclass(frozen=True)
class PoolSizes:
    """Slots of each index space (multiples of ``page_size``), and one request's share of them."""

    full: int
    """Slots of the full index space: ``max_requests × full_per_request``. Virtual (numbers only,
    no buffers) on an all-SWA model."""
    swa: int
    """Slots of the SWA sub-pool: ``max_requests × swa_per_request``; 0 on an unsplit pool."""
    full_per_request: int
    """A request's longest row: the ``max_context`` of its `ReqToToken`."""
    swa_per_request: int
    """SWA slots one request may hold at once; 0 when the pool is not split."""
    max_requests: int
    """Requests running at once: the rows of `ReqToToken`."""
    step_tokens: int
    """What one forward adds to a request at most: ``max(chunk, step_nodes(spec))``."""


def admission_need(cfg: SwaFactoryConfig, sizes: PoolSizes, prompt_len: int, out: int
                   ) -> dict[str, int]:
    """Slots of each index space one request holds at most (``full``, and ``swa`` on a split
    pool), as `size_pools` shares them: its whole context and one step's nodes on the full
    side; on the SWA side its window's share (a window-retained draft's K/V,
    ``spec.draft_kv_retention=window``, shares the target's SWA slots and adds none)."""
    m, P = cfg.model, cfg.backend.page_size
    need = {"full": full_tokens_per_request(prompt_len + out, step_nodes(cfg.spec), P)}
    if sizes.swa_per_request:
        need["swa"] = swa_tokens_per_request(m.sliding_window, sizes.step_tokens, P,
                                             cfg.workload.eviction_interval)
    return need


def _positive(name: str, value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"size_pools: {name} must be an int >= 1 ({what}), got {value!r}. "
                         f"Fix: pass {name}=<{what}>")
    return value


def size_pools(cfg: SwaFactoryConfig, max_requests: int, max_context: int, chunk: int, *,
               ratio: float | str | None = None) -> PoolSizes:
    """Full and SWA slots for ``max_requests`` running requests under ``cfg``.

    max_requests: requests running at once. max_context: the longest prompt + output a request
    reaches (its drafted nodes come on top). chunk: the most prefill tokens one forward gives a
    request. ``cfg`` supplies the spec (`step_nodes`), the window, ``backend.page_size`` and
    ``workload.eviction_interval``.

    ratio: SWA/full slots, default ``workload.swa_full_tokens_ratio``. ``"auto"`` gives each
    request exactly `swa_tokens_per_request`; a number r gives each request
    ``page_floor(full · r / max_requests)`` and raises `ConfigError` (a ValueError) when that is
    below its need. Unsplit pools (no sliding layers, or ``model.hybrid_pool`` false) have no SWA
    pool: the ratio is not read. Bad arguments raise ValueError naming them.
    """
    R = _positive("max_requests", max_requests, "requests running at once")
    ctx = _positive("max_context", max_context, "longest prompt + output, in tokens")
    c = _positive("chunk", chunk, "most prefill tokens per request per forward")
    m, w, P = cfg.model, cfg.workload, cfg.backend.page_size
    nodes = step_nodes(cfg.spec)
    step = max(c, nodes)
    full_share = full_tokens_per_request(ctx, nodes, P)
    full = R * full_share
    if not (m.swa_layers and m.hybrid_pool and m.sliding_window):
        return PoolSizes(full, 0, full_share, 0, R, step)
    need = swa_tokens_per_request(m.sliding_window, step, P, w.eviction_interval)
    r = w.swa_full_tokens_ratio if ratio is None else ratio
    if r == "auto":
        return PoolSizes(full, R * need, full_share, need, R, step)
    field = "workload.swa_full_tokens_ratio" if ratio is None else "ratio"
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1:
        raise ValueError(f"size_pools: {field} must be 'auto' or a number in (0, 1], got {r!r}. "
                         f"Fix: {field}='auto'")
    share = int(full * float(r)) // P // R * P
    if share < need:
        least = -(-100 * R * need // full) / 100
        hint = f"ratio ≥ {least}" if least <= 1 else "more than the full space: no ratio ≤ 1 does"
        raise ConfigError([Reason(
            "workload", field,
            f"{r} gives each of {R} running requests {share} SWA slots, but one needs "
            f"W + step nodes + eviction lag + page slack = {need} ({hint} at {full} full slots)",
            "workload.swa_full_tokens_ratio=auto" if ratio is None else "ratio='auto'",
            rule="sizing")])
    return PoolSizes(full, R * share, full_share, share, R, step)
