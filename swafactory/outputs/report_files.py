"""A run's report files, written one way for every driver: ``report.json`` (the pydantic model)
and, when matplotlib is installed, ``report.png`` (the driver's plot)."""
from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel

__all__ = ["write_report_files"]


def write_report_files(report: BaseModel, out_dir: Path, plot: Callable[[BaseModel, Path], None],
                       *, indent: int = 2) -> list[Path]:
    """Write ``out_dir/report.json`` and, with the `plot` extra, ``out_dir/report.png`` drawn by
    ``plot(report, path)``; returns the paths written (a warning names the extra when skipped)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    js = out_dir / "report.json"
    js.write_text(report.model_dump_json(indent=indent))
    try:
        import matplotlib  # noqa: F401 - only to learn whether the `plot` extra is installed
    except ImportError:
        warnings.warn("matplotlib is not installed, so report.png was skipped; "
                      "pip install 'swafactory[plot]' to get it", stacklevel=3)
        return [js]
    png = out_dir / "report.png"
    plot(report, png)
    return [js, png]
