"""README.md is a user's first page: short, free of working numbers, its links and its CLI line live.

The detail lives in docs/ (cli.md, architecture.md, faults.md, sweeps.md, measured.md); the README
keeps what a user needs first, so its length is capped, and the one command it tells a user to
type after `make run` is run here as written.
"""
from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 250
# the project's own working numbers mean nothing to a reader; other projects' bug references
# ("sglang #24743") are fine and do not match
WORKING_NUMBERS = re.compile(r"session [0-9]|call [0-9]+\.[0-9]|item [0-9]|issue #?[0-9]+")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # [text](target), images included
FENCED = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
CLI = ".venv/bin/python -m swafactory"
VENV_PYTHON = ROOT / ".venv" / "bin" / "python"


def documented_cli_line(text: str) -> str | None:
    """The first line inside a ```-fenced block that starts with the venv's `python -m swafactory`."""
    for block in FENCED.finditer(text):
        for line in block.group(1).splitlines():
            if line.strip().startswith(CLI):
                return line.strip()
    return None


def test_readme_is_at_most_250_lines() -> None:
    n = len(README.read_text().splitlines())
    assert n <= MAX_LINES, (f"README.md has {n} lines, more than {MAX_LINES}: move the detail to a "
                            "page under docs/ and link it")


@pytest.mark.parametrize("path", [README, *sorted((ROOT / "docs").rglob("*.md")),
                                  *sorted((ROOT / "bench").glob("*.md")),
                                  *sorted((ROOT / "bench" / "results").glob("*.md"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_working_numbers(path: Path) -> None:
    hits = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
            for i, line in enumerate(path.read_text().splitlines(), 1)
            if WORKING_NUMBERS.search(line)]
    assert not hits, ("working numbers (session, call, item, issue) in user docs; say what the "
                      "reference means or name its commit and date instead:\n" + "\n".join(hits))


def test_every_relative_link_in_readme_exists() -> None:
    missing = []
    for target in LINK.findall(README.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL (https:, mailto:) or an anchor in the README itself
        path = target.split("#", 1)[0]
        if not (README.parent / path).exists():
            missing.append(target)
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_readme_shows_the_venv_cli_line() -> None:
    assert documented_cli_line(README.read_text()), (
        f"README.md needs a ```-fenced line starting with `{CLI}` (the command to type after "
        "`make run`; a plain `python -m swafactory` outside the venv cannot import swafactory)")


@pytest.mark.skipif(not VENV_PYTHON.exists(), reason="no .venv/bin/python: run `make run` first")
def test_the_documented_cli_line_runs(tmp_path: Path) -> None:
    line = documented_cli_line(README.read_text())
    assert line, "README.md has no documented CLI line"
    args = shlex.split(line, comments=True)
    args[0] = str(VENV_PYTHON)  # the README's relative path, taken from the repository root
    # Hydra's output dirs go to tmp_path, so the test leaves nothing in the working tree
    args += [f"hydra.run.dir={tmp_path / 'run'}", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (f"`{line}` (from README.md) exited {done.returncode}:\n"
                                  f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
