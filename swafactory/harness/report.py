"""Showing a `Report`: the end-of-run summary, report.json + report.png, and the live progress bar.

Rendering only; the harness measures. matplotlib is optional (the `plot` extra): without it the run
still writes report.json and warns that the picture was skipped.
"""
from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from swafactory.harness.report_model import Report

__all__ = ["render_summary", "write_report", "progress", "RunProgress", "layer_ranges"]

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


def _facts(report: Report) -> Table:
    """The run's figures, two key/value pairs per row."""
    saving = report.full_only_bytes / report.hybrid_bytes if report.hybrid_bytes else 0.0
    pairs = [
        ("requests / steps", f"{report.requests:,} / {report.steps:,}"),
        ("wall", f"{report.wall_s:.1f} s, {report.tokens_per_s:,.1f} tok/s"),
        ("peak pool use", f"SWA {_pct(report.peak_swa_use)}, full {_pct(report.peak_full_use)}"),
        ("evictions", f"{report.evictions:,} SWA positions"),
        ("target pools", f"{_bytes(report.hybrid_bytes)} vs full-only "
                         f"{_bytes(report.full_only_bytes)} ({saving:.2f}× smaller)"),
        ("draft pool", _bytes(report.draft_pool_bytes) if report.draft_pool_bytes else "-"),
        ("per step", f"attention {report.attention_ms_per_step:.2f} ms, "
                     f"planning {report.planning_ms_per_step:.2f} ms"),
        ("accept length", "-" if report.accept_len is None else f"{report.accept_len:.2f} tok/step"),
        ("layers attended", f"{layer_ranges(report.layers_attended)} "
                            f"({len(report.layers_attended)}; draft {report.draft_layers})"),
        ("fault", report.fault or "none"),
        ("status", "[green]ok[/]" if report.status == "ok" else "[red b]failed[/]"),
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
    colour = "green" if report.status == "ok" else "red"
    console.print(f"[b]swafactory run[/]: {report.combination} on {report.device} "
                  f"(backend {report.backend}) → [{colour} b]{report.status.upper()}[/]")
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


def _plot(report: Report, path: Path) -> None:
    # Figure + Agg canvas, not pyplot: no global backend switch, nothing ever tries a display.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    h = report.history
    steps = [r.step for r in h]
    fig = Figure(figsize=(9, 8), layout="constrained")
    FigureCanvasAgg(fig)
    ax_pool, ax_err, ax_acc = fig.subplots(3, 1, sharex=True)
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
        ax_err.legend(loc="lower right", fontsize="small")
    else:
        ax_err.text(0.5, 0.5, "no nonzero errors recorded", ha="center", transform=ax_err.transAxes)
    ax_err.set_ylabel("relative error")

    acc = [(r.step, r.accept_len) for r in h if r.accept_len is not None]
    if acc:
        ax_acc.plot(*zip(*acc), marker=".", linewidth=0.8)
    else:
        ax_acc.text(0.5, 0.5, "no spec steps", ha="center", transform=ax_acc.transAxes)
    ax_acc.set_ylabel("accept length")
    ax_acc.set_xlabel("step")

    if report.mismatch is not None:  # where it stopped, on every panel
        for ax in (ax_pool, ax_err, ax_acc):
            ax.axvline(report.mismatch.step, color="red", linewidth=1,
                       label="mismatch" if ax is ax_pool else None)
    ax_pool.legend(loc="lower right", fontsize="small")
    fig.savefig(path, dpi=110)


def write_report(report: Report, out_dir: Path) -> list[Path]:
    """Write `report.json` and, when matplotlib is installed, `report.png`; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    js = out_dir / "report.json"
    js.write_text(report.model_dump_json(indent=2))
    try:
        import matplotlib  # noqa: F401 - only to learn whether the `plot` extra is installed
    except ImportError:
        warnings.warn("matplotlib is not installed, so report.png was skipped; "
                      "pip install 'swafactory[plot]' to get it", stacklevel=2)
        return [js]
    png = out_dir / "report.png"
    _plot(report, png)
    return [js, png]


class RunProgress:
    """Handle yielded by `progress()`; the serving loop calls `update` once per step."""

    def __init__(self, bar: Progress, task: int) -> None:
        self._bar, self._task = bar, task

    def update(self, finished: int, step: int, swa_use: float) -> None:
        self._bar.update(self._task, completed=finished, step=step, swa=_pct(swa_use))


@contextmanager
def progress(total_requests: int, console: Console, *, transient: bool = True) -> Iterator[RunProgress]:
    """A rich progress bar of finished requests, with the step and SWA pool use beside it.

    Off when the console is not a terminal (logs, pytest, Hydra multirun jobs), so no control
    codes land in files; `update` still works then.
    """
    bar = Progress(TextColumn("[b]serving"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("requests · step {task.fields[step]} · SWA {task.fields[swa]}"),
                   TimeElapsedColumn(), console=console, transient=transient,
                   disable=not console.is_terminal)
    task = bar.add_task("serving", total=total_requests, step=0, swa=_pct(0.0))
    with bar:
        yield RunProgress(bar, task)
