"""How many scheduler steps a conformance run will take, before it runs (for `step N/M` progress).

The count is not known up front: a spec step commits a random number of tokens. The estimate
replays the scheduler's own rules on paper (`scheduler.replay_steps`) on the run's prompt and
output lengths: admission, prefill chunks clamped to each request's SWA share, the eviction
frontier, then decode or spec steps. A decode step commits one token per request; a spec step commits an
accepted length drawn from the loop's own acceptance rule (`swafactory.serving.speculative`'s
`seeded_accept` on `seeded_tree`). Without spec the replay is exact; with spec the estimate
is the mean step count of `_REPLAYS` seeded replays (not the plug-in mean length: which
requests finish together, and so whether a prefill stalls the decodes, depends on the draws).
"""
from __future__ import annotations

import random

from swafactory.config.schema import SwaFactoryConfig
from swafactory.serving.scheduler import replay_steps
from swafactory.serving.speculative import seeded_accept, seeded_tree  # the loop's own rule

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

    swa_share: SWA slots one request may hold (the pools' ``swa_per_request``); ignored when
    the pool is not split (then prefill chunks are ``workload.chunk_size``).
    """
    lengths = accepted_lengths(cfg)
    evicts = not cfg.faults.no_swa_eviction  # the fault's run never moves its frontier
    if len(set(lengths)) == 1:
        return replay_steps(cfg, prompts, outs, lambda: lengths[0], swa_share, evicts=evicts)
    rng = random.Random(cfg.workload.seed)
    runs = [replay_steps(cfg, prompts, outs, lambda: rng.choice(lengths), swa_share,
                         evicts=evicts) for _ in range(_REPLAYS)]
    return round(sum(runs) / len(runs))
