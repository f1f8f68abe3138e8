"""Whether a new user's first two commands fit a 2-core laptop: wall seconds and peak RSS.

Runs, each as its own process pinned to ``--cores`` CPUs (a laptop's share, whatever this host
has), the commands a newcomer types first: the bare ``python -m swafactory`` and the README's
first example. Each child's peak RSS comes from ``os.wait4`` (its own ``ru_maxrss``, as
``/usr/bin/time -v`` reports it), its wall time from the parent's clock. Hydra's output goes to a
temporary folder, so the runs leave nothing in ``outputs/``.

    python bench/first_hour.py [--out first-hour-cpu.json] [--cores 2] [--repo DIR]
        [--limit-s 60] [--limit-gb 2]

Prints a table (command, exit code, wall and CPU seconds, peak RSS, within the limits) and
writes the JSON. CPU seconds (user + system) say what the run costs where other jobs share the
cores and stretch its wall time; the host's load average before the runs is recorded too.
Exits 1 when a command fails or exceeds a limit. ``--repo`` runs another checkout's package (a
baseline: ``git archive <commit> | tar -x -C DIR``) with this Python.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["COMMANDS", "measure", "main"]

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {
    "default job": [],
    "README first example": ["backend=torch", "spec=eagle3", "model=gemma4"],
}
"""Name → overrides of ``python -m swafactory``."""


def measure(overrides: list[str], repo: Path, cores: int, run_dir: Path) -> dict:
    """One command's exit code, wall and CPU seconds, peak RSS (bytes) and summary line."""
    cpus = sorted(os.sched_getaffinity(0))[:cores]
    env = dict(os.environ, PYTHONPATH=str(repo))  # the package of ``repo``, not the installed one
    argv = [sys.executable, "-m", "swafactory", *overrides, f"hydra.run.dir={run_dir}"]
    t0 = time.perf_counter()
    with subprocess.Popen(argv, cwd=repo, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True,
                          preexec_fn=lambda: os.sched_setaffinity(0, cpus)) as p:
        out = p.stdout.read() if p.stdout else ""
        _, status, usage = os.wait4(p.pid, 0)  # this child's own rusage, not every child's
        p.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    lines = [ln for ln in out.splitlines() if ln.strip()]
    return {"command": " ".join(["python -m swafactory", *overrides]), "rc": p.returncode,
            "wall_s": round(wall, 1), "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
            "peak_rss_bytes": usage.ru_maxrss * 1024,
            "cores": len(cpus), "pool_line": next((ln for ln in lines if "pools will take" in ln),
                                                  None),
            "summary": next((ln for ln in lines if ln.startswith("swafactory run:")), None),
            "tail": lines[-3:] if p.returncode else []}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("first-hour-cpu.json"), help="JSON written")
    ap.add_argument("--cores", type=int, default=2, help="CPUs each command is pinned to")
    ap.add_argument("--repo", type=Path, default=ROOT, help="checkout whose package runs")
    ap.add_argument("--limit-s", type=float, default=60.0, help="wall seconds allowed")
    ap.add_argument("--limit-gb", type=float, default=2.0, help="peak RSS allowed, GB (1e9 B)")
    a = ap.parse_args(argv)
    rows, load = [], os.getloadavg()  # other jobs on the host share the cores: say how many
    with tempfile.TemporaryDirectory(prefix="first_hour_") as tmp:
        for i, (name, overrides) in enumerate(COMMANDS.items()):
            row = {"name": name, **measure(overrides, a.repo.resolve(), a.cores,
                                           Path(tmp) / str(i))}
            row["within"] = (row["rc"] == 0 and row["wall_s"] <= a.limit_s
                             and row["peak_rss_bytes"] <= a.limit_gb * 1e9)
            rows.append(row)
    w = max(len(r["command"]) for r in rows)
    print(f"{'command':<{w}}  rc  wall s  CPU s  peak RSS  within {a.limit_s:g} s, "
          f"{a.limit_gb:g} GB")
    for r in rows:
        print(f"{r['command']:<{w}}  {r['rc']:>2}  {r['wall_s']:>6.1f}  {r['cpu_s']:>5.1f}  "
              f"{r['peak_rss_bytes'] / 1e9:>5.2f} GB  {'yes' if r['within'] else 'NO'}")
        for ln in r["tail"]:
            print(f"    {ln}")
    record = {"host": platform.node(), "cpus_on_host": os.cpu_count(),
              "load_avg_before": load, "python": sys.version.split()[0],
              "repo": str(a.repo.resolve()), "limit_s": a.limit_s, "limit_gb": a.limit_gb,
              "rows": rows}
    a.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0 if all(r["within"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
