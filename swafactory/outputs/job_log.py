"""The job's console, teed into Hydra's job log: `<output dir>/<job name>.log` (`__main__.log`).

Hydra's job logging opens that file through Python logging, but the run prints its plan, summary
and progress with rich, not through a logger; so the console writes to stdout and appends the same
text, without colour codes, to the log file Hydra's root `FileHandler` opened in the output dir. A
live progress bar (a terminal only) redraws in place: `screen_only` keeps its frames out of the log.
"""
from __future__ import annotations

import io
import logging
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from rich.console import Console

__all__ = ["job_console", "job_log_path", "screen_only", "log_line"]

# CSI (colours, cursor moves) and OSC (hyperlinks) escape sequences: a log file is plain text
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)")


def job_log_path(output_dir: Path | None) -> Path | None:
    """The log file Hydra's job logging writes in ``output_dir``; None without one (the API,
    `hydra/job_logging=disabled`, or a logging config that writes elsewhere)."""
    if output_dir is None:
        return None
    for h in logging.getLogger().handlers:
        path = Path(h.baseFilename) if isinstance(h, logging.FileHandler) else None
        if path is not None and path.parent == output_dir.resolve():
            return path
    return None


class _Tee(io.TextIOBase):
    """stdout plus the job log (colour codes stripped); a terminal if stdout is one."""

    def __init__(self, screen: TextIO, log: TextIO) -> None:
        self.screen, self.log, self.logging = screen, log, True

    def write(self, s: str) -> int:
        self.screen.write(s)
        if self.logging:
            self.log.write(_ANSI.sub("", s))
            self.log.flush()  # Hydra's handler appends to the same file: keep the order
        return len(s)

    def flush(self) -> None:
        self.screen.flush()
        self.log.flush()

    def isatty(self) -> bool:
        return self.screen.isatty()


@contextmanager
def job_console(output_dir: Path | None) -> Iterator[Console]:
    """A rich console on stdout (140 columns off a terminal), teed into the job log when the
    output dir has one."""
    width = None if sys.stdout.isatty() else 140
    path = job_log_path(output_dir)
    if path is None:
        yield Console(file=sys.stdout, width=width)
        return
    with path.open("a", encoding="utf-8") as log:
        yield Console(file=_Tee(sys.stdout, log), width=width)


@contextmanager
def screen_only(console: Console) -> Iterator[None]:
    """On a terminal, keep what is written meanwhile (a live bar's redraws) out of the job log;
    off a terminal progress is plain lines, which the log keeps."""
    tee = console.file if isinstance(console.file, _Tee) and console.is_terminal else None
    if tee is not None:
        tee.logging = False
    try:
        yield
    finally:
        if tee is not None:
            tee.logging = True


def log_line(console: Console, line: str) -> None:
    """Put ``line`` in the job log only (what the run says on stderr: refusals, failures)."""
    if isinstance(console.file, _Tee):
        console.file.log.write(line.rstrip("\n") + "\n")
        console.file.log.flush()
