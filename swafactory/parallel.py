"""Tensor-parallel attention: each rank owns a shard of the query and KV heads, its own pools and
its own backend; outputs are all-gathered and checked against the single-process oracle.

KV heads fewer than ranks are replicated (as in vLLM): rank r then holds KV head r // (tp / kv).
The ranks are launched by `swafactory.harness.launch` (torch.multiprocessing) and talk through
torch.distributed (gloo on CPU, NCCL on GPUs); no communication layer of our own. This module is
the sharding alone: it imports nothing of the harness, which imports it.
"""
from __future__ import annotations

from dataclasses import dataclass

from swafactory.config.schema import Geometry, SwaFactoryConfig

__all__ = ["Shard", "shard_config"]


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``tp``: which query heads and which KV heads of each group it holds."""

    rank: int
    tp: int

    def q_heads(self, num_q: int) -> slice:
        n = num_q // self.tp
        return slice(self.rank * n, (self.rank + 1) * n)

    def kv_heads(self, num_kv: int) -> slice:
        if num_kv >= self.tp:
            n = num_kv // self.tp
            return slice(self.rank * n, (self.rank + 1) * n)
        h = self.rank // (self.tp // num_kv)  # replicated: every tp/kv ranks share one KV head
        return slice(h, h + 1)


def shard_config(cfg: SwaFactoryConfig, shard: Shard) -> SwaFactoryConfig:
    """The config one rank builds its pools and backend from: its share of the heads."""
    m = cfg.model

    def geo(g: Geometry | None) -> Geometry | None:
        if g is None:
            return None
        s = shard.kv_heads(g.num_kv_heads)
        return g.model_copy(update={"num_kv_heads": s.stop - s.start})

    model = m.model_copy(update={"num_attention_heads": m.num_attention_heads // shard.tp,
                                 "swa": geo(m.swa), "full": geo(m.full)})
    # the shard is a one-rank config: its own heads, nothing left to split
    return cfg.model_copy(update={"model": model, "parallel": cfg.parallel.model_copy(
        update={"tp": 1})})
