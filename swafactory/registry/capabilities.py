"""What a backend can run, as data. Importable with no GPU package installed."""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Capabilities"]


@dataclass(frozen=True)
class Capabilities:
    """A backend's declared abilities; `registry.check` turns them into reasons.

    ``None`` in a set-valued field means "any".
    """

    name: str
    """Registry key."""
    summary: str
    """One line: which kernels serve which modes."""
    kernel: str
    """Short kernel label for plan tables."""
    devices: frozenset[str]
    """Device kinds it runs on (`cpu`, `cuda`)."""
    devices_note: str = ""
    """Why a device kind is missing, when that is not obvious."""
    cuda_archs: frozenset[int] | None = None
    """SM versions it runs on (90 = Hopper, 100 = Blackwell); None = any CUDA device."""
    arch_note: str = ""
    """Why the arch set is what it is."""
    cpu_needs_interpreter: bool = False
    """Runs on CPU only under TRITON_INTERPRET=1 (tests, tiny shapes)."""
    requires: tuple[tuple[str, str], ...] = ()
    """(importable module, pip requirement) pairs it needs."""
    page_sizes: frozenset[int] | None = None
    """Page sizes it serves; None = any."""
    head_dims: frozenset[int] | None = None
    """Head dims it serves; None = any."""
    max_head_dim: int | None = None
    """Largest head dim it serves; None = no limit."""
    head_dim_note: str = ""
    """Why the head-dim limit is what it is."""
    per_group_geometry: bool = True
    """Serves SWA and full groups of different KV heads / head_dim in one model."""
    sliding_window: bool = True
    """Masks or trims keys outside a window."""
    tree_masks: frozenset[str] = frozenset()
    """Tree-verify strategies (`custom_mask`, `cascade`); empty = no trees (topk > 1)."""
    paged_trees: bool = True
    """Tree verify with page_size > 1 (sglang rule: FA3 asserts page_size == 1 there)."""
    non_causal_draft: bool = True
    """Non-causal attention inside a drafted block (DFlash)."""
    lse: bool = True
    """Returns the log-sum-exp (needed for cascade merges)."""
    sinks: bool = False
    """Attention sinks (GPT-OSS)."""
    draft_sink: bool = False
    """Sink keys beside a draft window (``spec.draft_sink``): each request's first keys read
    with its window, a second key range."""
    sinks_note: str = ""
    """Why sinks are or are not served."""
    softcap: bool = False
    """Logit soft-capping."""
    cuda_graph: bool = False
    """Decode/verify can be captured in CUDA graphs."""
    graph_emulation: bool = False
    """On CPU, ``backend.cuda_graph=true`` runs the graph contract without CUDA graphs: a bucket's
    step is recorded once over static buffers and each replay re-runs it over the same buffers,
    refilled in place (bucket padding and in-place refill, testable without a GPU)."""
    kv_dtypes: frozenset[str] = field(default_factory=lambda: frozenset({"float16", "bfloat16"}))
    """KV storage dtypes."""
    fp8_max_head_dim: int | None = None
    """Largest head dim its fp8 KV path serves on the SM versions in `fp8_limited_archs`."""
    fp8_limited_archs: frozenset[int] = frozenset()
    """Where `fp8_max_head_dim` applies (other archs serve fp8 at every head dim it serves)."""
    fp8_note: str = ""
    """Why the fp8 head-dim limit is what it is."""

    def replays_graphs(self, device_kind: str) -> bool:
        """Serves ``backend.cuda_graph=true`` on ``device_kind`` (captured on CUDA, emulated on
        CPU)."""
        return self.cuda_graph if device_kind == "cuda" else self.graph_emulation
