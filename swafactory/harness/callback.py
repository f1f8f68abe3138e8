"""`-m` sweeps: each job writes `result.json` (a `JobResult`); `MatrixCallback` gathers them into matrix.md.

Hydra instantiates the callback from `hydra.callbacks.matrix._target_` in conf/config.yaml. The
matrix is rebuilt after every job as well as at the end: Hydra's sweeper re-raises the first failed
job's exception before `on_multirun_end`, and a remote launcher may never return, so the file
should already be there when either happens. At the end the callback also records the sweep's
worst status (`sweep_status`), which `swafactory.__main__` turns into the exit code.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Literal

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from swafactory.harness.report_model import Report

__all__ = ["JobResult", "MatrixCallback", "build_matrix", "write_matrix", "sweep_status",
           "last_sweep_status", "SEVERITY", "RESULT_FILE", "MATRIX_FILE"]

RESULT_FILE = "result.json"
MATRIX_FILE = "matrix.md"


class JobResult(BaseModel):
    """What one job of a sweep wrote to `<job output dir>/result.json`."""

    model_config = ConfigDict(extra="forbid")

    combination: str
    """`backend=… spec=… model=…`, as the run prints it."""
    overrides: list[str]
    """The job's task overrides (`HydraConfig.get().overrides.task`)."""
    backend: str
    spec: str
    model: str
    workload: str
    status: Literal["ok", "refused", "inert", "failed"]
    reasons: list[str] = []
    """Why the combination was refused, one printed bullet each (`refused` only)."""
    report: Report | None = None
    """The run's report (`ok`, `inert` and `failed` runs; None for `run=plan` and for a job that
    crashed)."""
    error: str | None = None
    """An exception that ended the job before a Report existed (`failed` only), or a
    `run=generate` job's verdict (`failed`: the check that caught it; `inert`: the fault that
    never acted), which has no conformance Report."""
    accept: str | None = None
    """A `run=generate` job with speculative decoding: its mean accept length, beside its clean
    twin's where a fault was on (`engine.report.accept_line`)."""

    @model_validator(mode="after")
    def _status_has_its_evidence(self) -> JobResult:
        # A "refused" or "failed" row without its reasons or evidence would hide a bug.
        if self.status == "refused" and not self.reasons:
            raise ValueError("status 'refused' needs at least one reason")
        if self.status == "failed" and self.report is None and not self.error:
            raise ValueError("status 'failed' needs the report or the error")
        if self.status == "inert" and not (self.report and self.report.inert or self.error):
            raise ValueError("status 'inert' needs the report saying which fault never acted")
        return self


def _cell(text: str) -> str:
    """Make text safe inside one markdown table cell."""
    return text.replace("|", "\\|").replace("\r", "").strip().replace("\n", "<br>")


def _ok_details(r: Report) -> str:
    acc = "-" if r.accept_len is None else f"{r.accept_len:.2f}"
    return (f"{r.passed:,}/{r.checks:,} checks, max rel err {r.max_rel_err:.1e}, "
            f"peak SWA {100 * r.peak_swa_use:.1f}%, accept {acc}"
            + "".join(f"\n{x}" for x in (_acted(r), r.backend_choice) if x))


def _acted(r: Report) -> str:
    """``fault `x` acted 12×`` per injected fault (empty without one)."""
    return ", ".join(f"fault `{k}` acted {v:,}×" for k, v in r.fault_acted.items())


def _failed_details(res: JobResult) -> str:
    r = res.report
    lines = [f"error: {res.error}"] if res.error else []
    if r is not None and r.fault:
        lines.append(_acted(r) or f"fault `{r.fault}`")
    if r is not None and r.backend_choice:
        lines.append(r.backend_choice)
    if r is not None and r.mismatch is not None:
        m = r.mismatch
        lines.append(f"{m.check} check: step {m.step}, {m.worker}/{m.mode}, layer {m.layer} "
                     f"({m.group}), request {m.request}: {m.error}")
    elif r is not None:
        lines.append(f"{r.passed:,}/{r.checks:,} checks passed (no mismatch recorded)")
    return "<br>".join(_cell(x) for x in lines)


def _key(res: JobResult) -> tuple[str, str, str, str]:
    return res.backend, res.spec, res.model, res.workload


def _distinct(res: JobResult, same: list[JobResult]) -> str:
    """The overrides of ``res`` that not every job in ``same`` (its rows with the same backend,
    spec, model and workload) shares: what tells those rows apart."""
    own = [o for o in res.overrides if not all(o in r.overrides for r in same)]
    return " ".join(f"`{o}`" for o in own)


def _row(res: JobResult, same: list[JobResult] = ()) -> str:
    if res.status == "ok":
        details = _cell(_ok_details(res.report)) if res.report else "planned only (no report)"
    elif res.status == "refused":
        details = "<br>".join(_cell(x) for x in res.reasons)
    elif res.status == "inert":
        details = ("<br>".join(_cell(x) for x in (res.report.inert, _ok_details(res.report)))
                   if res.report else _cell(res.error or ""))
    else:
        details = _failed_details(res)
    if res.accept:  # a generate job (no conformance report): its accept length leads the row
        details = _cell(res.accept) + ("" if res.status == "ok" else "<br>" + details)
    apart = _distinct(res, same) if len(same) > 1 else ""
    if apart:
        details = _cell(apart) + "<br>" + details
    cells = [res.backend, res.spec, res.model, res.workload, f"**{res.status}**"]
    return "| " + " | ".join(_cell(c) for c in cells) + f" | {details} |"


def _job_dirs_without_result(sweep_dir: Path, with_result: set[Path]) -> list[tuple[Path, str]]:
    """Jobs Hydra started (they have .hydra/overrides.yaml) that never wrote result.json."""
    missing = []
    for ov in sorted(sweep_dir.rglob(".hydra/overrides.yaml")):
        job = ov.parent.parent
        if job not in with_result:
            missing.append((job, " ".join(OmegaConf.load(ov) or [])))
    return missing


def _collect(sweep_dir: Path) -> tuple[list[JobResult], list[tuple[Path, str]], list[tuple[Path, str]]]:
    """Every job's result (sorted by backend, spec, model), the unreadable result files and the
    started jobs that wrote none."""
    results: list[JobResult] = []
    unreadable: list[tuple[Path, str]] = []
    seen: set[Path] = set()
    for path in sorted(sweep_dir.rglob(RESULT_FILE)):
        seen.add(path.parent)
        try:
            results.append(JobResult.model_validate_json(path.read_text()))
        except (ValidationError, ValueError, OSError) as exc:
            first = str(exc).splitlines()
            unreadable.append((path, " ".join(first[:3])))
    results.sort(key=lambda r: (r.backend, r.spec, r.model, r.workload, r.overrides))
    return results, unreadable, _job_dirs_without_result(sweep_dir, seen)


SEVERITY = {"ok": 0, "refused": 1, "inert": 2, "failed": 3}
"""ok < refused < inert < failed: a sweep is as bad as its worst job (a refusal is expected in a
sweep over combinations; an inert fault run is a proof that did not happen)."""


def sweep_status(sweep_dir: Path) -> Literal["ok", "refused", "inert", "failed"]:
    """The worst status of the sweep's jobs; a job without a readable result counts as failed."""
    results, unreadable, missing = _collect(sweep_dir)
    if unreadable or missing:
        return "failed"
    return max((r.status for r in results), key=SEVERITY.__getitem__, default="ok")


_last_status: list[str] = []


def last_sweep_status() -> str | None:
    """`sweep_status` of the last sweep this process ended (`MatrixCallback.on_multirun_end`);
    None when none ended here. `swafactory.__main__` maps it to the exit code."""
    return _last_status[-1] if _last_status else None


def build_matrix(sweep_dir: Path) -> str:
    """The matrix.md text for every result.json under `sweep_dir`, sorted by backend, spec, model."""
    results, unreadable, missing = _collect(sweep_dir)
    counts = {s: sum(r.status == s for r in results) for s in SEVERITY}
    out = [f"# swafactory sweep: {len(results)} combinations",
           "",
           f"{counts['ok']} ok, {counts['refused']} refused, {counts['failed']} failed, "
           f"{counts['inert']} inert (a fault that never acted). Sweep dir: "
           f"`{sweep_dir}`. Generated by `MatrixCallback` from each job's `result.json`.",
           "",
           "| backend | spec | model | workload | result | details |",
           "|---|---|---|---|---|---|",
           *(_row(r, [x for x in results if _key(x) == _key(r)]) for r in results)]
    if unreadable or missing:
        out += ["", "## Jobs without a readable result", ""]
        out += [f"- `{p.relative_to(sweep_dir)}`: {_cell(e)}" for p, e in unreadable]
        out += [f"- `{d.relative_to(sweep_dir)}` ({_cell(o) or 'no overrides'}): no {RESULT_FILE} "
                "yet (still running, or it crashed or was killed; see its log)" for d, o in missing]
    return "\n".join(out) + "\n"


def write_matrix(sweep_dir: Path) -> Path:
    """Write `sweep_dir/matrix.md` atomically (parallel jobs may rebuild it at the same moment)."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    path = sweep_dir / MATRIX_FILE
    fd, tmp = tempfile.mkstemp(prefix=".matrix.", suffix=".md", dir=sweep_dir)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(build_matrix(sweep_dir))
    os.chmod(tmp, 0o644)  # mkstemp makes 0600; matrix.md is read like every other output
    os.replace(tmp, path)
    return path


def _sweep_dir(config: DictConfig) -> Path:
    # A relative sweep dir is relative to where the user launched, not to a job's (maybe chdir'd) cwd.
    d = Path(str(config.hydra.sweep.dir))
    return d if d.is_absolute() else Path(str(config.hydra.runtime.cwd)) / d


class MatrixCallback(Callback):
    """Writes matrix.md into the sweep dir: after each job, and once more (printing the path) at the end."""

    def on_job_end(self, config: DictConfig, job_return: Any = None, **kwargs: Any) -> None:
        if OmegaConf.select(config, "hydra.mode") == RunMode.MULTIRUN:  # single runs have no matrix
            write_matrix(_sweep_dir(config))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = _sweep_dir(config)
        print(f"wrote {write_matrix(sweep_dir)}")
        _last_status.append(sweep_status(sweep_dir))
