"""Tensor-parallel attention: each rank owns a shard of the query and KV heads, its own pools and
its own backend; outputs are all-gathered and checked against the single-process oracle.

KV heads fewer than ranks are replicated (as in vLLM): rank r then holds KV head r // (tp / kv).
The ranks are launched with torch.multiprocessing and talk through torch.distributed (gloo on CPU,
NCCL on GPUs); no communication layer of our own.
"""
from __future__ import annotations

import os
import socket
import tempfile
from dataclasses import dataclass

import torch

from swafactory.config.schema import Geometry, SwaFactoryConfig

__all__ = ["Shard", "shard_config", "launch"]


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, tp: int, port: int, cfg_json: str, device_kind: str, out: str) -> None:
    import torch.distributed as dist

    from swafactory.harness.run import run_rank

    if device_kind == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
    dist.init_process_group("nccl" if device_kind == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
    try:
        report = run_rank(SwaFactoryConfig.model_validate_json(cfg_json), Shard(rank, tp))
        if rank == 0:
            with open(out, "w") as f:
                f.write(report.model_dump_json())
    finally:
        dist.destroy_process_group()


def launch(cfg: SwaFactoryConfig, device_kind: str):
    """Run the conformance job on ``cfg.parallel.tp`` ranks; returns rank 0's Report."""
    import torch.multiprocessing as mp

    from swafactory.harness.report_model import Report

    tp = cfg.parallel.tp
    if device_kind == "cuda" and torch.cuda.device_count() < tp:
        raise RuntimeError(f"parallel.tp={tp} needs {tp} GPUs; {torch.cuda.device_count()} visible")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.json")
        mp.spawn(_rank_main, args=(tp, _free_port(), cfg.model_dump_json(), device_kind, out),
                 nprocs=tp, join=True)
        with open(out) as f:
            return Report.model_validate_json(f.read())
