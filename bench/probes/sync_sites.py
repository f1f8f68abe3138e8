"""Where does a harness run wait for the GPU? (synchronizing CUDA calls counted by call site)

A dozen harness processes share one GPU in the serve matrix; the GPU time-slices between their
contexts, so every sync waits for the others' turns and a run's speed follows its sync count
more than its kernels. This runs one harness run under ``torch.cuda.set_sync_debug_mode("warn")``
and attributes each warning to the innermost ``swafactory`` frame.

    python3 bench/probes/sync_sites.py OUT.json [OVERRIDE ...]   (GPU host; default: gemma4 smoke)
Prints the run's syncs per step and the top sites; writes them all to OUT.json.
"""
from __future__ import annotations

import json
import sys
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

DEFAULT = ["backend=torch", "model=gemma4", "spec=eagle3", "workload=smoke"]


def site() -> str:
    """The innermost frame in the package (or this script's caller chain) that asked for the sync."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/swafactory/" in frame.filename:
            return f"{frame.filename.split('/swafactory/', 1)[1]}:{frame.lineno} {frame.name}"
    return "outside swafactory"


def main(out: str, overrides: list[str]) -> None:
    import torch

    import swafactory
    from swafactory.harness.run import run

    cfg = swafactory.compose(overrides or DEFAULT)
    sites: Counter[str] = Counter()

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ARG001
        if "synchronizing" in str(message):
            sites[site()] += 1

    warnings.simplefilter("always")
    warnings.showwarning = show
    torch.cuda.set_sync_debug_mode("warn")
    t0 = time.perf_counter()
    report = run(cfg)
    wall = time.perf_counter() - t0
    torch.cuda.set_sync_debug_mode("default")
    total = sum(sites.values())
    steps = max(1, report.steps)
    result = {"overrides": overrides or DEFAULT, "status": report.status, "steps": report.steps,
              "wall_s": wall, "syncs": total, "syncs_per_step": total / steps,
              "sites": dict(sites.most_common())}
    Path(out).write_text(json.dumps(result, indent=1))
    print(f"{' '.join(result['overrides'])}: {report.status}, {report.steps} steps, {wall:.1f} s, "
          f"{total} syncs ({total / steps:.1f} per step)")
    for name, n in sites.most_common(15):
        print(f"  {n / steps:8.1f}/step  {name}")


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):  # the usage; nothing run
        print(__doc__)
        sys.exit(0 if len(sys.argv) > 1 else 2)
    main(sys.argv[1], sys.argv[2:])
