"""The checks a `run=generate` run makes once its tokens are generated (`run` drives them):
``logits`` and ``draft_logits`` against transformers' eager forward, ``lossless`` against
spec=none's tokens, ``acceptance`` against the ideal accept length or the torch backend's.

One rule runs through them: two correct 16-bit runs round differently, so where the truth is a
near tie either argmax is right. The truth is the same weights in fp64 on the same tokens; a
divergence is excused only where that forward (or the run's own near tie) says so, and every
excuse is named in the check's detail.
"""
from __future__ import annotations

import copy

import torch

from swafactory.config.schema import SwaFactoryConfig
from swafactory.models.build import OWN_COPY, model_dtype
from swafactory.models.transformers import eager_name
from swafactory.engine.draft_trace import first_difference
from swafactory.engine.requests import logit_gap, tie_tolerance
from swafactory.engine.report_model import CheckResult
from swafactory.engine.runner import attn_implementation

__all__ = ["oracle_check", "NOISE_FACTOR", "ACCEPT_MARGIN", "logits_tolerance", "ideal_accept", "most_accept",
           "mean_accept", "logits_check", "lossless_check", "acceptance_check"]


def logits_tolerance(cfg: SwaFactoryConfig) -> float:
    """The floor of the logits tolerance: 1e-4 in fp32, 1e-1 in 16-bit (bf16 keeps 8 bits, and
    a MoE router that picks another expert after rounding moves a position's logits by several
    1e-2: 5.5e-2 on triton × gpt_oss_20b at 617dbe1, where HF's own bf16 was 1.1e-2 off fp64).
    A run's tolerance is this or `NOISE_FACTOR` × transformers' own eager error against its
    fp64 forward, the larger: at Gemma 4's real head geometry and 1k-token contexts, HF's fp32
    eager is itself 2e-4 to 6e-4 off the fp64 logits, so a fixed fp32 bound would fail correct
    runs. In 16-bit the logits check is coarse; the tokens (lossless) are the sharp check."""
    return 1e-4 if model_dtype(cfg) == torch.float32 else 1e-1


NOISE_FACTOR = 4.0
"""How many times transformers' own eager error (against fp64) the backend's may be: both sit
about that far from the fp64 logits, in different directions."""
ACCEPT_MARGIN = 0.1
"""A draft of its own weights fails ``acceptance`` when its mean accept length falls more than this
share below its clean twin's: a broken pool collapses it far more (the symptom users saw), while
a correct run on another kernel or batch shape moves it only at argmax near-ties."""


def ideal_accept(spec) -> int | None:
    """Tokens a perfect self-speculating draft commits per step: a chain's num_steps + 1; a
    tree's verified greedy depth + 1 (the greedy node of level l sits at BFS index
    1 + topk·(l-1) and is verified when that is < num_draft_tokens). None: no ideal (a copy
    under ``spec.draft_window`` reads less than the target does)."""
    if spec.algorithm not in OWN_COPY or spec.draft_weights != "target" or \
            spec.draft_window is not None:
        return None
    return most_accept(spec)


def most_accept(spec) -> int | None:
    """The most tokens one step can commit (what a perfect draft would): a chain's
    num_steps + 1, a tree's verified greedy depth + 1, a DFlash block. None without a draft."""
    if spec.algorithm == "none":
        return None
    if not spec.is_tree:
        return spec.num_draft_tokens
    return 1 + sum(1 for lvl in range(1, spec.num_steps + 1)
                   if 1 + spec.topk * (lvl - 1) < spec.num_draft_tokens)



def _eager(model, target, ids: torch.Tensor) -> torch.Tensor:
    """[T, V] logits of ``model``'s own forward of ids [1, T]; a feature draft (``target``
    given) reads the target's hidden states of the same tokens, each row its position - 1's."""
    if target is None:
        return model(input_ids=ids, use_cache=False).logits[0]
    from swafactory.drafts.distill_features import _shift, target_features

    feats = model.fuse(target_features(target, model, ids))
    feats = _shift(feats) if model.shifted else feats
    pos = torch.arange(ids.shape[1], device=ids.device)[None]
    return model(ids, pos, feats.to(next(model.parameters()).dtype)).logits[0]


def logits_check(cfg: SwaFactoryConfig, model, reqs, name: str, target=None
                 ) -> tuple[CheckResult, float, int, float]:
    """``logits``: the target's logits at every generated position; ``draft_logits``: a writing
    draft's logits over the committed tokens (its ``draft_extend`` rows), each against the
    model's own eager forward of the request's tokens (no swafactory in the loop). The tolerance
    is the dtype's floor or `NOISE_FACTOR` × that eager forward's own error against the same
    weights in fp64, the larger. ``logits`` also gives each `Rejection` at a checked position
    its ``exact_gap`` from that fp64 forward. reqs: `GenReq`s. Returns (check, max error,
    positions, tolerance). target: a feature draft's target (its eager forward gives the
    features; in fp64 beside the draft's fp64 copy)."""
    worst, noise, where, n = 0.0, 0.0, "-", 0
    exact = exact_t = None
    with attn_implementation(model, eager_name(model)), torch.no_grad():
        for r in reqs:
            mine = r.logits if name == "logits" else r.draft_logits
            if not mine:
                continue
            if exact is None:  # the same weights in fp64: the truth both are measured against
                exact = _double(model)
                exact_t = None if target is None else _double(target)
            ids = torch.tensor([r.tokens[:max(mine) + 1]], device=next(model.parameters()).device)
            ref = _eager(model, target, ids).float().cpu()
            ref64 = _eager(exact, exact_t, ids).cpu()
            for pos, row in mine.items():
                scale = ref64[pos].abs().max().clamp_min(1e-6)
                e = float((row - ref[pos]).abs().max() / ref[pos].abs().max().clamp_min(1e-6))
                e = float("inf") if e != e else e
                noise = max(noise, float((ref[pos].double() - ref64[pos]).abs().max() / scale))
                n += 1
                if e > worst:
                    worst, where = e, f"request {r.rid} position {pos}"
            for j in r.rejections if name == "logits" else ():
                if j.position in mine:
                    j.exact_gap = logit_gap(ref64[j.position], j.target_token, j.draft_token)
    del exact, exact_t
    tol = max(logits_tolerance(cfg), NOISE_FACTOR * noise)
    ok = worst <= tol
    return (CheckResult(name=name, status="ok" if ok else "failed",
                        detail=f"max rel err {worst:.2e} (tol {tol:.1e}: transformers' eager is "
                               f"{noise:.1e} off fp64) over {n} positions"
                               + ("" if ok else f", worst at {where}")), worst, n, tol)


def _double(model):
    exact = copy.deepcopy(model).double()
    if hasattr(exact, "set_experts_implementation"):  # grouped_mm has no fp64
        exact.set_experts_implementation("eager")
    return exact


def lossless_check(reqs, none_run, name: str = "lossless", what: str = "spec=none"
                   ) -> CheckResult:
    """Every request's greedy tokens against spec=none's (``none_run``: its `_Outcome`); a
    divergence after a near tie of either run is reported, not failed. ``name``, ``what``:
    the check and the reference run (``overlap`` compares with run.overlap=false)."""
    if none_run.error is not None:
        return CheckResult(name=name, status="skipped",
                           detail=f"the {what} run stopped: {none_run.error}")
    ref = {r.rid: r for r in none_run.gen.done}
    bad, ties = [], []
    for r in reqs:
        a, b = r.generated[:r.out], ref[r.rid].generated[:r.out]
        if a == b:
            continue
        i = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
        pos = len(r.prompt) + i - 1  # the logits position that chose token i
        if any(t <= pos for t in (*r.ties, *ref[r.rid].ties)):
            ties.append(f"request {r.rid} from token {i} (after an argmax tie)")
        else:
            bad.append(f"request {r.rid}: token {i} is {a[i]}, {what} has {b[i]}")
    detail = "; ".join(bad) if bad else f"{len(reqs)} requests equal {what}'s tokens"
    if ties:
        detail += "; diverged after a tie: " + ", ".join(ties)
    return CheckResult(name=name, status="failed" if bad else "ok", detail=detail)


def _rejection(r, step: int):
    return next((x for x in r.rejections if x.step == step), None)


def _parted(j) -> str:
    """Where a step's draft and target parted (`Rejection` ``j``), for the acceptance detail."""
    if j is None:
        return ""
    draft = "" if j.draft_gap is None else f", the draft preferred {j.draft_token} by {j.draft_gap:.1e}"
    exact = "" if j.exact_gap is None else f", fp64 prefers {j.target_token} by {j.exact_gap:.1e}"
    return (f"; at position {j.position} the target preferred {j.target_token} over the draft's "
            f"{j.draft_token} by {j.target_gap:.1e} of its largest |logit|{draft}{exact}")


def _excuse(r, step: int, ideal: int, tie: float, rounding: float) -> str | None:
    """Why spec step ``step`` of `GenReq` ``r`` may commit less than ``ideal`` (None: no
    reason, a failure): the target's own argmax was a near tie in the step's verified range, or
    the fp64 forward puts the target's token and the rejected draft's within ``rounding``, so
    the draft's pick is a correct rounding of a near tie."""
    if any(L <= t < L + ideal for t in r.ties for L in r.spec_at[step:step + 1]):
        return f"the target's argmax was a near tie (<= {tie:.0e})"
    j, bound = _rejection(r, step), max(tie, rounding)
    if j is not None and j.exact_gap is not None and abs(j.exact_gap) <= bound:
        return (f"fp64 puts {j.target_token} and the draft's {j.draft_token} "
                f"{abs(j.exact_gap):.1e} apart, within the run's rounding {bound:.1e}")
    return None


def mean_accept(reqs) -> float | None:
    """The mean accept length over every spec step of ``reqs`` (`GenReq`s)."""
    a = [x for r in reqs for x in r.accepts]
    return sum(a) / len(a) if a else None


def _against_clean(cfg: SwaFactoryConfig, reqs, clean) -> CheckResult:
    """A draft of its own weights has no ideal: its mean accept length must stay within
    `ACCEPT_MARGIN` of its clean twin's (``clean``: the same config with faults=none, an
    `_Outcome`; None: this run has no fault and is that twin), and every draft row (draft
    decode, block and extend) must equal the twin's (`draft_trace`): a drop inside the margin
    is not a pass where the draft proposed something else."""
    most = most_accept(cfg.spec)
    mine = mean_accept(reqs)
    if mine is None:
        return CheckResult(name="acceptance", status="skipped", detail="no spec step ran")
    if clean is None:
        return CheckResult(name="acceptance", status="ok", detail=f"mean accept length "
                           f"{mine:.2f} of at most {most}; no fault, so this run is the clean twin")
    if clean.error is not None or clean.gen is None:
        return CheckResult(name="acceptance", status="skipped",
                           detail=f"the clean twin (faults=none) stopped: {clean.error}")
    twin = mean_accept(clean.gen.done) or 0.0
    drop = (twin - mine) / twin if twin else 0.0
    moved = first_difference({r.rid: r.draft_trace for r in reqs},
                             {r.rid: r.draft_trace for r in clean.gen.done}, logits_tolerance(cfg))
    rows = sum(len(t.ids) for r in clean.gen.done for t in r.draft_trace)
    detail = (f"mean accept length {mine:.2f} against the clean twin's {twin:.2f} (faults=none, "
              f"at most {most}): a drop of {100 * drop:.0f}%, the margin is "
              f"{100 * ACCEPT_MARGIN:.0f}%; " + (f"the draft rows first leave the twin's at {moved}"
                                                if moved else f"all {rows} draft rows equal the "
                                                "twin's"))
    bad = drop > ACCEPT_MARGIN or moved is not None
    return CheckResult(name="acceptance", status="failed" if bad else "ok",
                       detail=("accept length collapsed: " if drop > ACCEPT_MARGIN else
                               "the draft moved: " if bad else "") + detail)


def acceptance_check(cfg: SwaFactoryConfig, reqs, ref, rounding: float, clean=None
                     ) -> CheckResult:
    """A draft of its own weights (``spec.draft_weights`` not ``target``) keeps its clean twin's
    mean accept length (``clean``, see `_against_clean`). A self-speculating copy (`OWN_COPY`)
    commits the ideal length every step; frozen_kv_mtp, dflash and a copy under a draft window
    commit what ``ref`` (the torch backend's fault-free `_Outcome`; None: this run is that
    reference) commits, step by step. reqs: `GenReq`s. ``rounding``: how far apart
    two correct runs' logits may put two tokens, relative to the largest |logit|: the
    target's and the draft's worst logits errors, added (0 where a logits check failed). A
    step below the ideal is excused by `_excuse`, and the detail names each excuse."""
    s = cfg.spec
    if s.algorithm == "none":
        return CheckResult(name="acceptance", status="skipped", detail="no speculative decoding")
    if s.draft_weights != "target":
        return _against_clean(cfg, reqs, clean)
    ideal = ideal_accept(s)
    if ideal is not None:
        tie = tie_tolerance(model_dtype(cfg))
        short, excused = [], []
        for r in reqs:
            for i, a in enumerate(r.accepts):
                if a < ideal:
                    why = _excuse(r, i, ideal, tie, rounding)
                    (excused if why else short).append((r, i, a, why))
        said = "" if not excused else f"{len(excused)} excused as rounding (" + "; ".join(
            f"request {r.rid} spec step {i} committed {a}: {why}{_parted(_rejection(r, i))}"
            for r, i, a, why in excused[:4]) + ("" if len(excused) <= 4 else
                                                f"; {len(excused) - 4} more") + ")"
        if not short:
            detail = f"every step committed the ideal {ideal}" + (f" or was {said}" if said else "")
        else:
            r, i, a, _ = short[0]
            detail = (f"{len(short)} steps below the ideal {ideal} (first: request {r.rid} spec "
                      f"step {i} committed {a}{_parted(_rejection(r, i))}; a tie is <= "
                      f"{tie:.0e}, the run's rounding {rounding:.1e})" + (f"; {said}" if said else ""))
        return CheckResult(name="acceptance", status="failed" if short else "ok", detail=detail)
    if ref is None:
        return CheckResult(name="acceptance", status="ok", detail="no ideal for this "
                           f"{s.algorithm} draft; this run is the torch reference itself")
    if ref.error is not None:
        return CheckResult(name="acceptance", status="skipped",
                           detail=f"the torch reference run stopped: {ref.error}")
    mine = {r.rid: r for r in reqs}
    diff = []
    for r in ref.gen.done:
        a, b = mine[r.rid].accepts, r.accepts
        if a != b and not (mine[r.rid].ties or r.ties):
            i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            diff.append(f"request {r.rid} spec step {i}: "
                        f"{a[i] if i < len(a) else '-'} vs torch {b[i] if i < len(b) else '-'}")
    detail = ("accept lengths equal the torch backend's step by step" if not diff else
              f"{len(diff)} requests differ from the torch backend: {diff[0]}")
    moved = None
    if clean is not None and clean.error is None and clean.gen is not None:
        # a fault's clean twin (faults=none, this backend): every draft row must equal its own,
        # so a fault in rows the accepts never reach (a block's later queries) still shows
        moved = first_difference({r.rid: r.draft_trace for r in reqs},
                                 {r.rid: r.draft_trace for r in clean.gen.done},
                                 logits_tolerance(cfg))
        detail += (f"; the draft rows first leave the clean twin's at {moved}" if moved else
                   "; every draft row equals the clean twin's")
    bad = bool(diff) or moved is not None
    return CheckResult(name="acceptance", status="failed" if bad else "ok", detail=detail)



def oracle_check(watch) -> CheckResult:
    """``run.oracle``'s verdict where it raised nothing (``watch``: its `AttentionWatch`): the
    passes it checked, by runner, mode and eager/replay, and the largest error it saw. A watch
    that sampled no pass is skipped, not ok."""
    summary = watch.summary()
    checked = {k: v for k, v in summary.items() if v["checked"]}
    if not checked:
        return CheckResult(name="oracle", status="skipped", detail="no pass was sampled")
    worst = max(v["max_rel_err"] for v in checked.values())
    seen = ", ".join(f"{k} {v['checked']}/{v['passes']}" for k, v in sorted(checked.items()))
    return CheckResult(name="oracle", status="ok",
                       detail=f"attention rows of {sum(v['checked'] for v in checked.values())} "
                              f"passes within tolerance (max rel err {worst:.1e}): {seen}")
