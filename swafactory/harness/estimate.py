"""How many scheduler steps a conformance run will take, before it runs (for `step N/M` progress).

The count is not known up front: a spec step commits a random number of tokens. The estimate
replays `Loop.step_once`'s scheduling on the run's own prompt and output lengths: admission up
to ``max_running_requests``, prefill chunks clamped to each request's SWA share exactly as
`Loop._prefill` clamps them (with `RequestSlots.evict_out_of_window`'s page-floored frontier),
then decode or spec steps. A decode step commits one token per request; a spec step commits an
accepted length drawn from the loop's own acceptance rule (`swafactory.speculative`'s
`seeded_accept` on `seeded_tree`). Without spec the replay is exact; with spec the estimate
is the mean step count of `_REPLAYS` seeded replays (not the plug-in mean length: which
requests finish together, and so whether a prefill stalls the decodes, depends on the draws).
"""
from __future__ import annotations

import random
from collections import deque

from swafactory.config.schema import SwaFactoryConfig
from swafactory.speculative import seeded_accept, seeded_tree  # the loop's own rule

__all__ = ["estimate_steps", "accepted_lengths"]

_SAMPLES = 512
_REPLAYS = 16


def accepted_lengths(cfg: SwaFactoryConfig, samples: int = _SAMPLES) -> list[int]:
    """Tokens one decode or spec step commits per request: ``[1]`` without spec, else
    ``samples`` seeded draws of the loop's accepted path length."""
    s = cfg.spec
    if s.algorithm == "none":
        return [1]
    rng = random.Random(0)
    out = []
    for _ in range(samples):
        if s.algorithm == "dflash":
            parents, n = None, s.block_size
        elif s.is_tree:
            n = s.num_draft_tokens
            parents = seeded_tree(s.topk, s.num_steps, rng)[:n]
        else:
            parents, n = None, s.num_draft_tokens
        out.append(len(seeded_accept(parents, n, rng)))
    return out


def estimate_steps(cfg: SwaFactoryConfig, prompts: list[int], outs: list[int],
                   swa_share: int) -> int:
    """Scheduler steps to serve ``prompts``/``outs`` (tokens per request) under ``cfg``.

    swa_share: SWA slots one request may hold (`Sizes.swa_pages_per_req` × page size); ignored
    when the pool is not split (then prefill chunks are ``workload.chunk_size``).
    """
    lengths = accepted_lengths(cfg)
    if len(set(lengths)) == 1:
        return _replay(cfg, prompts, outs, swa_share, lambda: lengths[0])
    rng = random.Random(cfg.workload.seed)
    runs = [_replay(cfg, prompts, outs, swa_share, lambda: rng.choice(lengths))
            for _ in range(_REPLAYS)]
    return round(sum(runs) / len(runs))


def _replay(cfg: SwaFactoryConfig, prompts: list[int], outs: list[int], swa_share: int,
            accepted) -> int:
    m, w, P = cfg.model, cfg.workload, cfg.backend.page_size
    W = m.sliding_window or 0
    split = bool(m.swa_layers) and m.hybrid_pool
    evicts = split and not cfg.faults.no_swa_eviction
    reread = cfg.spec.draft_kv == "target_pool"  # FROZEN_KV keeps position L-1
    # per request: [prompt, out, committed, generated, swa_evicted]
    waiting = deque([p, o, 0, 0, 0] for p, o in zip(prompts, outs))
    running: list[list[int]] = []
    steps = 0
    while waiting or running:
        while waiting and len(running) < w.max_running_requests:
            running.append(waiting.popleft())
        prefill = [r for r in running if r[2] < r[0]]
        for r in prefill:
            n = min(w.chunk_size, r[0] - r[2])
            if split:
                n = min(n, swa_share + r[4] - r[2])
            if n <= 0:  # the loop raises CapacityError here: the run stops
                return steps + 1
            r[2] += n
            if r[2] >= r[0]:
                r[3] += 1  # the prefill's last logits give the first token
        if not prefill:
            for r in running:
                a = accepted()
                r[2] += a
                r[3] += a
        running = [r for r in running if r[3] < r[1]]
        if evicts:
            for r in running:
                low = r[2] - 1 if reread and r[2] >= r[0] else r[2]
                frontier = max(0, max(0, low) - W + 1) // P * P
                if frontier - r[4] >= w.eviction_interval:
                    r[4] = frontier
        steps += 1
    return steps
