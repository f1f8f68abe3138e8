"""What the command line does with a composed config: plan, run the conformance job, or generate.

Every job writes `result.json` in its output directory (ok, refused, inert or failed), which the
multirun callback turns into `matrix.md`. In a single run, a refusal raises (exit 2) and a failure
returns 1; in a sweep both are recorded, the sweep goes on, and `__main__` exits with the worst.
"""
from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from swafactory.backend.timing import autotuned
from swafactory.config.from_hydra import from_hydra
from swafactory.config.paths import conf_dir, group_options
from swafactory.errors import EXIT_CONFORMANCE, EXIT_INERT, EXIT_OK, CapacityError, ConfigError
from swafactory.outputs.job_log import job_console, log_line, screen_only
from swafactory.resolve.layout import PlanSummary, describe
from swafactory.registry.auto_note import auto_note
from swafactory.registry.device import detect_device
from swafactory.registry.select import refuse_idle_faults, validate

__all__ = ["run_cli", "render_plan", "help_text", "did_you_mean"]


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def _short(ids: str, limit: int = 18) -> str:
    return ids if len(ids) <= limit else ids[: ids.rfind(",", 0, limit)] + ",…"


def render_plan(plan: PlanSummary, console: Console) -> None:
    """Print the plan table and the pool bytes."""
    t = Table(title=f"swafactory plan: {plan.combination} on {plan.device}", title_justify="left")
    kernels = list(dict.fromkeys(r.kernel for r in plan.rows))
    per_group = len(kernels) > 1  # a kernel per layer group (backend.groups): say which is whose
    for col in ("worker", "group", "layers", "#", "pool", "index space", "KV heads×dim", "window",
                *(("kernel",) if per_group else ()), "tree", "resolver", "bytes/request"):
        t.add_column(col, no_wrap=col in ("layers", "KV heads×dim", "bytes/request"))
    for r in plan.rows:
        t.add_row(r.worker, r.group, _short(r.layers), str(r.num_layers), r.pool, r.index_space,
                  f"{r.kv_heads}×{r.head_dim}", str(r.window) if r.window else "-",
                  *((r.backend,) if per_group else ()), r.tree,
                  r.resolver, _mib(r.bytes_per_request) if r.bytes_per_request else "-")
    console.print(t)
    console.print(
        f"kernel family: {', '.join(kernels) or '-'}; page_size {plan.page_size}; kv_dtype "
        f"{plan.kv_dtype}; spec {plan.spec} (draft KV: {plan.draft_kv}); "
        f"{plan.max_running_requests} requests × {plan.context_len} tokens\n"
        f"bytes per context token past the window: hybrid {plan.hybrid_bytes_per_token:,} B vs "
        f"full-only {plan.full_only_bytes_per_token:,} B\n"
        f"bytes per request: hybrid {_mib(plan.hybrid_bytes_per_request)} vs full-only "
        f"{_mib(plan.full_only_bytes_per_request)} ({plan.saving:.2f}× smaller)"
        + (f"; draft pool {_mib(plan.draft_bytes_per_request)}" if plan.draft_bytes_per_request else "")
        + f"\npool tokens: full {plan.full_pool_tokens:,}, swa {plan.swa_pool_tokens:,}"
        + f"\ngraph state (every bucket 1-64 captured, {plan.graph_tokens} queries per request, "
        f"at {plan.context_len} tokens): {_mib(plan.graph_state_bytes)}")
    if plan.passes:  # which kernel serves each pass (backend.kernels), not the family's name
        console.print("passes:\n" + "\n".join(f"  {p}" for p in plan.passes))


def _names(cfg: DictConfig) -> dict[str, str]:
    get = lambda key: str(OmegaConf.select(cfg, key, default="?"))  # noqa: E731
    return {"backend": get("backend.name"), "spec": get("spec.name"), "model": get("model.name"),
            "workload": get("workload.name")}


def _write_result(out: Path | None, cfg: DictConfig, overrides: list[str], status: str, *,
                   reasons: list[str] = (), report=None, error: str | None = None,
                   accept: str | None = None) -> Path | None:
    """Write the job's `result.json` (what a sweep's matrix.md reads); returns its path."""
    if out is None:
        return None
    from swafactory.harness.callback import JobResult

    n = _names(cfg)
    res = JobResult(combination=f"backend={n['backend']} spec={n['spec']} model={n['model']}",
                    overrides=overrides, status=status, reasons=list(reasons), report=report,
                    error=error, accept=accept, **n)
    (out / "result.json").write_text(res.model_dump_json(indent=1))
    return out / "result.json"


def run_cli(cfg: DictConfig, output_dir: Path | None, *, overrides: list[str] = (),
            sweep: bool = False) -> int:
    """Validate and run the composed config; returns the exit code of a single run.

    A refusal (ConfigError, or CapacityError before the first forward) raises in a single run;
    in a sweep it is recorded as `refused` and 0 returned, as is a failure: the sweep goes on and
    `__main__` exits with the worst of its jobs (`callback.sweep_status`).
    """
    with job_console(output_dir) as console:  # stdout, and Hydra's job log in the output dir
        return _run(cfg, output_dir, list(overrides), sweep, console)


def _run(cfg, output_dir, overrides, sweep, console) -> int:
    try:
        try:
            asked = from_hydra(cfg)
            device = detect_device(asked.workload.device)
            refuse_idle_faults(asked, device)  # before autotuning times a run that proves nothing
            tuned, tuning = autotuned(asked, device)  # backend=auto on a GPU: by measurement
            conf = validate(tuned, device)
            lines = tuning.lines() if tuning is not None else []
            for line in lines:
                console.print(f"[b]autotune[/] {line}"
                              + (" (cached)" if tuning.cached else ""), overflow="fold")
            if conf.run.mode == "plan":
                return _plan(conf, device, cfg, output_dir, list(overrides), console, lines)
            if conf.run.mode == "generate":
                return _generate(conf, device, cfg, output_dir, list(overrides), console, sweep,
                                 lines)
            return _conformance(conf, device, cfg, output_dir, list(overrides), console, sweep,
                                auto_note(asked, conf, device), lines)
        except (ConfigError, CapacityError) as exc:
            reasons = [str(r) for r in getattr(exc, "reasons", ())] or [str(exc)]
            _write_result(output_dir, cfg, list(overrides), "refused", reasons=reasons)
            if not sweep:
                log_line(console, str(exc))  # __main__ prints it on stderr
                raise
            _stderr(console, str(exc))
            return EXIT_OK
    except Exception as exc:
        # an unexpected error: in a sweep, the row says so (failed) before Hydra records the crash
        if sweep and not (output_dir is None or (output_dir / "result.json").exists()):
            _write_result(output_dir, cfg, list(overrides), "failed",
                          error=f"{type(exc).__name__}: {exc}")
        raise


def _stderr(console: Console, line: str) -> None:
    """A verdict or refusal: on stderr, and in the job log beside the run's console output."""
    print(line, file=sys.stderr)
    log_line(console, line)


def _plan(conf, device, cfg, output_dir, overrides, console, tuned=()) -> int:
    plan = describe(conf, device)
    render_plan(plan, console)
    if output_dir is not None:
        path = output_dir / "plan.json"
        path.write_text(json.dumps({"plan": plan.model_dump(), "autotune": list(tuned),
                                    "config": conf.model_dump(mode="json")}, indent=2))
        console.print(f"wrote {path}")
        console.print(f"wrote {_write_result(output_dir, cfg, overrides, 'ok')}")
    return EXIT_OK


def _conformance(conf, device, cfg, output_dir, overrides, console, sweep, note=None,
                 tuned=()) -> int:
    from swafactory.harness.report import progress, render_summary, write_report
    from swafactory.harness.run import run
    from swafactory.harness.setup import pool_memory

    # before anything is allocated (a sizing refusal raises here); one line, whatever the width
    console.print(pool_memory(conf).line(), soft_wrap=True)
    with screen_only(console), progress(console) as bar:
        report = run(conf, device, on_progress=bar.update)
    if note:  # `conf` is resolved already: what auto chose, from the config as asked
        report = report.model_copy(update={"backend_choice": note})
    if tuned:
        report = report.model_copy(update={"autotune": list(tuned)})
    render_summary(report, console)
    if output_dir is not None:
        _print_written(console, write_report(report, output_dir), output_dir, cfg, overrides,
                       report.status, report=report)
    if report.status == "inert":
        _stderr(console, f"conformance INERT: {report.inert}")
        return EXIT_OK if sweep else EXIT_INERT
    if report.status != "ok":
        m = report.mismatch
        _stderr(console, f"conformance FAILED at step {m.step}: {m.worker} {m.mode}, layer "
                f"{m.layer} ({m.group}), request {m.request}, caught by the {m.check} check: "
                f"{m.error}")
        return EXIT_OK if sweep else EXIT_CONFORMANCE
    return EXIT_OK


def _print_written(console, paths, output_dir: Path, cfg: DictConfig, overrides: list[str],
                   status: str, **result) -> None:
    """A ``wrote …`` line per report file, then one for result.json (its fields: ``result``)."""
    for path in paths:
        console.print(f"wrote {path}")
    console.print(f"wrote {_write_result(output_dir, cfg, overrides, status, **result)}")


def _generate(conf, device, cfg, output_dir, overrides, console, sweep, tuned=()) -> int:
    from swafactory.engine.report import accept_line, render_generate, write_generate
    from swafactory.engine.run import run_generate

    report = run_generate(conf, device, progress=console.file)
    if tuned:
        report = report.model_copy(update={"autotune": list(tuned)})
    render_generate(report, console)
    if output_dir is not None:
        caught = next((c.detail for c in report.checks if c.name == report.caught_by), None)
        _print_written(console, write_generate(report, output_dir), output_dir, cfg, overrides,
                       report.status, error=None if report.status == "ok" else report.inert
                       if report.status == "inert" else f"caught by {report.caught_by}: {caught}",
                       accept=accept_line(report))
    if report.status == "inert":
        _stderr(console, f"generate INERT: {report.inert}")
        return EXIT_OK if sweep else EXIT_INERT
    if report.status != "ok":
        failed = next(c for c in report.checks if c.name == report.caught_by)
        _stderr(console, f"generate FAILED: caught by the {report.caught_by} check: "
                f"{failed.detail}")
        return EXIT_OK if sweep else EXIT_CONFORMANCE
    return EXIT_OK


def did_you_mean(args: list[str]) -> list[str]:
    """One line per `group=option` argument whose option has no conf/<group>/<option>.yaml but a
    close one does (`spec=eagel3` -> eagle3). Hydra then refuses it with the group's whole list;
    this line goes first. Sweep values (`a,b`) are checked one by one; anything else is Hydra's."""
    from difflib import get_close_matches

    lines = []
    for arg in args:
        key, eq, value = arg.partition("=")
        group = key.lstrip("+")
        if not eq or arg.startswith("-") or "." in group or "/" in group or "(" in value:
            continue
        if group == "hydra" or not (conf_dir() / group).is_dir():
            continue
        options = group_options(group)
        for v in value.split(","):
            close = [] if v in options or v == "null" else get_close_matches(v, options, n=3)
            if close:
                lines.append(f"`{group}={v}`: no such {group} option; did you mean "
                             f"{' or '.join(close)}?")
    return lines


def help_text() -> str:
    """What `python -m swafactory --help` prints before Hydra's own help."""
    from swafactory.config.paths import GROUPS

    # the defaults' groups, then any other group of conf/ (added with +, e.g. +experiment=NAME)
    extra = [d.name for d in sorted(conf_dir().iterdir()) if d.is_dir() and d.name not in GROUPS]
    defaults = {k: v for d in OmegaConf.load(conf_dir() / "config.yaml").defaults
                if isinstance(d, DictConfig) for k, v in d.items()}
    rows = []
    for g in [*GROUPS, *(f"+{x}" for x in extra)]:
        opts = ", ".join(group_options(g.lstrip("+")))
        default = f" (default {defaults[g]})" if g in defaults else ""
        rows += textwrap.wrap(opts + default, 96, initial_indent=f"  {g + '=':<13}",
                              subsequent_indent=" " * 15, break_on_hyphens=False)
    rows = "\n".join(rows)
    return f"""\
swafactory: builds attention backends for LLM inference on hybrid sliding-window models from a
composed config (model x spec x backend x workload), refuses a combination the kernels cannot
run with every reason, and proves a built backend with a conformance run: real pools, SWA
eviction, speculative decoding, every checked attention output against an fp32 oracle.

  python -m swafactory backend=torch spec=eagle3 model=gemma4   # conformance run
  python -m swafactory run=plan model=gemma4                    # the plan only
  python -m swafactory run=generate model=tiny spec=eagle3      # HF model, greedy spec decoding
  python -m swafactory -m backend=torch,triton spec=none,eagle3 # a sweep: matrix.md

Exit codes: 0 ok; 1 conformance failure (a mismatch, a caught fault or a leak); 2 configuration
refused (message on stderr, no traceback); 3 inert: no check failed, but the injected fault never
acted (the workload gave it nothing to change; the message says what it lacked), so the run
proves nothing. A sweep (-m) runs every job and exits with the worst of them: 1 if any failed,
else 3 if any was inert, else 2 if any was refused, else 0.

Config groups (group=option), from {conf_dir()}; any field overrides too (spec.topk=2):
{rows}

Hydra's own help follows.
"""
