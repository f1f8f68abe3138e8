"""Showing a `GenerateReport`: progress lines while it runs, the summary, report.json and
report.png (accept length per step). Rendering only; `engine.run` measures."""
from __future__ import annotations

import time
from pathlib import Path
from typing import TextIO

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from swafactory.engine.report_model import GenerateReport
from swafactory.outputs.progress_lines import LineClock
from swafactory.outputs.report_files import write_report_files

__all__ = ["GenProgress", "render_generate", "write_generate", "figure", "accept_line"]


class GenProgress:
    """Plain progress lines (logs, CI, terminals alike): one every tenth of the estimated steps or
    every ``every_s`` seconds, whichever comes first, and one when the last request finishes.
    The generator calls it after each step; the reference runs print nothing."""

    def __init__(self, file: TextIO, requests: int, est_steps: int, every_s: float = 10.0) -> None:
        self.file, self.requests, self.est = file, requests, est_steps
        self.clock = LineClock(every_s)
        self.t0 = time.perf_counter()
        self.peak_swa = 0.0

    def __call__(self, gen) -> None:
        h = gen.history[-1]
        self.peak_swa = max(self.peak_swa, h.swa_use)
        now = time.perf_counter() - self.t0
        done = len(gen.done) == self.requests
        first = self.clock.first
        if not self.clock.due(gen.step, self.est, now, done):
            return
        est = gen.step if done else max(self.est, gen.step)
        note = f" ({est} steps estimated)" if first else ""
        acc = [a for r in (*gen.done, *gen.running) for a in r.accepts]
        tokens = sum(len(r.generated) for r in (*gen.done, *gen.running))
        print(f"generating: step {gen.step}/{est}{note} · {len(gen.done)}/{self.requests} requests "
              f"done · {tokens} tokens · accept length "
              f"{sum(acc) / len(acc) if acc else 0:.2f} · peak SWA pool use "
              f"{100 * self.peak_swa:.1f}% · {now:.0f} s", file=self.file, flush=True)


def accept_line(r: GenerateReport) -> str | None:
    """``accept length 1.00 tok/step, clean twin 6.86 (at most 8)``: the run's mean accept length
    beside its clean twin's when a fault was on, and the ideal or the most a step commits.
    None without speculative decoding."""
    if r.accept_len is None:
        return None
    twin = "" if r.accept_len_clean is None else f", clean twin {r.accept_len_clean:.2f}"
    bound = f" (ideal {r.ideal_accept_len:g})" if r.ideal_accept_len is not None else \
        f" (at most {r.max_accept_len})" if r.max_accept_len else ""
    return f"accept length {r.accept_len:.2f} tok/step{twin}{bound}"


def render_generate(r: GenerateReport, console: Console) -> None:
    """The end-of-run summary: header, the checks, the figures, the stop reason."""
    colour = {"ok": "green", "inert": "yellow"}.get(r.status, "red")
    console.print(f"[b]swafactory generate[/]: {r.combination} on {r.device} "
                  f"({r.architecture}, transformers {r.transformers}, {r.dtype}) → "
                  f"[{colour} b]{r.status.upper()}[/]")
    console.print(f"[b]draft[/]: {r.draft}", overflow="fold")
    t = Table(title="end-to-end checks", title_justify="left")
    t.add_column("check")
    t.add_column("status")
    t.add_column("detail", overflow="fold")
    for c in r.checks:
        if c.status == "skipped" and c.detail == "not reached" and r.status == "ok":
            continue  # the guards: nothing to say on a clean run
        style = {"ok": "green", "failed": "red b", "skipped": "dim"}[c.status]
        t.add_row(c.name, f"[{style}]{c.status}[/]", c.detail)
    console.print(t)
    tokens = sum(len(q.generated_ids) for q in r.requests)
    logits = "-" if r.logits_max_rel_err is None else \
        f"{r.logits_max_rel_err:.2e} (tol {r.logits_tolerance:.1e}, {r.logits_positions} positions)"
    acc = (accept_line(r) or "-").removeprefix("accept length ")
    pairs = [("requests / tokens", f"{len(r.requests)} / {tokens}"),
             ("wall", f"{r.wall_s:.1f} s, {r.tokens_per_s:.1f} tok/s (+{r.reference_s:.1f} s "
                      "references)"),
             ("logits vs transformers", logits),
             ("lossless", "-" if r.lossless is None else str(r.lossless).lower()),
             ("accept length", acc),
             ("fault / guards", f"{r.fault or 'none'} / {'on' if r.guards else 'off'}"),
             ("caught by", r.caught_by or "-"), ("seed", str(r.seed))]
    g = Table.grid(padding=(0, 2))
    for _ in range(2):
        g.add_column(style="bold", no_wrap=True)
        g.add_column(max_width=48)
    for i in range(0, len(pairs), 2):
        g.add_row(*pairs[i], *pairs[i + 1])
    console.print(g)
    if r.overlap:  # the lead compares these on the GPU
        off = r.tokens_per_s_no_overlap
        console.print(f"[b]tokens/s[/]: {r.tokens_per_s:.1f} with run.overlap=true, " + (
            "- without (not run)" if not off else
            f"{off:.1f} without (x{r.tokens_per_s / off:.2f})"))
    m = r.spec_metrics
    if m is not None and m.num_spec_steps:  # vLLM's per-response figures, per request in report.json
        console.print(f"[b]spec metrics[/]: {m.num_spec_steps} spec steps, "
                      f"{m.num_accepted_tokens} of {m.num_draft_tokens} draft tokens accepted "
                      f"(rate {m.draft_acceptance_rate or 0.0:.2f}), mean acceptance length "
                      f"{m.mean_acceptance_length:.2f}, histogram {m.acceptance_histogram}")
    if r.inert:
        console.print(Panel(r.inert, title="inert: the fault never acted", title_align="left",
                            border_style="yellow", expand=False))
    if r.error:
        console.print(Panel(r.error, title="stopped", title_align="left", border_style="red",
                            expand=False))


def figure(r: GenerateReport):
    """The report.png figure (a matplotlib ``Figure``; tests read its axes, not its pixels)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(9, 8.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax, ax_pool, ax_hist = fig.subplots(3, 1, sharex=False)
    fig.suptitle(f"{r.combination} ({r.architecture}): {r.status}"
                 + (f", caught by {r.caught_by}" if r.caught_by else ""))
    for q in r.requests:
        if q.accept_lengths:
            line, = ax.plot(range(len(q.accept_lengths)), q.accept_lengths, marker=".",
                            linewidth=0.8, label=f"request {q.rid}")
            if q.accept_lengths_clean:  # the twin's steps beside the fault's: a fall over time
                ax.plot(range(len(q.accept_lengths_clean)), q.accept_lengths_clean, linestyle="--",
                        linewidth=0.8, color=line.get_color(), label=f"request {q.rid}, clean twin")
    if r.ideal_accept_len is not None:
        ax.axhline(r.ideal_accept_len, color="grey", linestyle="--", linewidth=1, label="ideal")
    if r.accept_len_clean is not None:
        ax.axhline(r.accept_len_clean, color="green", linestyle=":", linewidth=1.2,
                   label="clean twin (mean)")
    if not any(q.accept_lengths for q in r.requests):
        ax.text(0.5, 0.5, "no spec steps", ha="center", transform=ax.transAxes)
    else:
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0, fontsize="small")
    ax.set_xlabel("spec step of the request")
    ax.set_ylabel("accept length (tokens)")
    steps = [s.step for s in r.steps]
    ax_pool.plot(steps, [s.swa_use for s in r.steps], label="SWA pool")
    ax_pool.plot(steps, [s.full_use for s in r.steps], label="full pool")
    ax_pool.set_ylim(0, 1.05)
    ax_pool.set_xlabel("scheduler step")
    ax_pool.set_ylabel("used / total")
    ax_pool.legend(loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0, fontsize="small")
    _histogram(ax_hist, r)
    for a in (ax, ax_pool, ax_hist):  # steps and lengths are whole numbers: no tick at 0.25
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig


def _histogram(ax, r: GenerateReport) -> None:
    """Per request, how many spec steps committed each accept length (grouped bars)."""
    reqs = [q for q in r.requests if q.accept_histogram]
    if not reqs:
        ax.text(0.5, 0.5, "no spec steps", ha="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    width = 0.8 / len(reqs)
    for i, q in enumerate(reqs):
        xs = [a + (i - (len(reqs) - 1) / 2) * width for a in range(len(q.accept_histogram))]
        ax.bar(xs[1:], q.accept_histogram[1:], width=width, label=f"request {q.rid}")
    ax.set_xlabel("accept length (tokens committed in one spec step)")
    ax.set_ylabel("spec steps")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0, fontsize="small")


def _plot(r: GenerateReport, path: Path) -> None:
    figure(r).savefig(path, dpi=110)


def write_generate(r: GenerateReport, out_dir: Path) -> list[Path]:
    """report.json and (with matplotlib) report.png; returns the paths written."""
    return write_report_files(r, out_dir, _plot, indent=1)
