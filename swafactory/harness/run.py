"""`run(cfg) -> Report`: the conformance job. Build, serve the workload, check, report."""
from __future__ import annotations

import random
import time
from collections.abc import Callable

import torch

from swafactory.config.schema import SwaFactoryConfig
from swafactory.errors import CapacityError, SpaceError
from swafactory.harness.loop import Loop, Mismatched
from swafactory.harness.report_model import Mismatch, ModeStats, Report, StepRecord
from swafactory.harness.setup import Parts, build_parts
from swafactory.harness.workers import Check, Worker
from swafactory.registry.device import DeviceInfo, detect_device
from swafactory.registry.select import validate
from swafactory.registry.table import get_capabilities

__all__ = ["run", "tolerance_for"]


def tolerance_for(cfg: SwaFactoryConfig) -> float:
    """Max relative error a checked output may have: fp32 math on fp32 KV is near-exact; 16-bit
    outputs carry their rounding."""
    return 2e-4 if cfg.backend.kv_dtype == "float32" else 2e-2


def run(cfg: SwaFactoryConfig, device: DeviceInfo | None = None,
        on_step: Callable[[int, int, float], None] | None = None) -> Report:
    """Serve ``cfg.workload`` through real pools and the built backends, checking attention
    outputs against the fp32 oracle. Raises ConfigError when refused; a mismatch or a caught
    fault returns a Report with ``status="failed"``. ``on_step(finished, step, swa_use)``."""
    dev = device or detect_device(cfg.workload.device)
    cfg = validate(cfg, dev)
    if cfg.parallel.tp > 1:
        from swafactory.parallel import launch

        return launch(cfg, dev.kind)
    return _run_local(cfg, dev, on_step, None)


def run_rank(cfg: SwaFactoryConfig, shard) -> Report:
    """One tensor-parallel rank's run (called by `swafactory.parallel`; the config is validated)."""
    dev = detect_device(cfg.workload.device)
    if dev.kind == "cuda":
        import dataclasses
        dev = dataclasses.replace(dev, name=f"{dev.name} ×{shard.tp}")
    return _run_local(cfg, dev, None, shard)


def _run_local(cfg: SwaFactoryConfig, dev: DeviceInfo,
               on_step: Callable[[int, int, float], None] | None, shard) -> Report:
    w, m = cfg.workload, cfg.model
    rng = random.Random(w.seed)
    gen = torch.Generator().manual_seed(w.seed)
    W = m.sliding_window or 0
    prompts = [W + rng.randint(*w.prompt_over_window) for _ in range(w.num_requests)]
    outs = [rng.randint(*w.output_len) for _ in range(w.num_requests)]
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
    parts: Parts | None = None
    history: list[StepRecord] = []
    mismatch = None
    loop = None
    try:
        parts = build_parts(cfg, prompts, outs, torch_dev, gen, shard)
        loop = Loop(parts, prompts, outs, tolerance=tol, rng=rng, on_forward=on_forward)
        while not loop.finished():
            step_err[0] = 0.0
            n_acc = len(loop.accepts)
            kind = loop.step_once()
            acc = loop.accepts[n_acc:]
            history.append(StepRecord(
                step=loop.step, kind=kind, running=len(loop.running), swa_use=loop.swa_use,
                full_use=loop.full_use, max_rel_err=step_err[0],
                accept_len=sum(acc) / len(acc) if acc else None, evicted=loop.step_evicted))
            if on_step:
                on_step(len(loop.done), loop.step, history[-1].swa_use)
    except Mismatched as exc:
        c = exc.check
        kind = "nan" if torch.isnan(c.out).any() else "oracle"
        mismatch = Mismatch(step=loop.step, worker=exc.worker, mode=exc.mode, layer=c.layer,
                            group=c.group, request=str(c.worst_request()),
                            error=f"max relative error {exc.error:.3g} > tolerance {tol:g}"
                                  + (" (NaN: a poisoned, freed or dummy slot was read)"
                                     if kind == "nan" else ""), check=kind)
    except (SpaceError, CapacityError, RuntimeError) as exc:
        # a typed-space refusal, a pool that ran out, or a kernel that raised: the run stops here
        worker, mode = loop.current if loop else ("-", "setup")
        check = ("space" if isinstance(exc, SpaceError) else
                 "capacity" if isinstance(exc, CapacityError) else "kernel")
        mismatch = Mismatch(step=loop.step if loop else 0, worker=worker, mode=mode, layer=-1,
                            group="-", request="-", error=f"{type(exc).__name__}: {exc}",
                            check=check)
    wall = time.perf_counter() - t0
    report = _report(cfg, dev, parts, loop, stats, history, mismatch, tol, wall)
    if shard is not None:
        report = _with_ranks(report, parts, loop)
    return report


def _with_ranks(report: Report, parts, loop) -> Report:
    """Add every rank's attention time and this rank's all-gather cost (per step)."""
    import torch.distributed as dist

    workers = [x for x in (parts.target, parts.draft) if x is not None] if parts else []
    steps = max(1, loop.step if loop else 1)
    mine = 1000 * sum(x.attn_s for x in workers) / steps
    gather = 1000 * sum(x.gather_s for x in workers) / steps
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return report.model_copy(update={"tp": dist.get_world_size(), "rank_attention_ms": every,
                                     "gather_ms_per_step": gather})


def _graph_use(workers) -> str:
    """What the graphs did: a run that asked for them must show replays, not just say 'on'."""
    gs = [g for x in workers for g in x.graphs.values()]
    if not gs:
        return "on, no forward was graphable"
    return (f"{sum(g.captures for g in gs)} captures, {sum(g.replays for g in gs)} replays "
            f"({', '.join(f'{m}×{t}' for x in workers for m, t in x.graphs)})")


def _report(cfg, dev, parts, loop, stats, history, mismatch, tol, wall) -> Report:
    s, b, m = cfg.spec, cfg.backend, cfg.model
    checks = sum(st.checks for st in stats.values())
    passed = sum(st.passed for st in stats.values())
    steps = max(1, loop.step if loop else 1)
    workers = [x for x in (parts.target, parts.draft) if x is not None] if parts else []
    attn = sum(x.attn_s for x in workers)
    plan = sum(x.plan_s for x in workers)
    tokens = sum(r.committed for r in (loop.done + loop.running)) if loop else 0
    pool_bytes = sum(sp.bytes for sp in parts.pool.sub_pools) if parts else 0
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
        "kernel": get_capabilities(b.name).kernel,
        "resolver": f"resolve_kv_source policy={b.resolver}, every forward",
        "planner": "metadata.plan, once per forward",
        "translator": "kvcache.translate (typed Locs)",
        "tree": b.tree_mask if s.is_tree else "-",
        "draft": draft_kind,
        "pools": f"full {parts.sizes.full} slots, swa {parts.sizes.swa} slots" if parts else "-",
        "cuda_graphs": _graph_use(workers) if b.cuda_graph else "off",
    }
    layers = sorted(parts.target.layers) if parts else []
    return Report(
        status="failed" if mismatch else "ok", combination=cfg.combination,
        device=dev.describe(), backend=b.name, parts=parts_desc,
        fault=", ".join(cfg.faults.active) or None, layers_attended=layers,
        draft_layers=len(parts.draft.layers) if parts and parts.draft else 0,
        requests=cfg.workload.num_requests, steps=loop.step if loop else 0,
        mode_stats=sorted(stats.values(), key=lambda x: (x.worker != "target", x.mode)),
        checks=checks, passed=passed,
        max_rel_err=max((st.max_rel_err for st in stats.values()), default=0.0), tolerance=tol,
        peak_swa_use=max((h.swa_use for h in history), default=0.0),
        peak_full_use=max((h.full_use for h in history), default=0.0),
        evictions=loop.evicted if loop else 0, hybrid_bytes=pool_bytes, full_only_bytes=full_only,
        draft_pool_bytes=sum(sp.bytes for sp in parts.draft_pool.sub_pools)
        if parts and parts.draft_pool is not None else 0,
        accept_len=(sum(loop.accepts) / len(loop.accepts)) if loop and loop.accepts else None,
        attention_ms_per_step=1000 * attn / steps, planning_ms_per_step=1000 * plan / steps,
        tokens_per_s=tokens / wall if wall else 0.0, wall_s=wall,
        peak_device_bytes=torch.cuda.max_memory_allocated() if dev.kind == "cuda" else None,
        history=history, mismatch=mismatch)
