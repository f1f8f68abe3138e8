"""What a generation run measured: `GenerateReport`, validated by pydantic, written as report.json.

It carries enough to check the tokens without swafactory: the transformers config dict and the
seed (``torch.manual_seed(seed)`` then ``AutoModelForCausalLM.from_config(config)`` rebuilds the
weights), each request's prompt and generated ids, and the accept lengths.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

__all__ = ["Rejection", "RequestRecord", "GenStep", "CheckResult", "GenerateReport", "CHECK_ORDER",
           "SpecMetrics"]

CHECK_ORDER = ("space", "nan", "oracle", "kernel", "capacity", "leak", "logits", "draft_logits",
               "lossless", "overlap", "acceptance", "spec_metrics")
"""Every check, in the order that names the one that caught a failure (`GenerateReport.caught_by`;
`failed_checks` lists all): the guards, the attention oracle (``run.oracle``: a pass's rows
against the fp32 oracle over each request's logical history) and a kernel fault stop the run
where they happen; then
the logits against transformers (the target's, then a writing draft's own), which locate a wrong
read most precisely; then what a user sees: tokens that differ from spec=none (or, with
``run.overlap=true``, from the same run without overlap), acceptance."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Rejection(_Model):
    """A chain step's first rejected draft: where the target's argmax and the draft's proposal
    parted, and by how much each preferred its own token. Gaps are logit differences over the
    row's largest |logit| (at least 1), the scale of the tie tolerance: both gaps small is
    rounding (two forwards of another shape); a draft sure of a token the target rejects
    by a wide gap read something else (a stale or wrong key)."""

    step: int
    """The request's spec step (index into ``accept_lengths``)."""
    position: int
    """The logits position of the rejection (the accepted path's last node)."""
    target_token: int
    draft_token: int
    target_gap: float
    """(target[target_token] - target[draft_token]) / max(1, max |target|)."""
    draft_gap: float | None
    """(draft[draft_token] - draft[target_token]) / max(1, max |draft|); None where the draft's
    row was not kept (a tree, a DFlash block)."""
    exact_gap: float | None = None
    """The same for the target's weights in fp64 on the same tokens (the ``logits`` check's
    forward, no swafactory in the loop): (fp64[target_token] - fp64[draft_token]) /
    max(1, max |fp64|). Near 0: a true near tie, which rounding may break either way."""


class SpecMetrics(_Model):
    """Speculative decoding's figures for one request or a whole run, with vLLM's per-response
    field names (`spec_metrics.py` computes them and checks them against each other)."""

    num_spec_steps: int
    """Verify steps (sglang's ``spec_verify_ct``)."""
    num_draft_tokens: int
    """Draft tokens sent to verification: the verified tokens of each step but its root."""
    num_accepted_tokens: int
    """Draft tokens the target accepted (each step's committed tokens but its bonus)."""
    mean_acceptance_length: float | None
    """Tokens committed per spec step, the bonus included (sglang's ``spec_accept_length``)."""
    draft_acceptance_rate: float | None
    """num_accepted_tokens / num_draft_tokens."""
    acceptance_histogram: list[int]
    """Entry a: the spec steps that committed a tokens."""
    completion_tokens: int
    """Tokens generated, a last step's past ``max_new_tokens`` included."""
    non_spec_tokens: int
    """Of those, the tokens no spec step committed: the prefill's, a plain decode's."""


class RequestRecord(_Model):
    """One request: what it was asked and what it produced."""

    rid: int
    prompt_ids: list[int]
    generated_ids: list[int]
    """Greedy tokens, the first ``max_new_tokens`` (a last spec step may accept more)."""
    max_new_tokens: int
    accept_lengths: list[int]
    """Tokens committed per spec step (the root plus the accepted drafts)."""
    accept_lengths_clean: list[int] | None = None
    """The same request's accept lengths in the clean twin (a run with a fault and a draft of
    its own weights), step by step: where a fault makes the accept length fall over time."""
    tie_positions: list[int] = []
    """Positions where the target's top two logits were within the tie tolerance."""
    rejections: list[Rejection] = []
    """Each chain step's first rejected draft (none where every draft was accepted)."""
    accept_histogram: list[int] = []
    """Spec steps that committed each length: entry a counts the steps that committed a tokens
    (entry 0 stays 0: a step always commits its root)."""
    spec_metrics: SpecMetrics | None = None
    """This request's spec figures (None without a spec algorithm)."""


class GenStep(_Model):
    """One scheduler step, for the plot."""

    step: int
    kind: Literal["prefill", "decode", "spec"]
    running: int
    accept_len: float | None = None
    """Mean accept length of the step's requests (spec steps)."""
    accept_min: int | None = None
    evicted: int = 0
    swa_use: float = 0.0
    full_use: float = 0.0


class CheckResult(_Model):
    """One end-to-end check."""

    name: str
    status: Literal["ok", "failed", "skipped"]
    detail: str


class GenerateReport(_Model):
    """A `run=generate` job's result (report.json)."""

    status: Literal["ok", "inert", "failed"]
    """`failed`: a check failed. `inert`: no check failed, but an injected fault never acted
    (`fault_acted`), so the run proves nothing; `inert` says what the workload lacked."""
    combination: str
    device: str
    backend: str
    kernels: list[str] = []
    """What served each pass × layer group and why, per runner, as resolved when its backend
    was built (`backend.kernels`)."""
    autotune: list[str] = []
    """`backend=auto` tuned on a GPU: each pass × group's choice with its measured time and the
    candidates that lost (`swafactory.backend.timing`); empty otherwise."""
    transformers: str
    """transformers version the model was built with."""
    architecture: str
    checkpoint: str | None
    seed: int
    """``torch.manual_seed(seed)`` before ``from_config`` (random weights) and the prompt draws."""
    hf_config: dict[str, Any]
    """The target's transformers config (``config.to_dict()``)."""
    post_init: dict[str, float] = {}
    """Parameters set to a constant after ``from_config`` (`models.hf.post_init`): rebuild
    with ``model.get_parameter(name).data.fill_(value)``."""
    serving_model: dict[str, Any]
    """The `ModelSpec` the backend served, read from the model's attention modules."""
    spec: str
    draft: str
    """What the draft is (weights, pool)."""
    fault: str | None
    fault_acted: dict[str, int] = {}
    """Each injected fault → the times it changed something in the main run (a write, a plan, a
    mapping, a free: `swafactory.fault_counts`). Empty without a fault."""
    inert: str | None = None
    """Why the run is `inert`: each fault that never acted and what to try."""
    guards: bool
    dtype: str
    requests: list[RequestRecord]
    steps: list[GenStep]
    logits_max_rel_err: float | None
    """max |logits - HF eager| / max |HF eager| over every generated position."""
    logits_tolerance: float
    """The dtype's floor (1e-4 fp32, 1e-1 16-bit) or 4 × transformers' own eager error against
    the same weights in fp64, the larger."""
    logits_positions: int
    lossless: bool | None
    """Greedy tokens equal spec=none's (None: spec=none itself, or the run stopped)."""
    accept_len: float | None
    """Mean accept length over every spec step."""
    max_accept_len: int | None = None
    """The most tokens one spec step can commit with this spec (chain length, verified tree
    depth + 1, DFlash block): the ideal a perfect draft would reach."""
    spec_metrics: SpecMetrics | None = None
    """The run's spec figures over every request (None without a spec algorithm)."""
    accept_len_clean: float | None = None
    """A draft of its own weights, with a fault on: the clean twin's mean accept length (the same
    config with faults=none, run in the same process), beside ``accept_len``."""
    target_training: dict[str, Any] | None = None
    """``run.target_weights=pretrained``: how the target was trained (`drafts.train.Trained`)."""
    draft_training: dict[str, Any] | None = None
    """``spec.draft_weights=distilled``: the draft's training: steps, seconds, final loss, held-out
    top-1 agreement with the target, whether it came from the cache, and its directory."""
    ideal_accept_len: float | None
    """num_steps + 1 (a chain), depth + 1 (a tree's verified greedy path); None where no ideal
    exists (frozen_kv_mtp, dflash: compared with the torch backend step by step)."""
    checks: list[CheckResult]
    caught_by: str | None
    """The first failing check in `CHECK_ORDER` (None when ok)."""
    failed_checks: list[str] = []
    """Every failing check, in `CHECK_ORDER`."""
    error: str | None = None
    """The exception that stopped the run, if one did."""
    wall_s: float
    """The generation loop's wall time: from the first step to the last, after start-up (the
    pools, a draft's distillation, every CUDA graph captured)."""
    tokens_per_s: float
    """Generated tokens over `wall_s`."""
    overlap: bool = False
    """``run.overlap``: the run planned each forward before the last one's tokens came back."""
    tokens_per_s_no_overlap: float | None = None
    """With ``run.overlap=true``: tokens/s of the same run without overlap (run after it, so
    any warm-up lands on the overlap run)."""
    reference_s: float
    """Wall time of the reference runs (spec=none, the torch backend) and the eager forwards."""
    cuda_graphs: dict[str, dict[str, int]] | None = None
    """``backend.cuda_graph=true``: per runner, graphs captured, forwards replayed, forwards run
    eagerly (prefills, and batches past the largest bucket)."""
    graph_state_bytes: int = 0
    """Bytes of the runners' CUDA-graph static state (`AttentionBackend.graph_state_bytes`):
    sized by bucket and context, not by the pool. 0 without graphs."""
