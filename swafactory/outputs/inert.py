"""A run whose fault never acted proves nothing: its status is ``inert``, not ok.

The fault branches count the times they changed something (`swafactory.fault_counts`); the
registry refuses a fault whose configuration cannot act at all (`registry.fault_needs`). What
is left is a workload that gives the fault nothing to change: `inert_message` names, per fault,
what the workload lacked and a launch that has it.
"""
from __future__ import annotations

from collections.abc import Mapping

__all__ = ["LACKS", "inert_message"]

LACKS: dict[str, tuple[str, str]] = {
    # fault → (what the workload lacked, what to try)
    "graph_pad_stale_swa_loc": ("no batch shrank inside a graph bucket",
                                "workload=smoke (four requests at once)"),
    "graph_key_without_mode": ("no graph replayed a batch of another route than its capture's "
                               "(no two modes shared a bucket)",
                               "run=generate backend.cuda_graph=true spec=dflash"),
    "window_off_by_one": ("no sliding layer listed the key W positions back (no request passed "
                          "its window)", "workload=smoke"),
    "plan_without_window": ("no SWA group listed more keys than its window (a chunk's later "
                            "queries, or page slack)", "workload=smoke"),
    "skip_spec_translation": ("no tree forward reached an SWA group", "spec=eagle3"),
    "tree_mask_not_rebased": ("no tree node's flat position moved its window bound past key 0",
                              "spec=eagle3 workload=smoke"),
    "allocator_pool_for_own_pool_draft": ("no own-pool draft forward resolved against a split "
                                          "allocator pool", "spec=dflash"),
    "swa_pool_missed": ("no own split draft pool read an SWA key list",
                        "spec=dflash spec.draft_pool_split=true"),
    "pool_cached_at_init": ("the runner's view never moved off the pool it was built with",
                            "spec=frozen_kv_mtp"),
    "no_swa_eviction": ("no request passed its window by the eviction interval",
                        "workload=smoke"),
    "no_draft_headroom": ("no own draft pool was built short", "spec=eagle"),
    "leak_rejected_draft_slots": ("no draft token was rejected (a self-draft accepts all)",
                                  "spec=eagle with the conformance run, whose drafts miss"),
    "premature_free_on_reject": ("no rejection moved the eviction frontier back into the window",
                                 "spec=eagle with the conformance run, whose drafts miss"),
    "paged_free_stale_mapping": ("no eviction frontier stopped inside a page",
                                 "backend.page_size=16"),
    "fp8_descale_dropped": ("no full layer read fp8 K/V with a scale other than 1",
                            "backend.kv_dtype=fp8_e4m3"),
    "sink_dropped": ("no forward passed sinks", "model=gpt_oss_20b"),
    "block_window_one_left_bound": ("no DFlash block or verify listed more keys than its "
                                    "window (no request passed it)",
                                    "spec=dflash spec.draft_window=16 workload=smoke"),
    "windowed_draft_admitted_as_full": ("no request was longer than the SWA share",
                                        "workload=smoke"),
    "draft_planned_with_group0": ("no draft layer listed a key one window reads and the other "
                                  "does not (no request passed the narrower window)",
                                  "spec=eagle3 spec.draft_window=16 workload=smoke"),
    "swa_metadata_missing_in_spec_modes": ("no verify or draft extend listed a key past its SWA "
                                           "window (no request passed it)", "workload=smoke"),
    "window_gather_from_zero": ("no verify's SWA list started past position 0",
                                "spec=eagle workload=smoke"),
    "verify_rows_share_write_loc": ("no verify wrote more than one row of a request",
                                    "spec=eagle"),
    "verify_as_decode": ("no verify had more than one row per request", "spec=eagle"),
    "graph_draft_extend_untranslated": ("no draft extend replayed a graph over an SWA group",
                                        "run=generate backend.cuda_graph=true spec=eagle3 "
                                        "spec.draft_window=16 spec.draft_kv_retention=window"),
    "lookahead_not_retained": ("no decoding request passed its window (nothing was evicted)",
                               "spec=eagle workload=smoke"),
    "frozen_draft_fp8_unscaled": ("no draft read fp8 K/V with scales other than 1",
                                  "spec=frozen_kv_mtp backend.kv_dtype=fp8_e4m3"),
}


def inert_message(acted: Mapping[str, int]) -> str | None:
    """Why the run is inert (every active fault in ``acted`` that never acted, with what the
    workload lacked and what to try), or None when each acted at least once."""
    idle = [name for name, n in acted.items() if n == 0]
    if not idle:
        return None
    parts = []
    for name in idle:
        lacked, fix = LACKS.get(name, ("nothing it changes", "its conf file's launch line"))
        parts.append(f"{name} never acted: {lacked}; try {fix}")
    return "; ".join(parts) + " (an inert fault's green run proves nothing)"
