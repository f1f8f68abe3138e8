"""`run_generate(cfg) -> GenerateReport`: generate, then check what was generated.

Checks (`report_model.CHECK_ORDER`):

* the guards (``run.guards=true``): typed index spaces (``space``) and NaN-poisoned freed slots
  (``nan``); a kernel that raises is a ``kernel`` fault, a pool that runs out ``capacity``, slots
  still held at the end a ``leak``;
* ``logits``: at every generated position, the target's logits against transformers' own eager
  forward of the request's whole token sequence (no swafactory in the loop), relative to the
  largest |logit|, within 1e-4 in fp32 (1e-1 in 16-bit) or 4 × that eager forward's own error
  against the same weights in fp64, the larger; ``draft_logits``: the same for a draft that
  writes its own pool, over the committed tokens (its ``draft_extend`` rows) against the draft
  model's eager forward (a draft that reads the wrong pool shows here even when its drafts are
  rejected anyway);
* ``lossless``: every request's greedy tokens equal those of ``spec=none`` on the same backend,
  prompts and weights (a divergence right after an argmax tie is reported, not failed);
* ``acceptance``: a self-speculating copy (eagle, eagle3, nextn, standalone) commits the ideal
  length every step (num_steps + 1 for a chain, the verified greedy depth + 1 for a tree);
  frozen_kv_mtp and dflash commit, step by step, what the torch backend commits with no fault
  on the same seeds (the run is its own reference on torch without a fault).
"""
from __future__ import annotations

import copy
import random
import time
from collections.abc import Callable
from typing import TextIO

import torch

from swafactory.config.schema import FaultsSpec, NoSpec, SwaFactoryConfig
from swafactory.engine.build import OWN_COPY, build, model_dtype
from swafactory.engine.generator import Generator, tie_tolerance
from swafactory.engine.models import load_target, require_transformers
from swafactory.engine.report import GenProgress
from swafactory.engine.report_model import (CHECK_ORDER, CheckResult, GenerateReport, GenStep,
                                            RequestRecord)
from swafactory.engine.runner import NonFinite, attn_implementation
from swafactory.errors import CapacityError, SpaceError
from swafactory.registry.device import DeviceInfo, detect_device
from swafactory.registry.select import validate

__all__ = ["run_generate", "draws", "ideal_accept", "logits_tolerance", "estimate_steps"]


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


def ideal_accept(spec) -> int | None:
    """Tokens a perfect self-speculating draft commits per step: a chain's num_steps + 1; a
    tree's verified greedy depth + 1 (the greedy node of level l sits at BFS index
    1 + topk·(l-1) and is verified when that is < num_draft_tokens). None: no ideal."""
    if spec.algorithm not in OWN_COPY:
        return None
    if not spec.is_tree:
        return spec.num_draft_tokens
    return 1 + sum(1 for lvl in range(1, spec.num_steps + 1)
                   if 1 + spec.topk * (lvl - 1) < spec.num_draft_tokens)


def draws(cfg: SwaFactoryConfig, vocab: int) -> tuple[list[list[int]], list[int]]:
    """Seeded prompts (W + a draw from ``workload.prompt_over_window`` tokens, ids from the
    vocabulary) and output lengths (``workload.output_len``)."""
    w, W = cfg.workload, cfg.model.sliding_window or 0
    rng = random.Random(w.seed)
    lens = [W + rng.randint(*w.prompt_over_window) for _ in range(w.num_requests)]
    outs = [rng.randint(*w.output_len) for _ in range(w.num_requests)]
    g = torch.Generator().manual_seed(w.seed)
    prompts = [torch.randint(vocab, (n,), generator=g).tolist() for n in lens]
    return prompts, outs


def estimate_steps(cfg: SwaFactoryConfig, prompts: list[int], outs: list[int]) -> int:
    """Scheduler steps the generator will take (for progress lines): admission, prefill chunks,
    then steps committing the ideal accept length (1 without spec or an ideal)."""
    w = cfg.workload
    a = 1 if cfg.spec.algorithm == "none" else (ideal_accept(cfg.spec) or 1)
    waiting = [[p, o, 0, 0] for p, o in zip(prompts, outs)]  # prompt, out, committed, generated
    running: list[list[int]] = []
    steps = 0
    while waiting or running:
        while waiting and len(running) < w.max_running_requests:
            running.append(waiting.pop(0))
        pre = [r for r in running if r[2] < r[0]]
        for r in pre:
            r[2] += min(w.chunk_size, r[0] - r[2])
            r[3] += r[2] >= r[0]
        if not pre:
            for r in running:
                r[2] += a
                r[3] += a
        running = [r for r in running if r[3] < r[1]]
        steps += 1
    return steps


class _Outcome:
    """One generation's result: the generator, or the exception that stopped it."""

    def __init__(self, gen: Generator | None, parts, error: BaseException | None, wall: float):
        self.gen, self.parts, self.error, self.wall = gen, parts, error, wall


def _generate(cfg: SwaFactoryConfig, device: DeviceInfo, model, prompts, outs,
              on_step: Callable[[Generator], None] | None = None) -> _Outcome:
    t0 = time.perf_counter()
    parts = gen = None
    try:
        parts = build(cfg, device, [len(p) for p in prompts], outs, model=model)
        gen = Generator(parts, prompts, outs, on_step)
        gen.run()
    except CapacityError as exc:
        if gen is None or gen.step == 0:
            raise  # nothing ran: the pools cannot hold this workload, a refusal
        return _Outcome(gen, parts, exc, time.perf_counter() - t0)
    except (SpaceError, RuntimeError, IndexError, ValueError) as exc:
        return _Outcome(gen, parts, exc, time.perf_counter() - t0)
    return _Outcome(gen, parts, None, time.perf_counter() - t0)


def _kind(exc: BaseException) -> str:
    if isinstance(exc, NonFinite):
        return "nan"
    if isinstance(exc, SpaceError):
        return "space"
    if isinstance(exc, CapacityError):
        return "capacity"
    return "kernel"


def _variant(cfg: SwaFactoryConfig, device: DeviceInfo, *, spec=None, torch_backend=False
             ) -> SwaFactoryConfig:
    """A reference run's config: no fault, the guards on; spec=none or the torch backend."""
    upd: dict = {"faults": FaultsSpec(), "run": cfg.run.model_copy(update={"guards": True})}
    if spec is not None:
        upd["spec"] = spec
    if torch_backend:  # the reference runs eagerly: torch has no graph path
        upd["backend"] = cfg.backend.model_copy(update={"name": "torch", "cuda_graph": False})
    return validate(cfg.model_copy(update=upd), device)


def run_generate(cfg: SwaFactoryConfig, device: DeviceInfo | None = None,
                 progress: TextIO | None = None) -> GenerateReport:
    """Generate greedily under ``cfg`` (run.mode=generate), then check. Raises ConfigError or
    CapacityError when refused; a caught fault or a failed check returns status ``failed``.
    ``progress``: where the main run's progress lines go (None: silent)."""
    tf = require_transformers()
    dev = device or detect_device(cfg.workload.device)
    cfg = validate(cfg, dev)
    torch_dev = "cuda" if dev.kind == "cuda" else "cpu"
    model, recipe = load_target(cfg, model_dtype(cfg), torch_dev)
    prompts, outs = draws(cfg, model.config.vocab_size)
    on_step = None if progress is None else GenProgress(
        progress, len(prompts), estimate_steps(cfg, [len(p) for p in prompts], outs))
    main = _generate(cfg, dev, model, prompts, outs, on_step)
    t_ref = time.perf_counter()
    s = cfg.spec
    none_run = torch_run = None
    checks: dict[str, CheckResult] = {}
    tol = logits_tolerance(cfg)
    if main.error is not None:
        checks[_kind(main.error)] = CheckResult(name=_kind(main.error), status="failed",
                                                detail=f"{type(main.error).__name__}: {main.error}")
    else:
        books = main.parts.slots.leaks()
        bad = {k: v for k, v in books.items() if v}
        checks["leak"] = CheckResult(name="leak", status="failed" if bad else "ok",
                                     detail=f"held after every request finished: {bad}" if bad
                                     else "every slot and row released")
        reqs = sorted(main.gen.done, key=lambda r: r.rid)
        checks["logits"], err, npos, tol = _logits_check(cfg, model, reqs, "logits")
        if main.parts.draft is not None and main.parts.draft.writes:
            checks["draft_logits"] = _logits_check(cfg, main.parts.draft.model, reqs,
                                                   "draft_logits")[0]
        if s.algorithm != "none":
            none_run = _generate(_variant(cfg, dev, spec=NoSpec(name="none", algorithm="none")),
                                 dev, model, prompts, outs)
            checks["lossless"] = _lossless(reqs, none_run)
        ref = None
        if s.algorithm in ("frozen_kv_mtp", "dflash") and (cfg.faults.active or
                                                            cfg.backend.name != "torch"):
            torch_run = _generate(_variant(cfg, dev, torch_backend=True), dev, model, prompts, outs)
            ref = torch_run
        checks["acceptance"] = _acceptance(cfg, reqs, ref)
    ref_s = time.perf_counter() - t_ref
    failed = [c for c in CHECK_ORDER if c in checks and checks[c].status == "failed"]
    return _report(cfg, dev, tf.__version__, model, main, checks, failed,
                   err if main.error is None else None, npos if main.error is None else 0,
                   none_run, ref_s, tol, recipe)


def _logits_check(cfg, model, reqs, name: str) -> tuple[CheckResult, float, int, float]:
    """``logits``: the target's logits at every generated position; ``draft_logits``: a writing
    draft's logits over the committed tokens (its ``draft_extend`` rows), each against the
    model's own eager forward of the request's tokens (no swafactory in the loop). The tolerance
    is the dtype's floor or `NOISE_FACTOR` × that eager forward's own error against the same
    weights in fp64, the larger. Returns (check, max error, positions, tolerance)."""
    worst, noise, where, n = 0.0, 0.0, "-", 0
    exact = None
    with attn_implementation(model, "eager"), torch.no_grad():
        for r in reqs:
            mine = r.logits if name == "logits" else r.draft_logits
            if not mine:
                continue
            if exact is None:  # the same weights in fp64: the truth both are measured against
                exact = copy.deepcopy(model).double()
                if hasattr(exact, "set_experts_implementation"):  # grouped_mm has no fp64
                    exact.set_experts_implementation("eager")
            ids = torch.tensor([r.tokens[:max(mine) + 1]], device=next(model.parameters()).device)
            ref = model(input_ids=ids, use_cache=False).logits[0].float().cpu()
            ref64 = exact(input_ids=ids, use_cache=False).logits[0].cpu()
            for pos, row in mine.items():
                scale = ref64[pos].abs().max().clamp_min(1e-6)
                e = float((row - ref[pos]).abs().max() / ref[pos].abs().max().clamp_min(1e-6))
                e = float("inf") if e != e else e
                noise = max(noise, float((ref[pos].double() - ref64[pos]).abs().max() / scale))
                n += 1
                if e > worst:
                    worst, where = e, f"request {r.rid} position {pos}"
    del exact
    tol = max(logits_tolerance(cfg), NOISE_FACTOR * noise)
    ok = worst <= tol
    return (CheckResult(name=name, status="ok" if ok else "failed",
                        detail=f"max rel err {worst:.2e} (tol {tol:.1e}: transformers' eager is "
                               f"{noise:.1e} off fp64) over {n} positions"
                               + ("" if ok else f", worst at {where}")), worst, n, tol)


def _lossless(reqs, none_run: _Outcome) -> CheckResult:
    if none_run.error is not None:
        return CheckResult(name="lossless", status="skipped",
                           detail=f"the spec=none run stopped: {none_run.error}")
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
            bad.append(f"request {r.rid}: token {i} is {a[i]}, spec=none has {b[i]}")
    detail = "; ".join(bad) if bad else f"{len(reqs)} requests equal spec=none's tokens"
    if ties:
        detail += "; diverged after a tie: " + ", ".join(ties)
    return CheckResult(name="lossless", status="failed" if bad else "ok", detail=detail)


def _parted(reqs, rid, step: int, tie: float) -> str:
    """Where that step's draft and target parted (`Rejection`), for the acceptance detail."""
    r = next(q for q in reqs if q.rid == rid)
    j = next((x for x in r.rejections if x.step == step), None)
    if j is None:
        return ""
    draft = "" if j.draft_gap is None else f", the draft preferred {j.draft_token} by {j.draft_gap:.1e}"
    return (f"; at position {j.position} the target preferred {j.target_token} over the draft's "
            f"{j.draft_token} by {j.target_gap:.1e} of its largest |logit|{draft}; a tie is "
            f"<= {tie:.0e}")


def _acceptance(cfg, reqs, ref: _Outcome | None) -> CheckResult:
    s = cfg.spec
    if s.algorithm == "none":
        return CheckResult(name="acceptance", status="skipped", detail="no speculative decoding")
    ideal = ideal_accept(s)
    if ideal is not None:
        # a step is excused when the target's argmax was a near tie inside its verified range
        short = [(r.rid, i, a) for r in reqs for i, a in enumerate(r.accepts) if a < ideal
                 and not any(L <= t < L + ideal for t in r.ties for L in r.spec_at[i:i + 1])]
        detail = (f"every step committed the ideal {ideal}" if not short else
                  f"{len(short)} steps below the ideal {ideal} (first: request {short[0][0]} "
                  f"spec step {short[0][1]} committed {short[0][2]}"
                  f"{_parted(reqs, *short[0][:2], tie_tolerance(model_dtype(cfg)))})")
        return CheckResult(name="acceptance", status="failed" if short else "ok", detail=detail)
    if ref is None:
        return CheckResult(name="acceptance", status="ok", detail="no ideal for a "
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
    return CheckResult(name="acceptance", status="failed" if diff else "ok", detail=detail)


def _report(cfg, dev, tf_version, model, main: _Outcome, checks, failed, err, npos, none_run,
            ref_s, tol, recipe) -> GenerateReport:
    gen = main.gen
    reqs = sorted([*(gen.done if gen else []), *(gen.running if gen else [])], key=lambda r: r.rid)
    records = [RequestRecord(rid=r.rid, prompt_ids=r.prompt, generated_ids=r.generated[:r.out],
                             max_new_tokens=r.out, accept_lengths=r.accepts,
                             tie_positions=sorted(set(r.ties)), rejections=r.rejections)
               for r in reqs]
    accepts = [a for r in reqs for a in r.accepts]
    steps = gen.history if gen else []
    scfg = main.parts.cfg if main.parts else cfg
    tokens = sum(len(r.tokens) - len(r.prompt) for r in reqs)
    names = {"lossless", "acceptance"}
    for c in CHECK_ORDER:
        checks.setdefault(c, CheckResult(name=c, status="skipped", detail="not reached" if
                                         c not in names or main.error else "-"))
    lossless = None if "lossless" not in checks or checks["lossless"].status == "skipped" \
        else checks["lossless"].status == "ok"
    return GenerateReport(
        status="failed" if failed else "ok", combination=cfg.combination, device=dev.describe(),
        backend=cfg.backend.name, transformers=tf_version,
        architecture=type(model).__name__, checkpoint=cfg.model.checkpoint, seed=cfg.workload.seed,
        hf_config=model.config.to_dict(), post_init=recipe, serving_model=scfg.model.model_dump(mode="json"),
        spec=cfg.spec.name, draft=main.parts.draft_desc if main.parts else "-",
        fault=", ".join(cfg.faults.active) or None, guards=cfg.run.guards,
        dtype=str(model_dtype(cfg)).removeprefix("torch."), requests=records,
        steps=steps, logits_max_rel_err=err, logits_tolerance=tol,
        logits_positions=npos, lossless=lossless,
        accept_len=sum(accepts) / len(accepts) if accepts else None,
        ideal_accept_len=ideal_accept(cfg.spec), checks=[checks[c] for c in CHECK_ORDER],
        caught_by=failed[0] if failed else None, failed_checks=failed,
        error=None if main.error is None else f"{type(main.error).__name__}: {main.error} "
              f"(at step {gen.step if gen else 0}, {gen.current[0]} {gen.current[1]})"
              if gen else f"{type(main.error).__name__}: {main.error}",
        wall_s=main.wall, tokens_per_s=tokens / main.wall if main.wall else 0.0,
        reference_s=ref_s,
        cuda_graphs={r.name: dict(r.graph_use) for r in (main.parts.target, main.parts.draft)
                     if r is not None} if cfg.backend.cuda_graph and main.parts else None)
