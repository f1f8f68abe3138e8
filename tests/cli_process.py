"""`python -m swafactory …` in its own process, started by fork from one that has already imported
torch and the config stack (a zygote, one per test process).

A fresh interpreter spends about 2 s importing torch, Hydra and pydantic before the CLI reads
its first override; the suite starts the CLI some 70 times. A forked child is still its own
process: its own working directory, environment, argv, stdout/stderr, exit code and session
(a timeout kills it and whatever it started), and it imports swafactory itself, so nothing of
the test process reaches it. What it shares with its siblings is the third-party modules
imported before the fork. `tests/test_wheel.py` still starts the installed CLI from scratch.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["run_cli"]

_ZYGOTE = r'''
import json, os, sys
import torch, hydra, omegaconf, pydantic, rich.console  # what every CLI run imports first
proto_in, proto_out = sys.stdin.buffer, os.fdopen(os.dup(1), "w")


def child(req):
    code = 1
    try:
        os.setsid()  # its own group: a timeout kills the CLI and anything it started
        proto_out.close()
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                                (1, req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                (2, req["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            if path is None:  # stderr into stdout's file, interleaved as written
                os.dup2(1, fd)
                continue
            f = os.open(path, flags, 0o644)
            os.dup2(f, fd)
            os.close(f)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", closefd=False, encoding="utf-8")
        sys.stderr = open(2, "w", buffering=1, closefd=False, encoding="utf-8",
                          errors="backslashreplace")
        sys.path[0] = os.getcwd()  # where `python -m` puts it
        if os.environ.get("OMP_NUM_THREADS", "").isdigit():  # what torch reads when it starts
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        sys.argv = ["swafactory", *req["args"]]
        import runpy
        try:
            runpy.run_module("swafactory", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        try:
            import atexit
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


for line in proto_in:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        child(req)
    proto_out.write(json.dumps({"pid": pid}) + "\n")
    proto_out.flush()
    _, status = os.waitpid(pid, 0)
    proto_out.write(json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n")
    proto_out.flush()
'''

_zygote: subprocess.Popen | None = None


def _started() -> subprocess.Popen:
    global _zygote
    if _zygote is None or _zygote.poll() is not None:
        _zygote = subprocess.Popen([sys.executable, "-c", _ZYGOTE], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    return _zygote


def _line(z: subprocess.Popen, timeout: float | None) -> dict | None:
    if timeout is not None and not select.select([z.stdout], [], [], max(timeout, 0))[0]:
        return None
    line = z.stdout.readline()
    if not line:
        raise RuntimeError("the CLI zygote died; run `python -m swafactory` by hand to see why")
    return json.loads(line)


def run_cli(args: list[str], *, cwd: str | os.PathLike, env: dict | None = None,
            timeout: float | None = None, merge_stderr: bool = False
            ) -> subprocess.CompletedProcess:
    """``python -m swafactory *args`` as `subprocess.run(..., capture_output=True, text=True)`
    would run it (env: the whole environment, default os.environ; merge_stderr: as
    ``stderr=subprocess.STDOUT``, stderr then None); raises `subprocess.TimeoutExpired` after
    ``timeout`` seconds, with the CLI's group killed."""
    z = _started()
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp, "out"), Path(tmp, "err")
        req = {"args": [str(a) for a in args], "cwd": str(cwd),
               "env": dict(os.environ if env is None else env),
               "out": str(out), "err": None if merge_stderr else str(err)}
        z.stdin.write(json.dumps(req) + "\n")
        z.stdin.flush()
        pid = _line(z, None)["pid"]
        done = _line(z, timeout)
        if done is None:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _line(z, None)
            raise subprocess.TimeoutExpired([sys.executable, "-m", "swafactory", *args], timeout,
                                            out.read_text(errors="replace"),
                                            None if merge_stderr else err.read_text(errors="replace"))
        return subprocess.CompletedProcess(
            [sys.executable, "-m", "swafactory", *args], done["code"],
            out.read_text(errors="replace"),
            None if merge_stderr else err.read_text(errors="replace"))
