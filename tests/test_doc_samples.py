"""The sample outputs in README.md and docs/cli.md come from real runs, so they cannot go stale.

Each sample sits between markers naming its command::

    <!-- sample: python -m swafactory run=plan -->      the whole output, generated
    <!-- excerpt: python -m swafactory … -->            lines picked by hand, checked
    ```
    $ python -m swafactory …
    …
    ```
    <!-- /sample -->                                     (or <!-- /excerpt -->)

The test runs every command once, as a user would (no terminal, ``COLUMNS`` fixed, Hydra's
output in a temporary folder), and compares. Times and rates are left out of the docs (``…``);
relative errors vary with the machine's float reductions and are compared as ``…`` too; every
count, size, percentage and line must match. A ``sample`` holds the whole output, the progress
lines cut to the first and the last. An ``excerpt`` holds some of its lines, in order: a line
``…`` skips any lines, and ``…`` inside a line stands for any text.

After an intended change, ``SWAFACTORY_UPDATE_SNAPSHOTS=1 pytest tests/test_doc_samples.py``
rewrites the samples (and an excerpt's lines without ``…`` of their own) from the runs; review
the diff.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch

from cli_process import run_cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "docs" / "cli.md"]
BLOCK = re.compile(r"^<!-- (sample|excerpt)(?: cols=(\d+))?: (.+?) -->\n```\n(.*?)```\n"
                   r"<!-- /\1 -->$", re.M | re.S)
COLS = 130
HYDRA_DIR = "outputs/<date>/<time>"
# a duration or a rate: "74 s", "669.82 ms", "139.1 tok/s" (not "1.67 tok/step", not counts)
TIMES = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?= ?(?:s|ms|tok/s)\b)")
REL_ERR = re.compile(r"\b\d\.\d\de[-+]\d\d\b")
UPDATE = os.environ.get("SWAFACTORY_UPDATE_SNAPSHOTS") == "1"
FIGURES = {"python -m swafactory > log": ROOT / "docs" / "img" / "report.png"}
"""A sample run's report.png that a page shows, copied with the sample."""

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="the samples are the CPU machine's outputs")


def blocks(text: str) -> list[re.Match]:
    return list(BLOCK.finditer(text))


def _timeless(line: str) -> str:
    """Durations and rates as ``…``, in the number's width (tables stay aligned)."""
    return TIMES.sub(lambda m: "…".rjust(len(m.group())), line)


def _key(line: str) -> str:
    """What two lines must share: times and relative errors out, whitespace runs as one."""
    return " ".join(REL_ERR.sub("…", _timeless(line)).split())


def _matches(doc: str, out: str, *, numbers: bool = False) -> bool:
    """``doc`` (``…`` = any text) against an output line; ``numbers``: any number too."""
    def part(p: str) -> str:
        if not numbers:
            return re.escape(p)
        return "".join(r"\d[\d.,]*" if t[:1].isdigit() else re.escape(t)
                       for t in re.split(r"(\d[\d.,]*)", p) if t)
    pat = ".*".join(part(p) for p in _key(doc).split("…"))
    return re.fullmatch(pat, _key(out)) is not None


_RUNS: dict[tuple[str, int], list[str]] = {}


def run_sample(command: str, cols: int, tmp: Path) -> list[str]:
    """The console lines of ``command`` (``$ python -m swafactory …``; a trailing ``> log`` only
    says that no terminal is attached), as the docs show them."""
    key = (command, cols)
    if key in _RUNS:
        return _RUNS[key]
    words = shlex.split(command)
    if ">" in words:
        words = words[:words.index(">")]
    assert words[:3] == ["python", "-m", "swafactory"], command
    run_dir = tmp / f"run{len(_RUNS)}"
    env = {**os.environ, "COLUMNS": str(cols), "HYDRA_FULL_ERROR": "0"}
    env.pop("SWAFACTORY_ORACLE", None)  # the samples are a user's defaults
    done = run_cli([*words[3:], f"hydra.run.dir={run_dir}"], cwd=tmp, env=env, timeout=900,
                   merge_stderr=True)
    lines = [ln.rstrip().replace(str(run_dir), HYDRA_DIR) for ln in done.stdout.splitlines()]
    progress = [i for i, ln in enumerate(lines) if ln.startswith("serving: step ")]
    if len(progress) > 2:  # how many come depends on the machine's speed: first and last
        lines[progress[0] + 1:progress[-1]] = ["…"]
    _RUNS[key] = [f"$ {command}", *(_timeless(ln) for ln in lines)]
    if UPDATE and command in FIGURES and (run_dir / "report.png").is_file():
        shutil.copyfile(run_dir / "report.png", FIGURES[command])
    return _RUNS[key]


def _excerpt(doc: list[str], out: list[str], *, numbers: bool = False) -> list[int] | str:
    """The output line each doc line matched, in order (``…`` lines skip), or what failed."""
    at, got, skip = 0, [], False
    for line in doc:
        if line.strip() == "…":
            skip = True
            continue
        hit = next((i for i in range(at, len(out) if skip else min(at + 1, len(out)))
                    if _matches(line, out[i], numbers=numbers)), None)
        if hit is None:
            where = "after" if skip else "right after"
            return f"{line!r} is not {where} output line {at} of:\n" + "\n".join(out)
        got.append(hit)
        at, skip = hit + 1, False
    return got


def _refresh(kind: str, doc: list[str], out: list[str]) -> list[str]:
    """A sample's new lines: the output; an excerpt's: each line without ``…`` of its own
    replaced by the output line it matches modulo numbers."""
    if kind == "sample":
        return out
    hits = _excerpt(doc, out, numbers=True)
    assert not isinstance(hits, str), hits
    it, new = iter(hits), []
    for ln in doc:
        if ln.strip() == "…":
            new.append(ln)
            continue
        i = next(it)  # a line whose only `…` are the output's left-out times is the output's
        new.append(out[i] if ln.count("…") == out[i].count("…") else ln)
    return new


CASES = [(p, m.group(3)) for p in DOCS for m in blocks(p.read_text())]


def test_the_docs_hold_their_samples() -> None:
    """The samples a user compares first: the README's first example and the default job."""
    found = {(p.name, cmd.split(" > ")[0]) for p, cmd in CASES}
    assert ("README.md", "python -m swafactory backend=torch spec=eagle3 model=gemma4") in found
    assert ("cli.md", "python -m swafactory") in found
    plan = "python -m swafactory backend=torch spec=eagle3 model=gemma4 run=plan"
    assert ("cli.md", plan) in found


@pytest.mark.parametrize("path,command", CASES, ids=[f"{p.name}: {c}" for p, c in CASES])
def test_a_sample_is_what_the_command_prints(path: Path, command: str, tmp_path_factory) -> None:
    text = path.read_text()
    m = next(m for m in blocks(text) if m.group(3) == command)
    kind, cols = m.group(1), int(m.group(2) or COLS)
    out = run_sample(command, cols, tmp_path_factory.getbasetemp())
    doc = m.group(4).splitlines()
    if UPDATE:
        new = "\n".join(_refresh(kind, doc, out)) + "\n"
        path.write_text(text[:m.start(4)] + new + text[m.end(4):])
        return
    if kind == "sample":
        assert [_key(x) for x in doc] == [_key(x) for x in out], (
            f"{path.name}'s sample of `{command}` is stale; regenerate it with "
            "SWAFACTORY_UPDATE_SNAPSHOTS=1 pytest tests/test_doc_samples.py")
    else:
        hits = _excerpt(doc, out)
        assert not isinstance(hits, str), f"{path.name}'s excerpt of `{command}`: {hits}"
