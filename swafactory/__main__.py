"""`python -m swafactory …` / `swafactory …`: the Hydra app. The only place that maps errors to exit codes.

Exit codes: 0 ok; 1 conformance failure; 2 configuration refused (message on stderr, no traceback);
3 inert (no check failed, but the injected fault never acted: the run proves nothing).
In a multirun sweep each job records its outcome in result.json (a refusal raised before the first
forward makes the job `refused`) and the sweep goes on; the sweep then exits with its worst job
(ok < refused < inert < failed): 1 if any failed, else 3 if any was inert, else 2 if any was
refused, else 0.
"""
from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from swafactory.config.paths import conf_dir
from swafactory.errors import (EXIT_CONFIG, EXIT_CONFORMANCE, EXIT_INERT, EXIT_OK, CapacityError,
                               ConfigError)

EXIT_FOR_STATUS = {"ok": EXIT_OK, "refused": EXIT_CONFIG, "inert": EXIT_INERT,
                   "failed": EXIT_CONFORMANCE}

_ran_task = False


@hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="config")
def _app(cfg: DictConfig) -> None:
    global _ran_task
    _ran_task = True
    from swafactory.cli.jobs import run_cli

    hc = HydraConfig.get()
    try:
        code = run_cli(cfg, Path(hc.runtime.output_dir), overrides=list(hc.overrides.task),
                       sweep=hc.mode == RunMode.MULTIRUN)
    except (ConfigError, CapacityError) as exc:
        print(exc, file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    if code:
        sys.exit(code)


def main() -> None:
    """Console-script entry point."""
    if any(a in ("--help", "-h") for a in sys.argv[1:]):
        from swafactory.cli.jobs import help_text

        print(help_text(), flush=True)  # what swafactory is, its exit codes and groups; Hydra's next
    from swafactory.cli.jobs import did_you_mean
    from swafactory.config.typos import unknown_keys

    for line in did_you_mean(sys.argv[1:]):  # a mistyped option: the guess, then Hydra's list
        print(line, file=sys.stderr, flush=True)
    typos = unknown_keys(sys.argv[1:])  # a mistyped field: refused before Hydra's "use +" advice
    if typos:
        asked = " ".join(a for a in sys.argv[1:] if not a.lstrip("+~").startswith("hydra."))
        print(ConfigError(typos, headline=f"cannot compose {asked}:"),
              file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    try:
        _app()
    except SystemExit as exc:
        # Hydra exits 1 when composition fails (unknown option, bad override) before our task
        # runs; that is a refused configuration too.
        if not _ran_task and exc.code not in (0, None):
            raise SystemExit(EXIT_CONFIG) from None
        raise
    from swafactory.harness.callback import last_sweep_status

    status = last_sweep_status()  # set when a multirun sweep ended in this process
    if status is not None and status != "ok":
        print(f"sweep: worst job {status}, exit {EXIT_FOR_STATUS[status]} (see matrix.md)",
              file=sys.stderr)
        sys.exit(EXIT_FOR_STATUS[status])


if __name__ == "__main__":
    main()
