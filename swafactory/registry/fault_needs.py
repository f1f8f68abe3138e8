"""What each fault needs to bite, as data: a fault switched on where it cannot act would let a
green run pass as proof. `faults_rule` turns a missing need into a reason naming the field that
is missing and the override that supplies it. (Every fault needs sliding-window layers, which
every model file has.)"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from swafactory.config.schema import SwaFactoryConfig
from swafactory.errors import Reason

__all__ = ["FAULT_NEEDS", "FaultNeed", "faults_rule"]


@dataclass(frozen=True)
class FaultNeed:
    """``holds(cfg)``: the fault can act; else ``field`` is what lacks it, ``fix`` supplies it."""

    holds: Callable[[SwaFactoryConfig], bool]
    field: str
    what: str
    fix: str


FAULT_NEEDS: dict[str, FaultNeed] = {
    "graph_pad_stale_swa_loc": FaultNeed(
        lambda c: c.backend.cuda_graph, "backend.cuda_graph", "CUDA-graph replay",
        "backend.cuda_graph=true"),
    "graph_key_without_mode": FaultNeed(
        lambda c: c.backend.cuda_graph and c.spec.algorithm != "none", "backend.cuda_graph",
        "CUDA-graph replay of a draft's passes (a spec's draft_decode and draft_extend share "
        "buckets)", "backend.cuda_graph=true spec=dflash"),
    "fp8_descale_dropped": FaultNeed(
        lambda c: c.backend.kv_dtype.startswith("fp8"), "backend.kv_dtype", "fp8 KV",
        "backend.kv_dtype=fp8_e4m3"),
    "paged_free_stale_mapping": FaultNeed(
        lambda c: c.backend.page_size > 1, "backend.page_size", "pages of more than one slot",
        "backend.page_size=16"),
    "sink_dropped": FaultNeed(
        lambda c: c.model.attention_sinks, "model.attention_sinks", "a model with attention sinks",
        "model=gpt_oss_20b"),
    "tree_mask_not_rebased": FaultNeed(
        lambda c: c.spec.topk > 1, "spec.topk", "a draft tree (topk > 1)", "spec=eagle3"),
    "premature_free_on_reject": FaultNeed(
        lambda c: c.spec.algorithm != "none", "spec.algorithm", "rejected drafts", "spec=eagle"),
}


def faults_rule(cfg: SwaFactoryConfig, *_) -> Iterator[Reason]:
    """A reason per switched-on fault whose need ``cfg`` lacks."""
    for name in cfg.faults.active:
        need = FAULT_NEEDS.get(name)
        if need is not None and not need.holds(cfg):
            yield Reason(need.field.split(".")[0], need.field,
                         f"faults={cfg.faults.name} acts only with {need.what}, which this "
                         f"configuration lacks: the run could not show the fault", need.fix,
                         rule="faults")
