"""What each fault needs to bite, as data: a fault switched on where it cannot act would let a
green run pass as proof. `faults_rule` turns each missing need into a reason naming the fault,
what it needs, the field's value and the override that supplies it. These needs are the
configuration's alone, whatever the backend: `registry.select` refuses them before choosing one.
What the workload decides at run time (a batch that never shrinks, a draft never rejected) is
left to the run, which ends `inert` (`outputs.inert`). (Every fault needs sliding-window layers,
which every model file has.)"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from swafactory.config.schema import SwaFactoryConfig
from swafactory.errors import Reason

__all__ = ["FAULT_NEEDS", "FaultNeed", "faults_rule", "fault_needs_unmet"]


@dataclass(frozen=True)
class FaultNeed:
    """``holds(cfg)``: the fault can act; else ``field`` lacks ``needs`` (``what``, in words)
    and ``fix`` supplies it."""

    holds: Callable[[SwaFactoryConfig], bool]
    field: str
    needs: str
    what: str
    fix: str


def _split(fix: str = "model.hybrid_pool=true") -> FaultNeed:
    # eviction, the full→SWA mapping and SWA-space tables exist only in a split pool
    return FaultNeed(lambda c: c.model.hybrid_pool, "model.hybrid_pool", "model.hybrid_pool=true",
                     "an SWA sub-pool beside the full one", fix)


def _drafts(fix: str, what: str = "rejected drafts") -> FaultNeed:
    return FaultNeed(lambda c: c.spec.algorithm != "none", "spec.algorithm",
                     "a speculative spec (not spec=none)", what, fix)


def _tree(fix: str = "spec=eagle3") -> FaultNeed:
    return FaultNeed(lambda c: c.spec.topk > 1, "spec.topk", "spec.topk > 1", "a draft tree", fix)


def _draft_kv(kind: str, what: str, fix: str) -> FaultNeed:
    return FaultNeed(lambda c: c.spec.draft_kv == kind, "spec.draft_kv", f"spec.draft_kv={kind}",
                     what, fix)


_GRAPHS = FaultNeed(lambda c: c.backend.cuda_graph, "backend.cuda_graph", "backend.cuda_graph=true",
                    "CUDA-graph replay", "backend.cuda_graph=true")

FAULT_NEEDS: dict[str, tuple[FaultNeed, ...]] = {
    "graph_pad_stale_swa_loc": (_GRAPHS,),
    "graph_key_without_mode": (_GRAPHS, _drafts("spec=dflash", "a draft's passes (its "
                                                "draft_decode and draft_extend share buckets)")),
    "fp8_descale_dropped": (FaultNeed(
        lambda c: c.backend.kv_dtype.startswith("fp8"), "backend.kv_dtype",
        "backend.kv_dtype=fp8_e4m3", "fp8 KV", "backend.kv_dtype=fp8_e4m3"),),
    "paged_free_stale_mapping": (FaultNeed(
        lambda c: c.backend.page_size > 1, "backend.page_size", "backend.page_size > 1",
        "pages of more than one slot", "backend.page_size=16"), _split()),
    "sink_dropped": (FaultNeed(
        lambda c: c.model.attention_sinks, "model.attention_sinks", "model.attention_sinks=true",
        "a model with attention sinks", "model=gpt_oss_20b"),),
    "tree_mask_not_rebased": (_tree(),),
    "skip_spec_translation": (_tree(), _split()),
    "allocator_pool_for_own_pool_draft": (
        _draft_kv("own_pool", "a draft with its own pool", "spec=dflash"), _split(),
        # a split draft pool is its own source: the allocator's is never asked
        FaultNeed(lambda c: not getattr(c.spec, "draft_pool_split", False),
                  "spec.draft_pool_split", "spec.draft_pool_split=false",
                  "a full-indexed own draft pool", "spec.draft_pool_split=false")),
    # (only DFlash has the field: a split own pool implies its own pool)
    "swa_pool_missed": (
        _split(),
        FaultNeed(lambda c: getattr(c.spec, "draft_pool_split", False), "spec.draft_pool_split",
                  "spec.draft_pool_split=true", "an own draft pool split like the target's",
                  "spec=dflash spec.draft_pool_split=true")),
    # only a FROZEN_KV draft's view moves off the pool it was built with
    "pool_cached_at_init": (_draft_kv("target_pool", "a draft that reads the target's pool",
                                      "spec=frozen_kv_mtp"),),
    "no_draft_headroom": (
        _draft_kv("own_pool", "a draft with its own pool", "spec=eagle"),
        # the conformance harness builds the short draft pool; run=generate sizes its own
        FaultNeed(lambda c: c.run.mode != "generate", "run.mode", "run=conformance",
                  "the conformance run's draft pool", "run=conformance")),
    "leak_rejected_draft_slots": (_drafts("spec=eagle"), _split()),
    "premature_free_on_reject": (_drafts("spec=eagle"), _split()),
    "no_swa_eviction": (_split(),),
    "block_window_one_left_bound": (FaultNeed(
        lambda c: c.spec.algorithm == "dflash", "spec.algorithm", "spec=dflash",
        "a DFlash block, whose queries share one left bound", "spec=dflash"),),
    "draft_planned_with_group0": (_draft_kv("own_pool", "a draft with its own layers' windows",
                                            "spec=eagle3"),),
    "windowed_draft_admitted_as_full": (FaultNeed(
        lambda c: c.spec.draft_kv_retention == "window", "spec.draft_kv_retention",
        "spec.draft_kv_retention=window", "a draft whose K/V is kept for its window",
        "spec.draft_window=16 spec.draft_kv_retention=window"),),
    # the field's third round: verify and draft passes on SWA targets
    "swa_metadata_missing_in_spec_modes": (_drafts("spec=eagle", "a verify or a draft extend"),
                                           _split()),
    "window_gather_from_zero": (_drafts("spec=eagle", "a verify"), _split()),
    "verify_rows_share_write_loc": (_drafts("spec=eagle", "a verify of several rows"), _split()),
    "verify_as_decode": (_drafts("spec=eagle", "a verify of several rows"),),
    "graph_draft_extend_untranslated": (
        # (run=generate replays the draft's extend graphs; a conformance run that does not
        # ends inert, naming it)
        _GRAPHS,
        # a draft with SWA groups of its own: its K/V on the target's SWA slots
        FaultNeed(lambda c: c.spec.draft_kv_retention == "window"
                  or getattr(c.spec, "draft_pool_split", False), "spec.draft_kv_retention",
                  "spec.draft_kv_retention=window", "a draft whose SWA layers read SWA slots",
                  "spec.draft_window=16 spec.draft_kv_retention=window")),
    "lookahead_not_retained": (_drafts("spec=eagle", "a draft's lookahead"), _split()),
    "frozen_draft_fp8_unscaled": (
        _draft_kv("target_pool", "a draft that reads the target's pool", "spec=frozen_kv_mtp"),
        FaultNeed(lambda c: c.backend.kv_dtype.startswith("fp8"), "backend.kv_dtype",
                  "backend.kv_dtype=fp8_e4m3", "fp8 KV", "backend.kv_dtype=fp8_e4m3")),
}


def _value(cfg: SwaFactoryConfig, field: str) -> str:
    obj = cfg
    for part in field.split("."):
        obj = getattr(obj, part, None)
    return str(obj).lower() if isinstance(obj, bool) or obj is None else str(obj)


def fault_needs_unmet(cfg: SwaFactoryConfig) -> list[Reason]:
    """A reason per need of a switched-on fault that ``cfg`` lacks (any backend alike)."""
    out = []
    for fault in cfg.faults.active:
        for need in FAULT_NEEDS.get(fault, ()):
            if need.holds(cfg):
                continue
            who = f"faults={fault}" if cfg.faults.name == fault else \
                f"faults={cfg.faults.name}: {fault}"
            value = _value(cfg, need.field)
            out.append(Reason(need.field.split(".")[0], need.field,
                              f"{who} needs {need.needs} ({need.what}), got {need.field}={value}, "
                              "so it could not act",
                              need.fix, rule="faults_rule"))
    return out


def faults_rule(cfg: SwaFactoryConfig, *_) -> Iterator[Reason]:
    """`check`'s rule: the reasons of `fault_needs_unmet`."""
    yield from fault_needs_unmet(cfg)
