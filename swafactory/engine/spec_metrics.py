"""Per-request speculative-decoding figures, as vLLM returns them in each response
(`mean_acceptance_length`, `draft_acceptance_rate`, `acceptance_histogram`, `num_spec_steps`,
accepted and draft token counts), and the run check that holds them to each other as sglang
does: accept length = spec-committed tokens / verify steps, the histogram sums to the verify
steps. A figure that a benchmark reads is then one that could not be off by one unnoticed.
"""
from __future__ import annotations

from collections.abc import Sequence

from swafactory.engine.report_model import CheckResult, SpecMetrics

__all__ = ["draft_tokens_per_step", "histogram", "request_metrics", "total_metrics",
           "spec_metrics_check"]


def draft_tokens_per_step(spec) -> int:
    """Draft tokens one step sends to verification: the verified tokens but the root (a chain's
    num_steps, a tree's verified nodes, a DFlash block's mask rows); 0 without a spec."""
    return max(0, spec.num_draft_tokens - 1)


def histogram(accepts: Sequence[int]) -> list[int]:
    """Counts of each accept length (index = length; entry 0 stays 0: a step commits its root)."""
    out = [0] * (max(accepts, default=0) + 1)
    for a in accepts:
        out[a] += 1
    return out


def request_metrics(accepts: Sequence[int], drafted: int, completion: int,
                    non_spec: int) -> SpecMetrics:
    """One request's figures. accepts: the tokens each spec step committed (root + accepted
    drafts); drafted: `draft_tokens_per_step`; completion: tokens generated; non_spec: those no
    spec step committed."""
    steps = len(accepts)
    accepted = sum(accepts) - steps  # each step's root is the bonus, not a draft
    return SpecMetrics(num_spec_steps=steps, num_draft_tokens=drafted * steps,
                       num_accepted_tokens=accepted,
                       mean_acceptance_length=sum(accepts) / steps if steps else None,
                       draft_acceptance_rate=accepted / (drafted * steps) if steps and drafted
                       else None, acceptance_histogram=histogram(accepts), completion_tokens=completion,
                       non_spec_tokens=non_spec)


def total_metrics(per_request: Sequence[SpecMetrics]) -> SpecMetrics:
    """The run's figures: the requests' counts summed, its rates over those sums."""
    steps = sum(m.num_spec_steps for m in per_request)
    drafted = sum(m.num_draft_tokens for m in per_request)
    accepted = sum(m.num_accepted_tokens for m in per_request)
    hist = [0] * max((len(m.acceptance_histogram) for m in per_request), default=1)
    for m in per_request:
        for a, n in enumerate(m.acceptance_histogram):
            hist[a] += n
    return SpecMetrics(num_spec_steps=steps, num_draft_tokens=drafted, num_accepted_tokens=accepted,
                       mean_acceptance_length=(accepted + steps) / steps if steps else None,
                       draft_acceptance_rate=accepted / drafted if drafted else None,
                       acceptance_histogram=hist,
                       completion_tokens=sum(m.completion_tokens for m in per_request),
                       non_spec_tokens=sum(m.non_spec_tokens for m in per_request))


def _broken(m: SpecMetrics, accepts: Sequence[int] | None) -> list[str]:
    """Each relation ``m`` breaks (accepts: the request's own accept lengths, where known)."""
    bad, steps = [], m.num_spec_steps
    spec_tokens = m.completion_tokens - m.non_spec_tokens
    counted = sum(m.acceptance_histogram)
    committed = sum(a * n for a, n in enumerate(m.acceptance_histogram))
    if counted != steps:
        bad.append(f"the histogram sums to {counted}, not the {steps} steps")
    if committed != spec_tokens:
        bad.append(f"the histogram commits {committed} tokens, the spec steps {spec_tokens}")
    if m.num_accepted_tokens + steps != spec_tokens:
        bad.append(f"accepted {m.num_accepted_tokens} + one bonus a step ({steps}) is not the "
                   f"{spec_tokens} tokens the spec steps committed")
    if steps and abs(m.mean_acceptance_length * steps - spec_tokens) > 1e-9 * max(1, spec_tokens):
        bad.append(f"accept length {m.mean_acceptance_length:.4f} x {steps} steps is not "
                   f"{spec_tokens} tokens")
    if m.num_accepted_tokens > m.num_draft_tokens or (
            m.draft_acceptance_rate is not None and m.num_draft_tokens and
            abs(m.draft_acceptance_rate * m.num_draft_tokens - m.num_accepted_tokens) > 1e-9 *
            max(1, m.num_draft_tokens)):
        bad.append(f"{m.num_accepted_tokens} accepted of {m.num_draft_tokens} drafted at rate "
                   f"{m.draft_acceptance_rate}")
    if accepts is not None and (len(accepts) != steps or sum(accepts) != spec_tokens):
        bad.append(f"the request's {len(accepts)} accept lengths sum to {sum(accepts)}")
    return bad


def spec_metrics_check(rows: Sequence[tuple[int, Sequence[int], SpecMetrics]],
                       total: SpecMetrics | None) -> CheckResult:
    """rows: (request id, its accept lengths, its figures) of every request; total: the run's
    figures (None without a spec). Failed, naming each broken relation, where one is off."""
    if total is None:
        return CheckResult(name="spec_metrics", status="skipped", detail="-")
    bad = [f"request {rid}: {b}" for rid, accepts, m in rows for b in _broken(m, accepts)]
    bad += [f"total: {b}" for b in _broken(total, None)]
    for f in ("num_spec_steps", "num_draft_tokens", "num_accepted_tokens", "completion_tokens",
              "non_spec_tokens"):
        if getattr(total, f) != sum(getattr(m, f) for _, _, m in rows):
            bad.append(f"total: {f} {getattr(total, f)} is not the requests' sum")
    if bad:
        return CheckResult(name="spec_metrics", status="failed", detail="; ".join(bad[:4]))
    if not total.num_spec_steps:
        return CheckResult(name="spec_metrics", status="ok", detail="no spec step ran")
    return CheckResult(name="spec_metrics", status="ok", detail=(
        f"{total.num_spec_steps} spec steps over {len(rows)} requests: accept length "
        f"{total.mean_acceptance_length:.2f} = {total.completion_tokens - total.non_spec_tokens} "
        f"spec-committed tokens / {total.num_spec_steps} steps; acceptance rate "
        f"{total.draft_acceptance_rate or 0.0:.2f}; the histogram sums to the steps"))
