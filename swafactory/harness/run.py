"""`run(cfg) -> Report`: the conformance job. Build, serve the workload, check, report."""
from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import torch

from swafactory.config.schema import SwaFactoryConfig
from swafactory.errors import CapacityError, SpaceError
from swafactory.fault_counts import FAULT_COUNTS
from swafactory.guards import GuardError
from swafactory.harness import leaks
from swafactory.harness.estimate import estimate_steps
from swafactory.outputs.inert import inert_message
from swafactory.harness.kv_check import StaleKV
from swafactory.harness.loop import Loop, Mismatched
from swafactory.harness.report_model import Mismatch, ModeStats, Report, StepRecord, Tick
from swafactory.harness.setup import build_parts, draws, pool_sizes
from swafactory.harness.workers import Check, Worker
from swafactory.registry.auto_note import auto_note
from swafactory.registry.device import DeviceInfo, detect_device
from swafactory.registry.select import validate
from swafactory.registry.check import kernel_groups
from swafactory.registry.kernel_choice import worker_lines
from swafactory.registry.table import get_capabilities
from swafactory.serving.parts import Parts
from swafactory.serving.scheduler import AdmissionError

__all__ = ["run", "tolerance_for"]


def tolerance_for(cfg: SwaFactoryConfig) -> float:
    """Max relative error a checked output may have: fp32 math on fp32 KV is near-exact; 16-bit
    outputs carry their rounding."""
    return 2e-4 if cfg.backend.kv_dtype == "float32" else 2e-2


def run(cfg: SwaFactoryConfig, device: DeviceInfo | None = None,
        on_progress: Callable[[Tick], None] | None = None) -> Report:
    """Serve ``cfg.workload`` through real pools and the built backends, checking attention
    outputs against the fp32 oracle; ``on_progress`` gets a `Tick` after every step (and, on
    CUDA, before each first-use forward, while its kernels compile).

    Raises ConfigError or CapacityError when refused: the config or the pool sizing, or a pool
    that is too small before the first forward ran. A mismatch, a caught fault, a pool that runs
    out later or a leak at the end returns a Report with ``status="failed"``; a run whose
    injected fault never acted (`swafactory.fault_counts`), one with ``status="inert"``."""
    dev = device or detect_device(cfg.workload.device)
    asked, cfg = cfg, validate(cfg, dev)
    note = auto_note(asked, cfg, dev)
    _, prompts, outs = draws(cfg)
    pool_sizes(cfg, prompts, outs)  # a sizing refusal raises here, before any rank is spawned
    if cfg.parallel.tp > 1:
        from swafactory.harness.launch import launch

        report = launch(cfg, dev.kind, run_rank)
    else:
        report = _run_local(cfg, dev, on_progress, None)
    return report.model_copy(update={"backend_choice": note}) if note else report


def run_rank(cfg: SwaFactoryConfig, shard) -> Report:
    """One tensor-parallel rank's run (called by `swafactory.harness.launch`; the config is
    validated)."""
    dev = detect_device(cfg.workload.device)
    if dev.kind == "cuda":
        import dataclasses
        dev = dataclasses.replace(dev, name=f"{dev.name} ×{shard.tp}")
    return _run_local(cfg, dev, None, shard)


class _Clock:
    """The workers' steady-state and first-use seconds, read before and after each step."""

    def __init__(self) -> None:
        self.steady: list[tuple[float, float, float]] = []  # (attn, plan, gather) s, steady steps

    @staticmethod
    def read(workers) -> tuple[float, float, float, float, int]:
        return (sum(x.attn_s for x in workers), sum(x.plan_s for x in workers),
                sum(x.gather_s for x in workers),
                sum(sum(x.first_use.values()) for x in workers),
                sum(len(x.first_use) for x in workers))

    def per_step_ms(self, workers, steps: int) -> tuple[float, float, float]:
        """Mean attention, planning and gather ms over the steady steps (no first use in them);
        when there is none, every step's steady-state seconds over all steps."""
        if self.steady:
            n = len(self.steady)
            return tuple(1000 * sum(x[i] for x in self.steady) / n for i in range(3))
        a, p, g, _, _ = self.read(workers)
        return 1000 * a / steps, 1000 * p / steps, 1000 * g / steps


def _run_local(cfg: SwaFactoryConfig, dev: DeviceInfo,
               on_progress: Callable[[Tick], None] | None, shard) -> Report:
    w = cfg.workload
    FAULT_COUNTS.clear()  # each fault branch counts the times it acted during this run
    rng, prompts, outs = draws(cfg)
    gen = torch.Generator().manual_seed(w.seed)
    torch_dev = "cuda" if dev.kind == "cuda" else "cpu"
    t0 = time.perf_counter()
    stats: dict[tuple[str, str], ModeStats] = {}
    step_err = [0.0]

    def on_forward(worker: Worker, mode: str, layers: int, checks: list[Check]) -> None:
        st = stats.setdefault((worker.name, mode), ModeStats(worker=worker.name, mode=mode))
        st.forwards += 1
        st.attention_calls += layers
        for c in checks:
            e = c.error()
            st.checks += 1
            st.passed += e <= tol
            st.max_rel_err = max(st.max_rel_err, e if e != float("inf") else st.max_rel_err)
            step_err[0] = max(step_err[0], e if e != float("inf") else 0.0)

    tol = tolerance_for(cfg)
    parts: Parts[Worker] | None = None
    history: list[StepRecord] = []
    mismatch = None
    loop = None
    clock = _Clock()
    peak = [0.0, 0.0]  # SWA, full

    def tick(compiling: str | None = None) -> None:
        if on_progress is None:
            return
        step = loop.step
        total = step if loop.finished() else max(est, step)  # at the end: the real count
        on_progress(Tick(step=step, est_steps=total, finished=len(loop.done),
                         requests=w.num_requests, checks=sum(s.checks for s in stats.values()),
                         passed=sum(s.passed for s in stats.values()), peak_swa_use=peak[0],
                         peak_full_use=peak[1], elapsed_s=time.perf_counter() - t0,
                         compiling=compiling))

    try:
        parts = build_parts(cfg, prompts, outs, torch_dev, gen, shard)
        est = estimate_steps(cfg, prompts, outs, parts.sizes.swa_per_request)
        workers = [x for x in (parts.target, parts.draft) if x is not None]
        if dev.kind == "cuda":  # a first use compiles (JIT) there: say so before it starts
            for x in workers:
                x.on_first_use = tick
        loop = Loop(parts, prompts, outs, tolerance=tol, rng=rng, on_forward=on_forward)
        tick()
        while not loop.finished():
            step_err[0] = 0.0
            core = loop.core
            n_acc = len(core.accepts)
            before = clock.read(workers)
            kind = loop.step_once()
            after = clock.read(workers)
            d = [b - a for a, b in zip(before, after)]
            if not d[4]:
                clock.steady.append((d[0], d[1], d[2]))
            acc = core.accepts[n_acc:]
            history.append(StepRecord(  # a spec step is a decode step of the report
                step=loop.step, kind="decode" if kind == "spec" else kind,
                running=len(loop.running), swa_use=core.swa_use, full_use=core.full_use,
                max_rel_err=step_err[0], accept_len=sum(acc) / len(acc) if acc else None,
                evicted=core.step_evicted,
                attention_ms=1000 * d[0], planning_ms=1000 * d[1], first_use_ms=1000 * d[3]))
            peak[0], peak[1] = max(peak[0], core.swa_use), max(peak[1], core.full_use)
            tick()
    except Mismatched as exc:
        c = exc.check
        kind = "nan" if torch.isnan(c.out).any() else "oracle"
        mismatch = Mismatch(step=loop.step, worker=exc.worker, mode=exc.mode, layer=c.layer,
                            group=c.group, request=str(c.worst_request()),
                            error=f"max relative error {exc.error:.3g} > tolerance {tol:g}"
                                  + (" (NaN: a poisoned, freed or dummy slot was read)"
                                     if kind == "nan" else ""), check=kind)
    except StaleKV as exc:  # the oracle passed, but a row read holds another request's data
        mismatch = Mismatch(step=loop.step, worker=exc.worker, mode=exc.mode, layer=exc.layer,
                            group=exc.group, request=str(exc.request), error=exc.detail,
                            check="kv")
    except (SpaceError, GuardError, CapacityError, RuntimeError) as exc:
        if isinstance(exc, CapacityError) and not isinstance(exc, AdmissionError) and (
                loop is None or loop.current == ("-", "setup")):
            raise  # no forward ran: the pools cannot hold this workload, a refusal
        # a typed-space refusal, a pool that ran out, or a kernel that raised: the run stops here
        worker, mode = loop.current if loop else ("-", "setup")
        check = ("space" if isinstance(exc, (SpaceError, GuardError)) else
                 "capacity" if isinstance(exc, CapacityError) else "kernel")
        layer, group, request = _where(exc, parts, worker)
        mismatch = Mismatch(step=loop.step if loop else 0, worker=worker, mode=mode, layer=layer,
                            group=group, request=request, error=f"{type(exc).__name__}: {exc}"
                            + _raised_at(exc), check=check)
    books: dict[str, int] = {}
    if mismatch is None:  # every request finished: every slot and row must be back
        books = leaks.leaked(parts)
        if any(v > 0 for v in books.values()):
            mismatch = Mismatch(step=loop.step, worker="-", mode="end of run", layer=-1, group="-",
                                request="-", error=leaks.leak_message(books), check="leak")
    wall = time.perf_counter() - t0
    report = _report(cfg, dev, parts, loop, stats, history, mismatch, tol, wall, clock, books)
    if shard is not None:
        report = _with_ranks(report, parts, loop, clock)
    return report


def _with_ranks(report: Report, parts, loop, clock: _Clock) -> Report:
    """Add every rank's steady-state attention time and this rank's all-gather cost (per step)."""
    import torch.distributed as dist

    workers = [x for x in (parts.target, parts.draft) if x is not None] if parts else []
    mine, _, gather = clock.per_step_ms(workers, max(1, loop.step if loop else 1))
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return report.model_copy(update={"tp": dist.get_world_size(), "rank_attention_ms": every,
                                     "gather_ms_per_step": gather})


def _quant_error(parts) -> float | None:
    """fp8 KV: the workers' largest error against the unrounded K/V (one read at the end)."""
    errs = [x.kv_quant_err for x in (parts.target, parts.draft) if x is not None
            and x.kv_quant_err is not None] if parts else []
    return max(float(e) for e in errs) if errs else None


def _held(parts) -> int:
    """Bytes the pools took: the rows of held layers (`KVPool.held`) of every pool built."""
    pools = [parts.pool, parts.draft_pool, parts.swap.dummy if parts.swap else None]
    return sum(sp.held_bytes for p in pools if p is not None for sp in p.sub_pools)


def _graph_use(workers) -> str:
    """What the graphs did: a run that asked for them must show replays, not just say 'on'."""
    gs = [g for x in workers for g in x.graphs.values()]
    if not gs:
        return "on, no forward was graphable"
    how = "captures" if gs[0].captured_on_device else "recorded (emulated: no CUDA here)"
    return (f"{sum(g.captures for g in gs)} {how}, {sum(g.replays for g in gs)} replays "
            f"({', '.join(f'{m}×{t}' for x in workers for m, t in x.graphs)})")


def _where(exc: BaseException, parts, worker: str) -> tuple[int, str, str]:
    """(layer, group, request) an exception names in its message (``layer 3``, ``request 1``),
    the group from that worker's current plan; ``(-1, "-", "-")`` where it names none."""
    text = str(exc)
    m = re.search(r"\blayer (\d+)", text)
    r = re.search(r"\brequest '?([^\s',:;)]+)", text)
    layer = int(m.group(1)) if m else -1
    group = "-"
    w = getattr(parts, worker, None) if parts is not None and worker in ("target", "draft") else None
    plan = getattr(getattr(w, "backend", None), "_plan", None)
    if layer >= 0 and plan is not None:
        group = plan.layer_groups.get(layer, "-")
    elif (g := re.search(r"\bgroup ([\w/]+)", text)) is not None:  # a group-wide error
        group = g.group(1)
    return layer, group, r.group(1) if r else "-"


def _raised_at(exc: BaseException) -> str:
    """Where an exception left swafactory's code (the deepest frame of ours), so a kernel that
    raised in a sweep names its line without a traceback: `` (at kernels/flex.py:88 in
    padded_pass)``; empty when no frame is ours."""
    import traceback

    ours = [(f, Path(f.filename).as_posix()) for f in traceback.extract_tb(exc.__traceback__)]
    ours = [(f, p) for f, p in ours if "/swafactory/" in p]
    if not ours:
        return ""
    f, path = ours[-1]
    return f" (at {path.rsplit('/swafactory/', 1)[1]}:{f.lineno} in {f.name})"


def _report(cfg, dev, parts, loop, stats, history, mismatch, tol, wall, clock, books) -> Report:
    s, b, m = cfg.spec, cfg.backend, cfg.model
    checks = sum(st.checks for st in stats.values())
    passed = sum(st.passed for st in stats.values())
    steps = max(1, loop.step if loop else 1)
    workers = [x for x in (parts.target, parts.draft) if x is not None] if parts else []
    attn, plan, _ = clock.per_step_ms(workers, steps)
    first_use = {f"{x.name}/{v}": sec for x in workers for v, sec in x.first_use.items()}
    tokens = sum(r.committed for r in (loop.done + loop.running)) if loop else 0
    pool_bytes = sum(sp.bytes for sp in parts.pool.sub_pools) if parts else 0  # every layer
    full_only = 0
    if parts:  # the same layers, each keeping every full slot (per rank when sharded)
        rows = parts.sizes.full + b.page_size
        elt = parts.pool.sub_pools[0].k_bufs[0].element_size()
        for i in range(m.num_layers):
            sub = parts.pool.sub_pool(i)
            full_only += 2 * sub.num_kv_heads * sub.head_dim * elt * rows
    draft_kind = {"own_pool": "own pool (full index space)", "target_pool": "frozen view of "
                  "the target, swapped in per forward", "none": "-"}[s.draft_kv]
    if parts and parts.draft_pool is not None and parts.draft_pool.is_split:
        draft_kind = "own split pool sharing the target's mapping"
    parts_desc = {
        "kernel": ", ".join(get_capabilities(n).kernel for n in kernel_groups(cfg)),
        "resolver": f"resolve_kv_source policy={b.resolver}, every forward",
        "planner": "metadata.plan, once per forward",
        "translator": "kvcache.translate (typed Locs)",
        "tree": b.tree_mask if s.is_tree else "-",
        "draft": draft_kind,
        "pools": f"full {parts.sizes.full} slots, swa {parts.sizes.swa} slots" if parts else "-",
        "cuda_graphs": _graph_use(workers) if b.cuda_graph else "off",
    }
    layers = sorted(parts.target.layers) if parts else []
    acted = FAULT_COUNTS.of(cfg.faults.active)
    inert = None if mismatch else inert_message(acted)
    return Report(
        status="failed" if mismatch else "inert" if inert else "ok", combination=cfg.combination,
        fault_acted=acted, inert=inert,
        device=dev.describe(), backend=b.name, parts=parts_desc, kernels=worker_lines(workers),
        fault=", ".join(cfg.faults.active) or None, layers_attended=layers,
        draft_layers=len(parts.draft.layers) if parts and parts.draft else 0,
        requests=cfg.workload.num_requests, steps=loop.step if loop else 0,
        mode_stats=sorted(stats.values(), key=lambda x: (x.worker != "target", x.mode)),
        checks=checks, passed=passed,
        max_rel_err=max((st.max_rel_err for st in stats.values()), default=0.0), tolerance=tol,
        kv_quant_error=_quant_error(parts),
        peak_swa_use=max((h.swa_use for h in history), default=0.0),
        peak_full_use=max((h.full_use for h in history), default=0.0),
        evictions=loop.core.evicted if loop else 0, hybrid_bytes=pool_bytes,
        full_only_bytes=full_only,
        draft_pool_bytes=sum(sp.bytes for sp in parts.draft_pool.sub_pools)
        if parts and parts.draft_pool is not None else 0,
        held_bytes=_held(parts) if parts else None,
        accept_len=(sum(loop.core.accepts) / len(loop.core.accepts)) if loop and loop.core.accepts
        else None,
        attention_ms_per_step=attn, planning_ms_per_step=plan,
        first_use_s=sum(first_use.values()), first_use=first_use, steady_steps=len(clock.steady),
        tokens_per_s=tokens / wall if wall else 0.0, wall_s=wall,
        peak_device_bytes=torch.cuda.max_memory_allocated() if dev.kind == "cuda" else None,
        graph_state_bytes=sum(bk.graph_state_bytes() for bk in
                              {id(x.backend): x.backend for x in workers}.values()),
        leaked=books, history=history, mismatch=mismatch)
