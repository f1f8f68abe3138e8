"""The end-of-run summary, report.json/report.png and the progress (a bar on a terminal, lines in a
log), on hand-built Reports and Ticks."""
from __future__ import annotations

import io
import re
import sys

import pytest
from rich.console import Console

from swafactory.harness.report import (LogProgress, RunProgress, layer_ranges, progress,
                                       render_summary, write_report)
from swafactory.harness.report_model import Report, Tick

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _render(report: Report, width: int = 120) -> str:
    buf = io.StringIO()
    render_summary(report, Console(file=buf, width=width, force_terminal=False, color_system=None))
    return buf.getvalue()


def test_summary_shows_the_key_figures(make_report) -> None:
    text = _render(make_report())
    for needle in ("backend=torch spec=eagle3 model=gemma4", "→ OK", "resolver=split_swa",
                   "kernel=torch_sdpa", "target_verify", "draft_decode",
                   "3.30e-06 (tol 1e-03)",                      # max rel err against the tolerance
                   "SWA 97.3%, full 61.0%",                     # peak pool use
                   "3.00 GiB vs full-only 11.00 GiB (3.67× smaller)", "96.0 MiB",
                   "2.47 tok/step", "attention 12.35 ms, planning 0.46 ms", "321.5 tok/s",
                   "first use      -", "leaked            -",
                   "0-1,5-7,11,59 (7; draft 1)", "1,234 SWA positions"):
        assert needle in text, needle
    assert "mismatch" not in text
    rows = {tuple(c.strip() for c in line.split("│")[1:-1]) for line in text.splitlines()
            if line.startswith("│")}
    assert ("target", "target_verify", "30", "210", "105", "105", "3.30e-06") in rows
    assert ("all", "", "132", "384", "234", "234", "3.30e-06 (tol 1e-03)") in rows


def test_summary_fits_120_columns(make_report) -> None:
    lines = _render(make_report(mismatch=True)).splitlines()
    assert max(len(x) for x in lines) <= 120


def test_summary_of_a_failed_run_names_the_mismatch(make_report) -> None:
    text = _render(make_report(mismatch=True))
    assert "→ FAILED" in text and "window_off_by_one" in text
    assert "step 17, target/target_verify, layer 5 (swa), request r3" in text
    assert "caught by: oracle" in text and "rel err 0.31 > tol 1e-3 at position 4097" in text


def test_summary_without_spec_shows_no_accept_length(make_report) -> None:
    text = _render(make_report(spec=False))
    assert re.search(r"accept length +- ", text) and "tok/step" not in text


def test_write_report_round_trips_and_draws_a_png(make_report, tmp_path) -> None:
    report = make_report(mismatch=True)
    paths = write_report(report, tmp_path / "out")
    assert [p.name for p in paths] == ["report.json", "report.png"]
    assert Report.model_validate_json(paths[0].read_text()) == report
    png = paths[1].read_bytes()
    assert png[:8] == PNG_SIGNATURE and len(png) > 10_000  # three panels, not an empty canvas


def test_plot_gives_planning_its_own_axis_gaps_non_spec_steps_and_keeps_legends_outside(
        make_report) -> None:
    import math

    from swafactory.harness.report import figure

    report = make_report(steps=12)
    history = [r.model_copy(update={"attention_ms": 400.0 + 500 * i, "planning_ms": 0.2 + 0.01 * i})
               for i, r in enumerate(report.history)]
    fig = figure(report.model_copy(update={"history": history}))
    fig.canvas.draw()  # legends and twin axes are placed at draw time
    ax_pool, ax_err, ax_acc, ax_ms, *twins = fig.axes
    # planning on a twin axis of the ms panel, scaled to its own values, not attention's
    [ax_plan] = twins
    assert ax_plan.bbox.bounds == ax_ms.bbox.bounds
    assert [ln.get_label() for ln in ax_plan.get_lines()] == ["planning (right axis)"]
    low, high = ax_plan.get_ylim()
    assert low <= 0.2 and 0.31 <= high < 1.0, (low, high)
    # accept length: a value at each spec step, NaN (a gap, no line) at the steps without one
    [acc] = ax_acc.get_lines()
    x, y = acc.get_xdata(), acc.get_ydata()
    assert list(x) == [r.step for r in history]
    assert [math.isnan(v) for v in y] == [r.accept_len is None for r in history]
    assert math.isnan(y[0]) and not math.isnan(y[-1])
    # every legend lies right of its axes, over none of the points
    for ax in (ax_pool, ax_err, ax_ms):
        legend = ax.get_legend()
        assert legend is not None
        box = legend.get_window_extent(fig.canvas.get_renderer())
        assert box.x0 >= ax.bbox.x1, (ax.get_ylabel(), box, ax.bbox)
    assert {t.get_text() for t in ax_ms.get_legend().get_texts()} == {"attention",
                                                                       "planning (right axis)"}


def test_write_report_without_history_still_draws(make_report, tmp_path) -> None:
    paths = write_report(make_report(spec=False, steps=0), tmp_path)
    assert paths[1].read_bytes()[:8] == PNG_SIGNATURE


def test_write_report_without_matplotlib_writes_json_and_warns(make_report, tmp_path,
                                                               monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.warns(UserWarning, match=r"report.png was skipped.*swafactory\[plot\]"):
        paths = write_report(make_report(), tmp_path)
    assert paths == [tmp_path / "report.json"] and not (tmp_path / "report.png").exists()


@pytest.mark.parametrize("layers,expected", [
    ([], ""), ([3], "3"), ([0, 1, 2, 5, 7, 8], "0-2,5,7-8"), ([5, 1, 0, 5], "0-1,5"),
    (list(range(0, 60, 2)), "0,2,4,6,8,10,12,14,16,18,20,22,24,26,28,…"),
])
def test_layer_ranges(layers, expected) -> None:
    assert layer_ranges(layers) == expected


def _tick(step: int, elapsed: float, *, est: int = 100, finished: int = 0, requests: int = 5,
          compiling: str | None = None) -> Tick:
    return Tick(step=step, est_steps=est, finished=finished, requests=requests, checks=4 * step,
                passed=4 * step, peak_swa_use=0.93, peak_full_use=0.4, elapsed_s=elapsed,
                compiling=compiling)


def test_progress_on_a_terminal_is_a_bar_with_step_checks_and_swa() -> None:
    tty = io.StringIO()
    with progress(Console(file=tty, force_terminal=True, width=140)) as bar:
        assert isinstance(bar, RunProgress)
        for i in range(6):
            bar.update(_tick(3 * i, i, est=20, finished=min(i, 5)))
    text = tty.getvalue()
    assert "5/5" in text and "step 15/20" in text and "checks 60/60" in text
    assert "SWA peak 93.0%" in text


def _log_lines(ticks: list[Tick]) -> list[str]:
    log = io.StringIO()
    with progress(Console(file=log, force_terminal=False, width=100)) as bar:
        assert isinstance(bar, LogProgress)
        for t in ticks:
            bar.update(t)
    assert "\x1b[" not in log.getvalue()  # no control codes in a log
    return log.getvalue().splitlines()


def _steps(lines: list[str]) -> list[int]:
    return [int(re.search(r"step (\d+)/", x).group(1)) for x in lines]


def test_progress_in_a_log_prints_every_tenth_of_the_steps() -> None:
    # fast steps (0.1 s): a line when 10 of the 100 estimated steps have passed, and at the end
    lines = _log_lines([_tick(i, 0.1 * i, finished=5 if i == 100 else 0) for i in range(101)])
    assert _steps(lines) == list(range(0, 101, 10))
    assert "(100 steps estimated from the workload)" in lines[0]
    assert lines[3] == ("serving: step 30/100 · 0/5 requests done · 120/120 checks passed · "
                        "peak pool use SWA 93.0%, full 40.0% · 3 s")


def test_progress_in_a_log_prints_every_10_s_when_steps_are_slow() -> None:
    # slow steps (3 s each, 1000 estimated): a line as soon as 10 s have passed since the last
    lines = _log_lines([_tick(i, 3.0 * i, est=1000) for i in range(13)])
    assert _steps(lines) == [0, 4, 8, 12]


def test_progress_in_a_log_says_when_kernels_compile_and_flushes_each_line(tmp_path) -> None:
    path = tmp_path / "log"
    with path.open("w") as f:  # a file is block-buffered: each line must be flushed to be seen
        bar = LogProgress(f)
        bar.update(_tick(0, 0.0))
        assert "step 0/100" in path.read_text()
        bar.update(_tick(0, 0.5, compiling="target/extend"))
        assert "step 0/100 · compiling kernels: first use of target/extend" in path.read_text()
        bar.update(_tick(1, 0.6))  # the compile notice is not a progress line: not due yet
    assert len(path.read_text().splitlines()) == 2


def test_a_gpu_run_shows_its_peak_device_memory_within_120_columns(make_report) -> None:
    text = _render(make_report().model_copy(update={"peak_device_bytes": 23 * 2**30}))
    assert "peak GPU memory" in text and "23.00 GiB" in text
    assert max(len(x) for x in text.splitlines()) <= 120
    assert "peak GPU memory" not in _render(make_report())  # CPU reports leave it out


def test_summary_shows_first_use_apart_and_the_leak_books(make_report) -> None:
    report = make_report().model_copy(update={
        "first_use_s": 61.234, "first_use": {"target/extend": 40.0, "target/decode": 21.234},
        "leaked": {"target.full": 0, "target.swa": 0, "req_to_token": 0}})
    text = _render(report)
    assert "steady per step   attention 12.35 ms, planning 0.46 ms" in text
    assert "first use      61.23 s in 2 forwards" in text
    assert "none (3 pools and tables)" in text
    leaky = report.model_copy(update={"leaked": {"target.full": 0, "target.swa": 6,
                                                 "req_to_token": 1}})
    text = _render(leaky)
    assert "target.swa 6, req_to_token 1" in text and "target.full" not in text
    assert max(len(x) for x in text.splitlines()) <= 120
