"""The fault catalog's switches: one field per known engine bug, each planted inside the shared
parts (`backend.faulty`, the pools, the planner) only when it is on."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["FaultsSpec"]


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class FaultsSpec(_Frozen):
    """Fault-injection switches inside the shared parts; each reproduces a known engine bug."""

    name: str = "none"
    """Config-group key (the YAML file's stem)."""
    skip_spec_translation: bool = False
    """Spec/tree tables of SWA groups stay in full space (FA3 + EAGLE3 topk > 1, sglang #24402)."""
    allocator_pool_for_own_pool_draft: bool = False
    """An own-pool draft resolves the allocator's SWA pool (FlashInfer + DFlash, sglang #27737)."""
    swa_pool_missed: bool = False
    """An own draft's SWA-backed pool is missed by a check keyed on the allocator: its writes are
    translated, its reads keep full slots (FlashInfer + DFlash on Gemma 4, sglang #27737)."""
    pool_cached_at_init: bool = False
    """The backend keeps the pool it saw at construction (trtllm_mha + FROZEN_KV, sglang #26957)."""
    window_off_by_one: bool = False
    """Sliding layers see W + 1 keys."""
    no_swa_eviction: bool = False
    """Out-of-window SWA slots are never freed (sglang #33805)."""
    no_draft_headroom: bool = False
    """The own draft pool gets half the target's full capacity (sglang #17630)."""
    leak_rejected_draft_slots: bool = False
    """Rejected draft slots are freed in the full pool but not in the SWA pool (spec-decoding
    leak; sglang's "SWA Pool Mem Leak", #27789)."""
    plan_without_window: bool = False
    """SWA groups are planned without their window: the key lists are still trimmed, but no
    kernel masks the window (FlashInfer planned without window_left, sglang #31501, #35208)."""
    sink_dropped: bool = False
    """Kernels accept the attention sinks and ignore them (FlashInfer 0.6/0.7 FA2/FA3 paged runs
    on SM90; vLLM #49795, #52148, sglang #11634)."""
    fp8_descale_dropped: bool = False
    """The full-attention layers read fp8 K/V without their scales (one path drops the descale;
    vLLM #42580, #41651)."""
    tree_mask_not_rebased: bool = False
    """Tree verify trims the prefix by depth, but nodes' positions (so the window bound) come from
    their flat slot index, not their depth (sglang #39160, #39287, #9279, #32269)."""
    paged_free_stale_mapping: bool = False
    """With pages > 1, SWA eviction frees whole pages but zeroes the full→SWA mapping per token:
    the page's other positions stay mapped to a free SWA page (sglang #27779)."""
    premature_free_on_reject: bool = False
    """SWA slots are evicted against the step's speculative length before rejected drafts move
    the boundary back, so slots still in the window are freed (vLLM #47728, #47282)."""
    graph_pad_stale_swa_loc: bool = False
    """On CUDA-graph replay, the SWA groups' padding rows keep the write slots of an earlier,
    larger replay: padding K/V lands in live SWA slots of other requests (sglang #24743)."""
    graph_key_without_mode: bool = False
    """Captured graphs are keyed by their shape (requests × tokens) alone: a graph captured in
    one forward mode replays another mode's batch of that shape, its kernels reading the tables
    of the captured mode's pass, which that replay never refilled (a captured FlashInfer wrapper
    of draft_decode replayed over draft_extend's plan)."""
    block_window_one_left_bound: bool = False
    """A DFlash block or verify is planned with one left window bound for the whole block (its
    first query's): query j sees j keys its own window excludes (sglang #35208)."""
    draft_planned_with_group0: bool = False
    """The draft's layers are planned with the target's group 0 (its first layer's window), not
    their own: a windowed draft reads the target's window (vLLM #50169, vllm-ascend #16980)."""
    windowed_draft_admitted_as_full: bool = False
    """Admission counts a window-retained draft's K/V at the whole sequence, as if it were
    full attention: a request longer than the SWA share is never admitted (vLLM #55800)."""
    swa_metadata_missing_in_spec_modes: bool = False
    """Target verify and draft extend plan their SWA layers with no window: their lists start
    at position 0 and read freed slots (sglang #22679: EAGLE / MTP on SWA targets)."""
    window_gather_from_zero: bool = False
    """A verify's SWA key lists keep their window's length and positions but gather the
    request's first keys (sglang #39160, #39287)."""
    verify_rows_share_write_loc: bool = False
    """One metadata for every verify row: each SWA group writes all of a request's rows at its
    first row's slot (atlas #745)."""
    verify_as_decode: bool = False
    """A verify runs through the multi-token decode path: no mask, every row sees the step's
    later tokens (flashinfer #3864, #4382)."""
    graph_draft_extend_untranslated: bool = False
    """The draft-extend graph path never builds its SWA window indices: a replay reads the SWA
    groups with full slots, an eager run does not (sglang #29858)."""
    lookahead_not_retained: bool = False
    """SWA eviction does not count a draft's lookahead block in what it must retain: it frees
    a block past what the next query needs (vLLM #42784, #44082)."""
    frozen_draft_fp8_unscaled: bool = False
    """A FROZEN_KV (MTP) draft aliases the target's fp8 K/V without its scales (vLLM #48666)."""

    @property
    def active(self) -> list[str]:
        """Names of the switches that are on."""
        return [k for k, v in self.model_dump().items() if v is True]
