"""bench/tp_scaling.py renders the tensor-parallel scaling record from real Report/JobResult JSON;
bench/gpu.sh's tp suite plans the sweep so no GPU runs two harness processes at once (DRY plans,
and a run with a fake python3 that only sleeps)."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from swafactory.harness.callback import JobResult
from swafactory.harness.report_model import Mismatch, Report

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench/gpu.sh"  # its tp suite


def _tp_scaling():
    spec = importlib.util.spec_from_file_location("tp_scaling", ROOT / "bench/tp_scaling.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["tp_scaling"] = mod  # its dataclass looks its module up
    spec.loader.exec_module(mod)
    return mod


def _report(tp: int, attn: float, plan: float, *, ranks=(), gather=0.0, checks=100, passed=100,
            mismatch: Mismatch | None = None, **extra) -> Report:
    return Report(
        status="failed" if mismatch else "ok", combination="x", device="cuda SM90 (NVIDIA H200)",
        backend="triton", parts={}, layers_attended=[0, 1], draft_layers=0, requests=24, steps=40,
        mode_stats=[], checks=checks, passed=passed, max_rel_err=1e-3, tolerance=2e-2,
        peak_swa_use=0.99, peak_full_use=0.5, evictions=7, hybrid_bytes=1, full_only_bytes=2,
        draft_pool_bytes=0, attention_ms_per_step=attn, planning_ms_per_step=plan,
        tokens_per_s=10.0, wall_s=33.0, tp=tp, rank_attention_ms=list(ranks),
        gather_ms_per_step=gather, mismatch=mismatch, **extra)


def _job(sweep: Path, num: int, b: str, s: str, m: str, tp: int, status: str | None, *,
         report: Report | None = None, reasons=(), error=None, workload="serve") -> None:
    """A Hydra job folder as a sweep leaves it; status None: started, no result.json."""
    d = sweep / str(num)
    (d / ".hydra").mkdir(parents=True)
    ov = [f"backend={b}", f"spec={s}", f"model={m}", f"workload={workload}", f"parallel.tp={tp}"]
    (d / ".hydra/overrides.yaml").write_text("".join(f"- {o}\n" for o in ov))
    if status is None:
        return
    res = JobResult(combination=f"backend={b} spec={s} model={m}", overrides=ov, backend=b, spec=s,
                    model=m, workload=workload, status=status, reasons=list(reasons),
                    report=report, error=error)
    (d / "result.json").write_text(res.model_dump_json(indent=1))
    if report is not None:
        (d / "report.json").write_text(report.model_dump_json())


def _sweeps(tmp: Path) -> list[Path]:
    """Two calls' folders (the second has an attempt stopped at its deadline of a job the first
    finished: the finished one counts)."""
    a, b = tmp / "call1", tmp / "call2"
    run = a / "20261130T100000Z_tp1"
    (run).mkdir(parents=True)
    (run / "host.txt").write_text("date: 2026-11-30T10:00:00Z\ncommit: abc1234\ngpus: NVIDIA H200"
                                  ", 143771 MiB;NVIDIA H200, 143771 MiB\ncpus: 32\ntorch: 2.11\n")
    (run / "commands.txt").write_text("CUDA_VISIBLE_DEVICES=0 python3 -m swafactory -m x\n")
    (run / "timeline.txt").write_text("+0 s start phase tp1\n+1 s start warm gpus=0\n"
                                      "+2 s start tp1_lane0_triton_gemma4 gpus=0 specs=none\n"
                                      "+2 s start tp1_lane1_triton_gemma4 gpus=1 specs=eagle3\n"
                                      "+9 s end warm gpus=0 exit 0\n"
                                      "+20 s end tp1_lane0_triton_gemma4 gpus=0 exit 124\n"
                                      "+20 s start tp1_lane0_flashinfer_gemma4 gpus=0 specs=none\n")
    _job(run / "tp1_lane0_triton_gemma4", 0, "triton", "none", "gemma4", 1, "ok",
         report=_report(1, attn=10.0, plan=2.0))
    _job(run / "tp1_lane1_triton_gemma4", 0, "triton", "eagle3", "gemma4", 1, "refused",
         reasons=["- `spec.name`: not on this backend"])
    _job(run / "tp1_lane1_flashinfer_gemma4", 0, "flashinfer", "none", "gemma4", 1, "ok",
         report=_report(1, attn=8.0, plan=1.0))
    _job(run / "tp1_lane0_triton_gemma4", 1, "triton", "dflash", "gemma4", 1, None)  # stopped
    _job(run / "smoke", 0, "triton", "none", "gemma4", 2, "ok", workload="smoke",
         report=_report(2, attn=99.0, plan=99.0, ranks=(99.0, 99.0)))
    run2 = b / "20261130T101000Z_tp2"
    _job(run2 / "tp1_lane0_flashinfer_gemma4", 0, "flashinfer", "none", "gemma4", 1, None)
    (run2 / "timeline.txt").write_text("+1 s start tp1_lane0_flashinfer_gemma4 gpus=0 specs=none\n"
                                       "+9 s end tp1_lane0_flashinfer_gemma4 gpus=0 exit 1\n")
    (run2 / "tp1_lane0_flashinfer_gemma4.log").write_text(
        "Traceback (most recent call last):\ntorch.OutOfMemoryError: CUDA out of memory.\n")
    _job(run2 / "tp2_triton_gemma4", 0, "triton", "none", "gemma4", 2, "ok",
         report=_report(2, attn=5.5, plan=2.5, ranks=(5.5, 6.0), gather=1.5,
                        first_use_s=2.5, steady_steps=31))
    _job(run2 / "tp2_triton_gemma4", 1, "triton", "eagle3", "gemma4", 2, "failed",
         report=_report(2, attn=4.0, plan=1.0, ranks=(4.0, 4.0), checks=50, passed=49,
                        mismatch=Mismatch(step=3, worker="target", mode="decode", layer=5,
                                          group="swa", request="7", error="max relative error "
                                          "0.5 > tolerance 0.02", check="oracle")))
    _job(run2 / "tp2_flashinfer_gemma4", 0, "flashinfer", "none", "gemma4", 2, "failed",
         error="Traceback ...\nRuntimeError: NCCL error: unhandled system error")
    return [a, b]


def _line(md: str, b: str, s: str, tp: int) -> list[str]:
    rows = [x for x in md.splitlines() if x.startswith(f"| {b} | {s} | gemma4 | {tp} |")]
    assert len(rows) == 1, rows
    return [c.strip() for c in rows[0].strip("|").split(" | ")]


def test_rows_ratios_and_rows_that_did_not_run(tmp_path: Path, capsys) -> None:
    mod = _tp_scaling()
    out = tmp_path / "res/tp-scaling"
    argv = [str(d) for d in _sweeps(tmp_path)] + [
        "--out", str(out), "--models", "gemma4", "--specs", "none,eagle3,dflash"]
    assert mod.main(argv) == 0
    md = out.with_suffix(".md").read_text()
    rows = {(r["backend"], r["spec"], r["tp"]): r
            for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert len(rows) == 2 * 3 * 2  # every row of the narrowed grid, and only those
    cols = ["backend", "spec", "model", "tp", "status", "mismatches", "checks", "ranks", "gather",
            "planning", "step", "vs1", "attn_vs1", "steps", "first", "wall", "commit"]
    row = lambda b, s, tp: dict(zip(cols, _line(md, b, s, tp)))  # noqa: E731

    one, two = row("triton", "none", 1), row("triton", "none", 2)
    assert one["status"] == two["status"] == "**ok**" and one["mismatches"] == "0"
    step1, step2 = 10.0 + 0 + 2.0, max(5.5, 6.0) + 1.5 + 2.5  # slowest rank + gather + planning
    assert (one["step"], one["vs1"]) == (f"{step1:.2f}", "1.00×")
    assert (two["ranks"], two["gather"], two["planning"]) == ("5.50 / 6.00", "1.50", "2.50")
    assert (two["step"], two["vs1"]) == (f"{step2:.2f}", f"{step2 / step1:.2f}×")
    assert two["attn_vs1"] == f"{6.0 / 10.0:.2f}×" and two["wall"] == "33"
    assert (one["commit"], two["commit"]) == ("abc1234", "unknown")  # host.txt, or none
    assert (two["first"], two["steps"], one["steps"]) == ("2.5", "40 (31)", "40 (0)")
    assert rows[("triton", "none", 2)]["step_vs_tp1"] == pytest.approx(step2 / step1)

    # the finished attempt wins over a later one stopped at the deadline
    fi = rows[("flashinfer", "none", 1)]
    assert (fi["status"], fi["attempts"], fi["step_ms"]) == ("ok", 2, 9.0)
    assert row("triton", "eagle3", 1)["status"] == "**refused**: `spec.name`: not on this backend"
    bad = row("triton", "eagle3", 2)
    assert bad["status"].startswith("**failed**: oracle check: step 3, target/decode, layer 5")
    assert (bad["mismatches"], bad["checks"], bad["step"], bad["vs1"]) == ("1", "50", "-", "-")
    assert row("flashinfer", "none", 2)["status"] == ("**failed**: RuntimeError: NCCL error: "
                                                       "unhandled system error")
    assert row("triton", "dflash", 1)["status"] == ("**did not finish**: stopped at the call's "
                                                    "deadline (job 1 of tp1_lane0_triton_gemma4)")
    jobs = mod.find_jobs([tmp_path / "call2"])  # the later attempt, stopped by a crash
    (crashed,) = jobs[("flashinfer", "none", "gemma4", 1)]
    assert mod._reason(crashed) == ("crashed: the sweep exited 1 (job 0 of "
                                    "tp1_lane0_flashinfer_gemma4); last error in "
                                    "tp1_lane0_flashinfer_gemma4.log: torch.OutOfMemoryError: "
                                    "CUDA out of memory.")
    for b, tp in (("flashinfer", 1), ("flashinfer", 2), ("triton", 2)):  # no job anywhere
        assert row(b, "dflash", tp)["status"] == ("**did not run**: no job for it in the "
                                                  "folders read")
    assert rows[("triton", "none", 2)]["attention_ms"] == 6.0  # the smoke job was not read

    assert "`abc1234`" in md and "2026-11-30T10:00:00Z" in md and "NVIDIA H200" in md
    assert "workload=serve parallel.tp=1,2" in md and "python3 -m swafactory -m x" in md
    assert "no two sweeps overlapped on a GPU" in md
    assert ("3 of 12 rows ok, 1 refused, 2 failed, 1 did not finish, 5 did not run; "
            "1 mismatches") in md
    assert "triton      none" in capsys.readouterr().out


def test_overlapping_sweeps_on_one_gpu_are_reported(tmp_path: Path) -> None:
    mod = _tp_scaling()
    t = tmp_path / "timeline.txt"
    t.write_text("+0 s start a gpus=0 specs=x\n+3 s start b gpus=1 specs=x\n"
                 "+5 s start warm gpus=0\n+6 s start c gpus=0,1 specs=x\n"
                 "+8 s end a gpus=0 exit 0\n")
    assert mod.timeline_overlaps(t) == ["a and c on GPU 0", "b and c on GPU 1"]
    t.write_text("+0 s start a gpus=0\n+4 s end a gpus=0 exit 0\n+4 s start c gpus=0,1\n")
    assert mod.timeline_overlaps(t) == []


def _run(env: dict, out: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), out, "tp"], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "NGPU": "2", **env}, timeout=timeout)


def _plan(stdout: str) -> list[dict]:
    out = []
    for line in stdout.splitlines():
        if line.startswith("plan "):
            kv = dict(x.split("=", 1) for x in line.split()[1:])
            out += [{**kv, "spec": s} for s in kv["spec"].split(",")]
    return out


def test_script_syntax_and_dry_plan(tmp_path: Path) -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    text = SCRIPT.read_text()
    assert ("export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1"
            in text)
    p = _run({"DRY": "1", "WORK": str(tmp_path / "w")}, str(tmp_path / "out"))
    assert p.returncode == 0, p.stderr
    plan = _plan(p.stdout)
    mod = _tp_scaling()
    want = {(b, s, m, str(t)) for b, s, m, t in mod.grid_of(mod.BACKENDS, mod.SPECS, mod.MODELS,
                                                            mod.TPS)}
    got = [(j["backend"], j["spec"], j["model"], j["tp"]) for j in plan]
    assert sorted(got) == sorted(want) and len(got) == 32  # each combination once
    lanes = {(j["lane"], j["gpus"]) for j in plan if j["tp"] == "1"}
    assert lanes == {("0", "0"), ("1", "1")}  # each tp=1 lane pinned to its own GPU
    for lane in "01":
        mine = [j for j in plan if j["lane"] == lane]
        assert len(mine) == 8 and {j["model"] for j in mine} == set(mod.MODELS)
        backends = [j["backend"] for j in mine]  # flashinfer after the warm: last in the lane
        assert backends == sorted(backends, key=lambda b: b == "flashinfer")
    assert {j["gpus"] for j in plan if j["tp"] == "2"} == {"0,1"}
    assert "flashinfer_warm.py 64 256 512" in p.stdout
    assert p.stdout.count("workload=serve parallel.tp=") == 12  # one multirun per plan line

    p = _run({"DRY": "1", "PHASE": "tp2", "SPECS": "dflash", "BACKENDS": "triton",
              "WORK": str(tmp_path / "w")}, str(tmp_path / "out"))
    got = [(j["tp"], j["spec"], j["backend"]) for j in _plan(p.stdout)]
    assert got == [("2", "dflash", "triton")] * 2  # one per model
    assert "flashinfer_warm" not in p.stdout
    p = _run({"DRY": "1", "PHASE": "tp3"}, str(tmp_path / "o"))
    assert p.returncode == 2 and "PHASE=tp3" in p.stderr
    p = _run({"DRY": "1", "BACKENDS": "flashinfer,trition"}, str(tmp_path / "o"))
    assert p.returncode == 2 and "backend 'trition'" in p.stderr and "triton" in p.stderr


FAKE_PYTHON = r"""#!/usr/bin/env bash
# python3 for the script's test: a multirun writes one refused job per spec (a JobResult) and
# sleeps; the warm-up sleeps; the script's own stdin snippets run on the real interpreter.
case " $* " in
*" -m swafactory "*)
    for a; do case $a in hydra.sweep.dir=*) d=${a#*=} ;; spec=*) specs=${a#*=} ;;
        backend=*) b=${a#*=} ;; model=*) m=${a#*=} ;; parallel.tp=*) tp=${a#*=} ;; esac; done
    mkdir -p "$d"
    echo "$CUDA_VISIBLE_DEVICES $NCCL_NVLS_ENABLE$TORCH_SYMM_MEM_DISABLE_MULTICAST$NVSHMEM_DISABLE_NVLS" \
        > "$d/env.txt"
    i=0
    for s in ${specs//,/ }; do
        mkdir -p "$d/$i/.hydra"
        ov=("backend=$b" "spec=$s" "model=$m" workload=serve "parallel.tp=$tp")
        printf -- '- %s\n' "${ov[@]}" > "$d/$i/.hydra/overrides.yaml"
        sleep "$FAKE_JOB_S"
        printf '{"combination": "x", "backend": "%s", "spec": "%s", "model": "%s",
                 "workload": "serve", "status": "refused", "reasons": ["fake"],
                 "overrides": ["%s", "%s", "%s", "%s", "%s"]}' "$b" "$s" "$m" "${ov[@]}" \
            > "$d/$i/result.json"
        i=$((i + 1))
    done ;;
*flashinfer_warm.py*) sleep "$FAKE_WARM_S" ;;
" - ") cat > /dev/null; echo "python: fake" ;;
*) exec REAL "$@" ;;
esac
"""


def _fake_path(tmp: Path) -> str:
    bin_ = tmp / "bin"
    bin_.mkdir()
    (bin_ / "python3").write_text(FAKE_PYTHON.replace("REAL", sys.executable))
    (bin_ / "python3").chmod(0o755)
    return f"{bin_}:{os.environ['PATH']}"


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils timeout")
def test_script_runs_one_process_per_gpu_resumes_and_packs(tmp_path: Path) -> None:
    mod = _tp_scaling()
    env = {"PATH": _fake_path(tmp_path), "WORK": str(tmp_path / "work/c0ffee"), "COMMIT": "c0ffee",
           "FAKE_JOB_S": "0.1", "FAKE_WARM_S": "1.5", "WHEELS": "", "FA4": ""}
    out = tmp_path / "out"
    p = _run(env, str(out))
    assert p.returncode == 0, p.stderr
    with tarfile.open(out / "tp.tgz") as t:
        names = t.getnames()
        t.extractall(tmp_path / "back", filter="data")
    assert sum(n.endswith("result.json") for n in names) == 32
    for f in ("host.txt", "commit.txt", "commands.txt", "plan.txt", "nvidia-smi.txt"):
        assert any(n.endswith(f) for n in names), f
    (timeline,) = (tmp_path / "back").rglob("timeline.txt")
    assert mod.timeline_overlaps(timeline) == []
    events = timeline.read_text()
    warm_end = int(next(x for x in events.splitlines() if "end warm" in x).split()[0][1:])
    fi_start = [int(x.split()[0][1:]) for x in events.splitlines() if "start tp1_lane" in x
                and "flashinfer" in x]
    assert len(fi_start) == 4 and min(fi_start) >= warm_end  # flashinfer waited for the warm-up
    envs = {f.parent.name: f.read_text().split() for f in (tmp_path / "back").rglob("env.txt")}
    assert {v[1] for v in envs.values()} == {"011"}  # NVLink multicast off in every job
    assert {v[0] for k, v in envs.items() if k.startswith("tp2")} == {"0,1"}

    again = _run(env, str(out))  # a second call finds everything done: no sweep
    assert again.returncode == 0 and "0 sweeps; 32 combinations already" in again.stdout
    with tarfile.open(out / "tp.tgz") as t:  # its tarball holds the first call's jobs too
        t.extractall(tmp_path / "back2", filter="data")
    res = tmp_path / "res/tp"
    assert mod.main([str(tmp_path / "back"), str(tmp_path / "back2"), "--out", str(res)]) == 0
    rows = json.loads(res.with_suffix(".json").read_text())["rows"]
    assert len(rows) == 32 and {(r["status"], r["attempts"]) for r in rows} == {("refused", 1)}
    for f in (tmp_path / "back").rglob("result.json"):  # the fake wrote real JobResults
        JobResult.model_validate_json(f.read_text())

    env |= {"WORK": str(tmp_path / "work2"), "FAKE_JOB_S": "30", "DEADLINE": "4", "MIN_LEFT": "1"}
    p = _run(env, str(out), timeout=40)  # stopped at the deadline, still packed
    assert p.returncode == 0 and "(deadline)" in p.stdout and (out / "tp.tgz").exists()
