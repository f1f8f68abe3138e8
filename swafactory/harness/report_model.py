"""What a conformance run measured: `Report`, validated by pydantic and written as report.json,
and `Tick`, what a running job has done so far (for the progress output)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ModeStats", "StepRecord", "Mismatch", "Report", "Tick"]


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
    attention_ms: float = 0.0
    """Attention time of the step's forwards that were not a first use (all workers; CUDA events
    on a GPU, the host clock on CPU)."""
    planning_ms: float = 0.0
    """Metadata planning time (host clock) of the step's forwards that were not a first use."""
    first_use_ms: float = 0.0
    """Planning + attention (+ all-gather) time of the step's first-use forwards (`Report.first_use`);
    a step with any is left out of the steady-state per-step figures."""


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
    """Which check caught it: `oracle`, `nan`, `kv` (a row the forward read holds other data
    than its request wrote there, while the oracle passed: `harness.kv_check`), `space` (typed
    index spaces), `capacity`, `kernel` (a kernel raised), or `leak` (every request finished, yet
    a pool or `ReqToToken` is not back to its capacity; `Report.leaked` has the counts)."""


class Report(_Model):
    """The whole run."""

    status: Literal["ok", "inert", "failed"]
    """`failed`: a check caught a mismatch, a fault or a leak. `inert`: no check failed, but an
    injected fault never acted (`fault_acted`), so the run proves nothing; `inert` says what
    the workload lacked. `ok` otherwise."""
    combination: str
    device: str
    backend: str
    """Resolved backend (after `auto`)."""
    backend_choice: str | None = None
    """`backend=auto` only: what it chose and why (``auto → torch, bf16 KV: no CUDA device``)."""
    autotune: list[str] = []
    """`backend=auto` tuned on a GPU: each pass × group's choice with its measured time and the
    candidates that lost (`swafactory.backend.timing`); empty otherwise."""
    parts: dict[str, str]
    """Which shared parts served the run (resolver policy, planner, kernel, tree strategy, …)."""
    kernels: list[str] = []
    """What served each pass × layer group and why, per worker, as resolved when its backend
    was built (`backend.kernels`; e.g. ``target verify/full: cuda verify_d512 + triton extend
    tile (auto: nvcc present)``)."""
    fault: str | None = None
    """The fault injected, if any."""
    fault_acted: dict[str, int] = Field(default_factory=dict)
    """Each injected fault → the times it changed something (a write, a plan, a mapping, a
    free: `swafactory.fault_counts`). Empty without a fault."""
    inert: str | None = None
    """Why the run is `inert`: each fault that never acted, what the workload lacked, what to
    try (`swafactory.outputs.inert`)."""
    layers_attended: list[int]
    """Target layers that ran attention (a subset in `quick` and `smoke`)."""
    draft_layers: int
    """Draft layers that ran attention."""
    requests: int
    steps: int
    mode_stats: list[ModeStats]
    checks: int
    passed: int
    max_rel_err: float
    tolerance: float
    kv_quant_error: float | None = None
    """fp8 KV: the largest relative error of a checked output against attention over the K/V
    before the pool rounded them (what fp8 costs against the model's bf16); the check itself
    (`max_rel_err`) is against the rounded history. None without fp8 KV."""
    peak_swa_use: float
    """Peak used / total SWA slots."""
    peak_full_use: float
    evictions: int
    """SWA positions evicted over the run."""
    hybrid_bytes: int
    """Bytes of the target pools (hybrid) at the run's slot counts, every layer counted."""
    full_only_bytes: int
    """Bytes a full-only pool would need for the same full slots, every layer counted."""
    draft_pool_bytes: int
    held_bytes: int | None = None
    """Bytes the run's pools really took (target, draft): with `workload.layers=subset` only
    the attended layers get rows. None in reports written before it was recorded."""
    accept_len: float | None = None
    """Mean accepted tokens per request per spec step (the bonus token included)."""
    attention_ms_per_step: float
    """Steady-state attention time per step (ms): the mean over the steps in which no forward was
    a first use (`first_use_s`). Every step, first uses subtracted, when no step was steady."""
    planning_ms_per_step: float
    """Steady-state metadata planning time per step (ms), over the same steps."""
    first_use_s: float = 0.0
    """Seconds spent in first-use forwards, kept out of the per-step figures: the planning,
    attention and (tp > 1) all-gather time of the first forward of each (worker, mode) run eagerly
    and of each CUDA-graph bucket's first forward (warm-up + capture). JIT compiles (FlashInfer,
    Triton), autotuning, lazy workspace allocation and NCCL set-up land here. Host clock for
    planning, CUDA events (which span a host-side compile) or the host clock for attention."""
    first_use: dict[str, float] = Field(default_factory=dict)
    """`first_use_s` by forward: `worker/mode` (eager) or `worker/mode graph bs=N` → seconds."""
    steady_steps: int = 0
    """Steps the steady-state per-step figures average over."""
    tokens_per_s: float
    """Tokens committed per second of wall time (oracle checks included)."""
    wall_s: float
    peak_device_bytes: int | None = None
    """The run's peak CUDA memory held by torch (allocator peak; None on CPU): pools,
    histories, the oracle's scores and the kernels' workspaces together."""
    graph_state_bytes: int = 0
    """Bytes of the CUDA-graph static state the run's backends hold (write slots, the kernels'
    graph buffers: `AttentionBackend.graph_state_bytes`); sized by bucket and context, not by
    the pool. 0 without graphs."""
    tp: int = 1
    """Tensor-parallel ranks (heads sharded; outputs all-gathered before the oracle check)."""
    rank_attention_ms: list[float] = Field(default_factory=list)
    """Attention time per step on each rank (tp > 1)."""
    gather_ms_per_step: float = 0.0
    """All-gather time per step on rank 0 (tp > 1)."""
    leaked: dict[str, int] = Field(default_factory=dict)
    """Slots, per pool (`target.full`, `target.swa`, `draft.full`, …; rows for `req_to_token`,
    slots both free and mapped for `free_and_mapped`) that no request held once every request had
    finished (`swafactory.harness.leaks.leaked`). Any value > 0 fails the run with the `leak` check.
    Empty when the run stopped before every request finished."""
    history: list[StepRecord] = Field(default_factory=list)
    mismatch: Mismatch | None = None


@dataclass(frozen=True)
class Tick:
    """What a running conformance job has done so far, sent to `run(on_progress=…)` after every
    step, and before a first-use forward (``compiling`` set: on CUDA its kernels compile then)."""

    step: int
    """Scheduler steps done."""
    est_steps: int
    """Total steps: estimated (`swafactory.harness.estimate.estimate_steps`, raised to ``step``
    when the run goes past it) until every request has finished, then the real count."""
    finished: int
    """Requests finished."""
    requests: int
    checks: int
    """Oracle checks so far."""
    passed: int
    peak_swa_use: float
    """Peak used / total SWA slots so far (the full pool for an unsplit model)."""
    peak_full_use: float
    elapsed_s: float
    compiling: str | None = None
    """`worker/mode` whose first forward is about to run (CUDA only; None on a step's tick)."""
