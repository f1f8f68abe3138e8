"""The end-of-run summary, report.json/report.png and the progress bar, on hand-built Reports."""
from __future__ import annotations

import io
import re
import sys

import pytest
from rich.console import Console

from swafactory.harness.report import layer_ranges, progress, render_summary, write_report
from swafactory.harness.report_model import Report

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


def test_progress_renders_on_a_terminal_and_is_silent_elsewhere() -> None:
    tty, log = io.StringIO(), io.StringIO()
    for buf, term in ((tty, True), (log, False)):
        with progress(5, Console(file=buf, force_terminal=term, width=100)) as bar:
            for i in range(6):
                bar.update(finished=min(i, 5), step=3 * i, swa_use=0.93)
    assert "5/5" in tty.getvalue() and "step 15" in tty.getvalue() and "SWA 93.0%" in tty.getvalue()
    assert log.getvalue() == ""


def test_a_gpu_run_shows_its_peak_device_memory_within_120_columns(make_report) -> None:
    text = _render(make_report().model_copy(update={"peak_device_bytes": 23 * 2**30}))
    assert "peak GPU memory" in text and "23.00 GiB" in text
    assert max(len(x) for x in text.splitlines()) <= 120
    assert "peak GPU memory" not in _render(make_report())  # CPU reports leave it out
