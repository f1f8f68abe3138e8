"""Showing a `Report`: the end-of-run summary, report.json + report.png, and the live progress
(a bar on a terminal, plain lines in a log).

Rendering only; the harness measures. matplotlib is optional (the `plot` extra): without it the run
still writes report.json and warns that the picture was skipped.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from math import nan
from pathlib import Path
from typing import TextIO

from rich.console import Console
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from swafactory.harness.report_model import Report, Tick
from swafactory.outputs.progress_lines import LineClock
from swafactory.outputs.report_files import write_report_files

__all__ = ["render_summary", "write_report", "figure", "progress", "RunProgress", "LogProgress",
           "layer_ranges"]

SWA_PRESSURE = 0.9
"""The pool use the workloads are sized to exceed; drawn as a line on the pool-use panel."""


def _bytes(n: int) -> str:
    if n < 2**20:
        return f"{n / 2**10:,.1f} KiB"
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def layer_ranges(layers: list[int], limit: int = 40) -> str:
    """`[0, 1, 2, 5, 7, 8]` → `0-2,5,7-8`; cut at `limit` characters with `,…` so a row stays short."""
    parts: list[str] = []
    for x in sorted(set(layers)):
        if parts and parts[-1][1] == x - 1:
            parts[-1][1] = x
        else:
            parts.append([x, x])
    text = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)
    return text if len(text) <= limit else text[: text.rfind(",", 0, limit)] + ",…"


def _mode_table(report: Report) -> Table:
    t = Table(title="forwards and oracle checks", title_justify="left", expand=False)
    for col in ("worker", "mode", "forwards", "layer calls", "checks", "passed", "max rel err"):
        t.add_column(col, justify="left" if col in ("worker", "mode") else "right")
    for m in report.mode_stats:
        bad = m.passed < m.checks
        t.add_row(m.worker, m.mode, f"{m.forwards:,}", f"{m.attention_calls:,}", f"{m.checks:,}",
                  f"[red]{m.passed:,}[/]" if bad else f"{m.passed:,}", f"{m.max_rel_err:.2e}")
    t.add_section()
    ok = report.passed == report.checks
    t.add_row("[b]all[/]", "", f"{sum(m.forwards for m in report.mode_stats):,}",
              f"{sum(m.attention_calls for m in report.mode_stats):,}", f"{report.checks:,}",
              f"[{'green' if ok else 'red'}]{report.passed:,}[/]",
              f"{report.max_rel_err:.2e} (tol {report.tolerance:.0e})")
    return t


def _leaks(leaked: dict[str, int]) -> str:
    if not leaked:  # the run stopped before every request finished: nothing to count
        return "-"
    bad = [f"{k} {v:,}" for k, v in leaked.items() if v]
    return f"[red]{', '.join(bad)}[/]" if bad else f"none ({len(leaked)} pools and tables)"


def _times(saving: float) -> str:
    """full-only / hybrid in words: contexts barely past the window save nothing, and a hybrid
    pool sized for a window plus a chunk can even be the larger one."""
    return f"{saving:.2f}× smaller" if saving >= 1 or not saving else f"{1 / saving:.2f}× larger"


def _facts(report: Report) -> Table:
    """The run's figures, two key/value pairs per row."""
    saving = report.full_only_bytes / report.hybrid_bytes if report.hybrid_bytes else 0.0
    pairs = [
        ("requests / steps", f"{report.requests:,} / {report.steps:,}"),
        ("wall", f"{report.wall_s:.1f} s, {report.tokens_per_s:,.1f} tok/s"),
        ("peak pool use", f"SWA {_pct(report.peak_swa_use)}, full {_pct(report.peak_full_use)}"),
        ("evictions", f"{report.evictions:,} SWA positions"),
        ("target pools", f"{_bytes(report.hybrid_bytes)} vs full-only "
                         f"{_bytes(report.full_only_bytes)} ({_times(saving)})"),
        ("draft pool", _bytes(report.draft_pool_bytes) if report.draft_pool_bytes else "-"),
        ("steady per step", f"attention {report.attention_ms_per_step:.2f} ms, "
                            f"planning {report.planning_ms_per_step:.2f} ms"),
        ("first use", f"{report.first_use_s:.2f} s in {len(report.first_use)} forwards"
                      if report.first_use else "-"),
        ("layers attended", f"{layer_ranges(report.layers_attended)} "
                            f"({len(report.layers_attended)}; draft {report.draft_layers})"),
        ("accept length", "-" if report.accept_len is None else f"{report.accept_len:.2f} tok/step"),
        ("leaked", _leaks(report.leaked)),
        ("fault", ", ".join(f"{k} (acted {v:,}×)" for k, v in report.fault_acted.items())
                  or report.fault or "none"),
        *([("fp8 KV vs bf16", f"max relative error {report.kv_quant_error:.2e} (reported, not "
                               "checked)")] if report.kv_quant_error is not None else []),
        ("status", {"ok": "[green]ok[/]", "inert": "[yellow b]inert[/]"}.get(
            report.status, "[red b]failed[/]")),
    ]
    if report.peak_device_bytes is not None:  # a GPU run: what planning several on one GPU needs
        pairs.append(("peak GPU memory", _bytes(report.peak_device_bytes)))
    g = Table.grid(padding=(0, 2))
    # The long values (bytes, layers) sit on the left: 16+52+13+32 + padding ≈ 119 columns.
    for width in (52, 32):
        g.add_column(style="bold", no_wrap=True)
        g.add_column(max_width=width)
    for i in range(0, len(pairs), 2):
        row = [*pairs[i], *(pairs[i + 1] if i + 1 < len(pairs) else ("", ""))]
        g.add_row(*row)
    return g


def render_summary(report: Report, console: Console) -> None:
    """Print the end-of-run summary: header, parts, per-mode checks, run facts, and the mismatch."""
    colour = {"ok": "green", "inert": "yellow"}.get(report.status, "red")
    console.print(f"[b]swafactory run[/]: {report.combination} on {report.device} "
                  f"(backend {report.backend_choice or report.backend}) → "
                  f"[{colour} b]{report.status.upper()}[/]")
    if report.parts:
        console.print("[b]parts[/]: " + ", ".join(f"{k}={v}" for k, v in report.parts.items()),
                      overflow="fold")
    console.print(_mode_table(report))
    console.print(_facts(report))
    if report.mismatch is not None:
        m = report.mismatch
        body = (f"step {m.step}, {m.worker}/{m.mode}, layer {m.layer} ({m.group}), "
                f"request {m.request}\ncaught by: [b]{m.check}[/]\n{m.error}")
        console.print(Panel(body, title="mismatch", title_align="left", border_style="red",
                            expand=False))
    if report.inert:
        console.print(Panel(report.inert, title="inert: the fault never acted", title_align="left",
                            border_style="yellow", expand=False))


def figure(report: Report):
    """The report.png figure (a matplotlib ``Figure``; tests read its axes, not its pixels)."""
    # Figure + Agg canvas, not pyplot: no global backend switch, nothing ever tries a display.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    h = report.history
    steps = [r.step for r in h]
    fig = Figure(figsize=(9, 10), layout="constrained")
    FigureCanvasAgg(fig)
    ax_pool, ax_err, ax_acc, ax_ms = fig.subplots(4, 1, sharex=True)
    fig.suptitle(f"{report.combination} on {report.device}: {report.status}")

    ax_pool.plot(steps, [r.swa_use for r in h], label="SWA pool")
    ax_pool.plot(steps, [r.full_use for r in h], label="full pool")
    ax_pool.axhline(SWA_PRESSURE, color="grey", linestyle="--", linewidth=1, label="90%")
    ax_pool.set_ylim(0, 1.05)
    ax_pool.set_ylabel("used / total")

    errs = [(r.step, r.max_rel_err) for r in h if r.max_rel_err > 0]  # log scale: zeros = unchecked
    if errs:
        ax_err.semilogy(*zip(*errs), marker=".", linestyle="none", label="max rel err")
        ax_err.axhline(report.tolerance, color="red", linestyle="--", linewidth=1, label="tolerance")
        _legend_outside(ax_err)
    else:
        ax_err.text(0.5, 0.5, "no nonzero errors recorded", ha="center", transform=ax_err.transAxes)
    ax_err.set_ylabel("relative error")

    if any(r.accept_len is not None for r in h):  # NaN: no line across steps without a spec step
        ax_acc.plot(steps, [nan if r.accept_len is None else r.accept_len for r in h],
                    marker=".", linewidth=0.8)
    else:
        ax_acc.text(0.5, 0.5, "no spec steps", ha="center", transform=ax_acc.transAxes)
    ax_acc.set_ylabel("accept length")

    # steady steps only: one first-use step (a minute of JIT compiles) would flatten the rest
    steady = [r for r in h if r.first_use_ms == 0]
    if steady:
        ax_ms.plot([r.step for r in steady], [r.attention_ms for r in steady], marker=".",
                   linewidth=0.8, label="attention")
        # planning is ~1000x smaller than attention: on attention's axis it would lie flat at 0
        ax_plan = ax_ms.twinx()
        ax_plan.plot([r.step for r in steady], [r.planning_ms for r in steady], marker=".",
                     linewidth=0.8, label="planning (right axis)", color="C1")
        ax_plan.set_ylabel("planning ms")
    for r in h:
        if r.first_use_ms > 0:
            ax_ms.axvline(r.step, color="grey", linestyle=":", linewidth=1)
    ax_ms.set_title(f"per step, steady state (dotted: a step with a first use; "
                    f"{report.first_use_s:.2f} s in all)", fontsize="small", loc="left")
    ax_ms.set_ylabel("ms")
    ax_ms.set_xlabel("step")
    if steady:
        _legend_outside(ax_ms, ax_plan)

    if report.mismatch is not None:  # where it stopped, on every panel
        for ax in (ax_pool, ax_err, ax_acc, ax_ms):
            ax.axvline(report.mismatch.step, color="red", linewidth=1,
                       label="mismatch" if ax is ax_pool else None)
    _legend_outside(ax_pool)
    return fig


def _legend_outside(ax, *more) -> None:
    """One legend for ``ax`` (and its twins ``more``), right of the axes: never over the points."""
    pairs = [ax.get_legend_handles_labels(), *(m.get_legend_handles_labels() for m in more)]
    ax.legend([h for hs, _ in pairs for h in hs], [lb for _, ls in pairs for lb in ls],
              loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0, fontsize="small")


def _plot(report: Report, path: Path) -> None:
    figure(report).savefig(path, dpi=110)


def write_report(report: Report, out_dir: Path) -> list[Path]:
    """Write `report.json` and, when matplotlib is installed, `report.png`; returns the paths written."""
    return write_report_files(report, out_dir, _plot)


class RunProgress:
    """Handle yielded by `progress()` on a terminal: a rich bar; `run` calls `update` per `Tick`."""

    def __init__(self, bar: Progress, task: int) -> None:
        self._bar, self._task = bar, task

    def update(self, t: Tick) -> None:
        note = f" · compiling kernels: {t.compiling}" if t.compiling else ""
        self._bar.update(self._task, total=t.requests, completed=t.finished, step=t.step,
                         steps=t.est_steps, checks=f"{t.passed:,}/{t.checks:,}",
                         swa=_pct(t.peak_swa_use), note=note)


class LogProgress:
    """Progress as plain lines, for a log or CI (no terminal): one line when a tenth of the
    estimated steps has passed since the last one, or ``every_s`` seconds of run time, whichever
    comes first; one when a first-use forward starts compiling (CUDA); one at the end. Lines are
    written when a `Tick` comes (between steps), so one step longer than ``every_s`` delays the
    next. Each line is flushed, so `> log` shows it while the run goes on."""

    def __init__(self, file: TextIO, every_s: float = 10.0) -> None:
        self.file, self.clock = file, LineClock(every_s)

    def _print(self, line: str) -> None:
        print(line, file=self.file, flush=True)

    def update(self, t: Tick) -> None:
        head = f"serving: step {t.step}/{t.est_steps}"
        if t.compiling:
            self._print(f"{head} · compiling kernels: first use of {t.compiling} (its time is "
                        "reported apart, as first use, not in the per-step times)")
            return
        first = self.clock.first
        if not self.clock.due(t.step, t.est_steps, t.elapsed_s, t.finished == t.requests):
            return
        note = f" ({t.est_steps} steps estimated from the workload)" if first else ""
        self._print(f"{head}{note} · {t.finished}/{t.requests} requests done · "
                    f"{t.passed:,}/{t.checks:,} checks passed · peak pool use SWA "
                    f"{_pct(t.peak_swa_use)}, full {_pct(t.peak_full_use)} · {t.elapsed_s:.0f} s")


@contextmanager
def progress(console: Console, *, transient: bool = True,
             every_s: float = 10.0) -> Iterator[RunProgress | LogProgress]:
    """The run's progress: on a terminal a rich bar of finished requests with the step, the
    checks and the SWA pool's peak use beside it; elsewhere (logs, CI, Hydra multirun jobs)
    `LogProgress` lines, which carry no control codes."""
    if not console.is_terminal:
        yield LogProgress(console.file, every_s)
        return
    bar = Progress(TextColumn("[b]serving"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("requests · step {task.fields[step]}/{task.fields[steps]} · checks "
                              "{task.fields[checks]} · SWA peak {task.fields[swa]}"
                              "{task.fields[note]}"),
                   TimeElapsedColumn(), console=console, transient=transient)
    task = bar.add_task("serving", total=None, step=0, steps="?", checks="0/0", swa=_pct(0.0),
                        note="")
    with bar:
        yield RunProgress(bar, task)
