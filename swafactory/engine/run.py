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
* ``overlap`` (``run.overlap=true``): every request's tokens equal those of the same run without
  overlap (a divergence right after an argmax tie is reported, not failed); that run's tokens/s
  is reported beside the overlap run's (``tokens_per_s_no_overlap``);
* ``acceptance``: a self-speculating copy (eagle, eagle3, nextn, standalone) commits the ideal
  length every step (num_steps + 1 for a chain, the verified greedy depth + 1 for a tree);
  frozen_kv_mtp and dflash commit, step by step, what the torch backend commits with no fault
  on the same seeds (the run is its own reference on torch without a fault). A step below the
  ideal is excused only at a near tie: the target's own, or one the fp64 forward shows, within
  the rounding the logits checks measured (`checks.acceptance_check`); the detail names it. A
  draft of its own weights (``spec.draft_weights``: random, distilled or a saved one) has no
  ideal: with a fault on, its mean accept length must stay within `checks.ACCEPT_MARGIN` of its
  clean twin's (the same config with faults=none, run here after the main run);
* ``spec_metrics``: the per-request and total figures (`spec_metrics`: vLLM's schema) against
  each other: accept length = spec-committed tokens / verify steps, the histogram sums to the
  steps and commits those tokens, accepted + one bonus a step = those tokens.

The checks themselves live in `checks`.
"""
from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TextIO

import torch

from swafactory.config.schema import FaultsSpec, NoSpec, SwaFactoryConfig
from swafactory.models.build import build, model_dtype
from swafactory.engine.checks import (acceptance_check, ideal_accept, logits_check,
                                      logits_tolerance, lossless_check, mean_accept, most_accept,
                                      oracle_check)
from swafactory.engine.generator import Generator
from swafactory.models.hf import load_target, require_transformers
from swafactory.engine.oracle_watch import attach_oracle
from swafactory.harness.watch import OracleMismatch
from swafactory.serving.scheduler import AdmissionError, replay_steps
from swafactory.guards import GuardError
from swafactory.engine.report import GenProgress
from swafactory.engine.spec_metrics import (draft_tokens_per_step, histogram, request_metrics,
                                            spec_metrics_check, total_metrics)
from swafactory.engine.report_model import (CHECK_ORDER, CheckResult, GenerateReport,
                                            RequestRecord, SpecMetrics)
from swafactory.engine.runner import NonFinite
from swafactory.errors import CapacityError, ConfigError, SpaceError
from swafactory.fault_counts import FAULT_COUNTS
from swafactory.outputs.inert import inert_message
from swafactory.registry.device import DeviceInfo, detect_device
from swafactory.registry.kernel_choice import worker_lines
from swafactory.registry.select import validate

__all__ = ["run_generate", "draws", "ideal_accept", "logits_tolerance", "estimate_steps"]


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
    """Scheduler steps the generator will take (for progress lines): the scheduler's rules on
    paper (`scheduler.replay_steps`), each step committing the ideal accept length (1 without
    spec or an ideal)."""
    a = 1 if cfg.spec.algorithm == "none" else (ideal_accept(cfg.spec) or 1)
    return replay_steps(cfg, prompts, outs, lambda: a)


class _Outcome:
    """One generation's result: the generator, or the exception that stopped it."""

    def __init__(self, gen: Generator | None, parts, error: BaseException | None, wall: float,
                 watch=None):
        self.gen, self.parts, self.error, self.wall = gen, parts, error, wall
        self.watch = watch  # run.oracle's AttentionWatch, or None


def _generate(cfg: SwaFactoryConfig, device: DeviceInfo, model, prompts, outs,
              on_step: Callable[[Generator], None] | None = None,
              progress: TextIO | None = None, trace: bool = False) -> _Outcome:
    parts = gen = watch = None
    t0 = time.perf_counter()
    try:
        parts = build(cfg, device, [len(p) for p in prompts], outs, model=model,
                      progress=progress)
        gen = Generator(parts, prompts, outs, on_step, trace=trace)
        watch = attach_oracle(parts, gen)  # run.oracle: attention rows against the fp32 oracle
        # the loop's wall: a draft's distillation and the start-up graph captures (every bucket
        # x mode, before the first step) are not generation, as an engine's throughput is not
        t0 = time.perf_counter()
        gen.run()
    except ConfigError:
        raise  # a refusal (a saved draft that does not fit): before anything was allocated
    except CapacityError as exc:
        if gen is None or gen.step == 0 and not isinstance(exc, AdmissionError):
            raise  # nothing ran: the pools cannot hold this workload, a refusal
        return _Outcome(gen, parts, exc, time.perf_counter() - t0, watch)
    except (SpaceError, RuntimeError, IndexError, ValueError) as exc:
        return _Outcome(gen, parts, exc, time.perf_counter() - t0, watch)
    finally:  # the target is shared with the reference runs: its feature hooks go
        if parts is not None and parts.target.tap is not None:
            parts.target.tap.remove()
    return _Outcome(gen, parts, None, time.perf_counter() - t0, watch)


def _where(gen) -> str:
    """Where a run stopped: the step, the runner and mode, and the pools' use at the last
    step that finished (an out-of-bounds read shows past a use threshold: sglang #26957)."""
    if gen is None:
        return ""
    use = f"; SWA pool {100 * gen.history[-1].swa_use:.0f}% used, full " \
          f"{100 * gen.history[-1].full_use:.0f}%" if gen.history else ""
    return f" (at step {gen.step}, {gen.current[0]} {gen.current[1]}{use})"


def _kind(exc: BaseException) -> str:
    if isinstance(exc, NonFinite):
        return "nan"
    if isinstance(exc, (SpaceError, GuardError)):  # the typed spaces or the call guards
        return "space"
    if isinstance(exc, CapacityError):
        return "capacity"
    if isinstance(exc, OracleMismatch):  # run.oracle: an attention row off the fp32 oracle
        return "oracle"
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
    model, recipe, target_training = load_target(cfg, model_dtype(cfg), torch_dev, progress)
    prompts, outs = draws(cfg, model.config.vocab_size)
    on_step = None if progress is None else GenProgress(
        progress, len(prompts), estimate_steps(cfg, [len(p) for p in prompts], outs))
    FAULT_COUNTS.clear()  # each fault branch counts the times it acted in the main run
    # a fault with a draft of its own weights, or one with no ideal accept length: a clean twin
    # (faults=none) runs after, and every draft row of the two is kept to be held to each other
    twinned = bool(cfg.faults.active) and cfg.spec.algorithm != "none" and (
        cfg.spec.draft_weights != "target" or ideal_accept(cfg.spec) is None)
    main = _generate(cfg, dev, model, prompts, outs, on_step, progress, trace=twinned)
    acted = FAULT_COUNTS.of(cfg.faults.active)  # the reference runs below have no fault
    t_ref = time.perf_counter()
    s = cfg.spec
    none_run = torch_run = twin = clean = None
    checks: dict[str, CheckResult] = {}
    tol = logits_tolerance(cfg)
    if main.error is not None:
        checks[_kind(main.error)] = CheckResult(
            name=_kind(main.error), status="failed",
            detail=f"{type(main.error).__name__}: {main.error}" + _where(main.gen))
    else:
        if main.watch is not None:  # it ran and raised nothing: say what it checked
            checks["oracle"] = oracle_check(main.watch)
        books = main.parts.slots.leaks()
        bad = {k: v for k, v in books.items() if v}
        held = getattr(main.gen.core, "overheld", None)
        checks["leak"] = CheckResult(
            name="leak", status="failed" if bad or held else "ok",
            detail=(f"held after every request finished: {bad}" if bad else
                    f"after step {held[0]}'s eviction request {held[1]} held {held[2]} SWA slots "
                    f"no later query can see (its frontier at {held[3]}, the window's at "
                    f"{held[4]}): out-of-window slots not freed" if held else
                    "every slot and row released; no request kept SWA slots out of every window"))
        reqs = sorted(main.gen.done, key=lambda r: r.rid)
        checks["logits"], err, npos, tol = logits_check(cfg, model, reqs, "logits")
        derr = err  # a draft that reads the target's pool is checked through the target's
        if main.parts.draft is not None and main.parts.draft.writes:
            checks["draft_logits"], derr, _, _ = logits_check(
                cfg, main.parts.draft.model, reqs, "draft_logits",
                target=model if main.parts.draft.reads_features else None)
        if cfg.run.overlap:  # the same run without overlap: its tokens, and tokens/s to compare
            twin = _generate(cfg.model_copy(update={"run": cfg.run.model_copy(
                update={"overlap": False})}), dev, model, prompts, outs)
            checks["overlap"] = lossless_check(reqs, twin, "overlap", "run.overlap=false")
        if s.algorithm != "none":
            none_run = _generate(_variant(cfg, dev, spec=NoSpec(name="none", algorithm="none")),
                                 dev, model, prompts, outs)
            checks["lossless"] = lossless_check(reqs, none_run)
        ref = None
        if s.draft_weights == "target" and ideal_accept(s) is None and (
                cfg.faults.active or cfg.backend.name != "torch"):
            torch_run = _generate(_variant(cfg, dev, torch_backend=True), dev, model, prompts, outs)
            ref = torch_run
        if twinned:  # the clean twin: faults=none
            clean = _generate(cfg.model_copy(update={"faults": FaultsSpec()}), dev, model,
                              prompts, outs, trace=True)
        sound = all(checks[c].status == "ok" for c in ("logits", "draft_logits") if c in checks)
        checks["acceptance"] = acceptance_check(cfg, reqs, ref, err + derr if sound else 0.0,
                                                clean)
    ref_s = time.perf_counter() - t_ref
    per, total = _spec_figures(cfg, main)
    if total is not None:  # vLLM's per-request figures, held to each other as sglang does
        checks["spec_metrics"] = spec_metrics_check(
            [(r.rid, r.accepts, per[r.rid]) for r in main.gen.done], total)
    failed = [c for c in CHECK_ORDER if c in checks and checks[c].status == "failed"]
    return _report(cfg, dev, tf.__version__, model, main, checks, failed,
                   err if main.error is None else None, npos if main.error is None else 0,
                   none_run, ref_s, tol, recipe, twin, acted, clean, target_training,
                   (per, total))


def _spec_figures(cfg: SwaFactoryConfig, main: _Outcome) -> tuple[dict, SpecMetrics | None]:
    """(request id → `SpecMetrics`, the run's) of a spec run that finished; ({}, None) else."""
    if cfg.spec.algorithm == "none" or main.error is not None or main.gen is None:
        return {}, None
    drafted = draft_tokens_per_step(cfg.spec)
    per = {r.rid: request_metrics(r.accepts, drafted, len(r.generated), r.plain)
           for r in main.gen.done}
    return per, total_metrics([per[rid] for rid in sorted(per)])


def _tokens_per_s(run: _Outcome | None) -> float | None:
    if run is None or run.gen is None or not run.wall:
        return None
    return sum(len(r.tokens) - len(r.prompt) for r in (*run.gen.done, *run.gen.running)) / run.wall


def _report(cfg, dev, tf_version, model, main: _Outcome, checks, failed, err, npos, none_run,
            ref_s, tol, recipe, twin: _Outcome | None = None,
            acted: dict[str, int] | None = None, clean: _Outcome | None = None,
            target_training=None, figures: tuple[dict, SpecMetrics | None] = ({}, None)
            ) -> GenerateReport:
    gen = main.gen
    reqs = sorted([*(gen.done if gen else []), *(gen.running if gen else [])], key=lambda r: r.rid)
    twin_of = {} if clean is None or clean.gen is None else \
        {r.rid: list(r.accepts) for r in clean.gen.done}
    records = [RequestRecord(rid=r.rid, prompt_ids=r.prompt, generated_ids=r.generated[:r.out],
                             max_new_tokens=r.out, accept_lengths=r.accepts,
                             accept_lengths_clean=twin_of.get(r.rid),
                             tie_positions=sorted(set(r.ties)), rejections=r.rejections,
                             accept_histogram=histogram(r.accepts),
                             spec_metrics=figures[0].get(r.rid))
               for r in reqs]
    steps = gen.history if gen else []
    scfg = main.parts.cfg if main.parts else cfg
    tokens = sum(len(r.tokens) - len(r.prompt) for r in reqs)
    names = {"lossless", "overlap", "acceptance"}
    for c in CHECK_ORDER:
        checks.setdefault(c, CheckResult(name=c, status="skipped", detail="not reached" if
                                         c not in names or main.error else "-"))
    acted = acted or {}
    inert = None if failed else inert_message(acted)
    lossless = None if "lossless" not in checks or checks["lossless"].status == "skipped" \
        else checks["lossless"].status == "ok"
    return GenerateReport(
        status="failed" if failed else "inert" if inert else "ok", combination=cfg.combination,
        device=dev.describe(), fault_acted=acted, inert=inert,
        backend=cfg.backend.name, transformers=tf_version,
        kernels=worker_lines([r for r in (main.parts.target, main.parts.draft) if r is not None]
                             if main.parts else []),
        architecture=type(model).__name__, checkpoint=cfg.model.checkpoint, seed=cfg.workload.seed,
        hf_config=model.config.to_dict(), post_init=recipe, serving_model=scfg.model.model_dump(mode="json"),
        spec=cfg.spec.name, draft=main.parts.draft_desc if main.parts else "-",
        fault=", ".join(cfg.faults.active) or None, guards=cfg.run.guards,
        dtype=str(model_dtype(cfg)).removeprefix("torch."), requests=records,
        steps=steps, logits_max_rel_err=err, logits_tolerance=tol,
        logits_positions=npos, lossless=lossless,
        accept_len=mean_accept(reqs), spec_metrics=figures[1],
        ideal_accept_len=ideal_accept(cfg.spec), max_accept_len=most_accept(cfg.spec),
        accept_len_clean=None if clean is None or clean.gen is None else
        mean_accept(clean.gen.done),
        target_training=None if target_training is None else target_training.as_dict(),
        draft_training=None if main.parts is None or main.parts.draft_training is None else
        main.parts.draft_training.as_dict(), checks=[checks[c] for c in CHECK_ORDER],
        caught_by=failed[0] if failed else None, failed_checks=failed,
        error=None if main.error is None else f"{type(main.error).__name__}: {main.error}"
              + _where(gen),
        wall_s=main.wall, tokens_per_s=tokens / main.wall if main.wall else 0.0,
        reference_s=ref_s, overlap=cfg.run.overlap, tokens_per_s_no_overlap=_tokens_per_s(twin),
        cuda_graphs={r.name: dict(r.graph_use) for r in (main.parts.target, main.parts.draft)
                     if r is not None} if cfg.backend.cuda_graph and main.parts else None,
        graph_state_bytes=sum(bk.graph_state_bytes() for bk in {
            id(r.backend): r.backend for r in (main.parts.target, main.parts.draft)
            if r is not None}.values()) if main.parts else 0)
