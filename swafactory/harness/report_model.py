"""What a conformance run measured: `Report`, validated by pydantic and written as report.json."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ModeStats", "StepRecord", "Mismatch", "Report"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModeStats(_Model):
    """Forwards and oracle checks of one (worker, mode)."""

    worker: str
    """`target` or `draft`."""
    mode: str
    """Forward mode (`extend`, `decode`, `target_verify`, `draft_decode`, `draft_extend`)."""
    forwards: int = 0
    """Forwards run."""
    attention_calls: int = 0
    """Layer calls run (forwards × layers attended)."""
    checks: int = 0
    """Layer calls compared with the oracle."""
    passed: int = 0
    """Checks within tolerance."""
    max_rel_err: float = 0.0
    """Largest relative error among the checks."""


class StepRecord(_Model):
    """One scheduler step, for the plots."""

    step: int
    kind: str
    """`prefill` or `decode` (a spec step counts as decode)."""
    running: int
    """Requests running after the step."""
    swa_use: float
    """Used / total SWA-pool slots (full pool for an unsplit model) after the step."""
    full_use: float
    """Used / total full-index slots after the step."""
    max_rel_err: float
    """Largest relative error of the step's checks (0 when none was checked)."""
    accept_len: float | None = None
    """Mean accepted tokens per request in a spec step (None otherwise)."""
    evicted: int = 0
    """SWA positions evicted in the step."""


class Mismatch(_Model):
    """The first oracle mismatch (or caught fault) that stopped the run."""

    step: int
    worker: str
    mode: str
    layer: int
    group: str
    request: str
    error: str
    check: str
    """Which check caught it: `oracle`, `nan`, `space` (typed index spaces), `capacity`, or
    `kernel` (a kernel raised)."""


class Report(_Model):
    """The whole run."""

    status: Literal["ok", "failed"]
    combination: str
    device: str
    backend: str
    """Resolved backend (after `auto`)."""
    parts: dict[str, str]
    """Which shared parts served the run (resolver policy, planner, kernel, tree strategy, …)."""
    fault: str | None = None
    """The fault injected, if any."""
    layers_attended: list[int]
    """Target layers that ran attention (a subset in `smoke`)."""
    draft_layers: int
    """Draft layers that ran attention."""
    requests: int
    steps: int
    mode_stats: list[ModeStats]
    checks: int
    passed: int
    max_rel_err: float
    tolerance: float
    peak_swa_use: float
    """Peak used / total SWA slots."""
    peak_full_use: float
    evictions: int
    """SWA positions evicted over the run."""
    hybrid_bytes: int
    """Bytes of the target pools as allocated (hybrid)."""
    full_only_bytes: int
    """Bytes a full-only pool would need for the same full slots."""
    draft_pool_bytes: int
    accept_len: float | None = None
    """Mean accepted tokens per request per spec step (the bonus token included)."""
    attention_ms_per_step: float
    planning_ms_per_step: float
    tokens_per_s: float
    """Tokens committed per second of wall time (oracle checks included)."""
    wall_s: float
    peak_device_bytes: int | None = None
    """The run's peak CUDA memory held by torch (allocator peak; None on CPU): pools,
    histories, the oracle's scores and the kernels' workspaces together."""
    tp: int = 1
    """Tensor-parallel ranks (heads sharded; outputs all-gathered before the oracle check)."""
    rank_attention_ms: list[float] = Field(default_factory=list)
    """Attention time per step on each rank (tp > 1)."""
    gather_ms_per_step: float = 0.0
    """All-gather time per step on rank 0 (tp > 1)."""
    history: list[StepRecord] = Field(default_factory=list)
    mismatch: Mismatch | None = None
