"""Build and launch our own CUDA kernels: nvcc to a cached cubin, loaded and launched through
the driver API with ctypes, so nothing beyond torch and the CUDA driver is needed at run time.

Why not ``torch.utils.cpp_extension``: it links against the running torch's headers and ABI
and needs ninja; a cubin needs only nvcc once (the result is cached by source hash, flags and
architecture) and the driver. Launches go on torch's current stream, so a CUDA graph that
torch captures records them like any other kernel. Host cost: one ``cuLaunchKernel`` (a few µs).

nvcc runs in a session of its own: a timeout kills its whole process group (cicc and ptxas, not
just the driver) and removes the partial cubin, and a build that timed out or that nvcc refused
is remembered for the life of the process, so the next backend built (draft, twin) falls back
at once instead of waiting it out again.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch

__all__ = ["CudaKernel", "nvcc_path", "cuda_kernels_available", "KernelBuildError",
           "loads_or_warns", "load_kernels", "warn_once", "kernel_key", "set_build_timeout", "aligned16",
           "is_hopper", "sm_count", "tile_knob", "env_override", "DEFAULT_BUILD_TIMEOUT_S"]

_DYN_SMEM_ATTR = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
DEFAULT_BUILD_TIMEOUT_S = 300.0
_timeout_s = DEFAULT_BUILD_TIMEOUT_S  # `backend.kernels.build_timeout_s`, set by `prepare`
_GRACE_S = 5.0  # after SIGKILL, how long the killed group may take to close nvcc's pipes
_TAIL_LINES = 8  # of nvcc's stderr, in the one line that says a build failed
_failed: dict[tuple[str, str], str] = {}  # (source name, flags key) → why nvcc did not build it
_log = logging.getLogger(__name__)
_warned: set[str] = set()  # causes warned about: one warning each per process


class KernelBuildError(RuntimeError):
    """nvcc or the driver refused a kernel; the message carries their output."""


@functools.cache
def nvcc_path() -> str | None:
    """nvcc from $CUDA_HOME/bin, $CUDA_PATH/bin or PATH, or None."""
    for env in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(env)
        if root and (Path(root) / "bin" / "nvcc").exists():
            return str(Path(root) / "bin" / "nvcc")
    return shutil.which("nvcc")


def env_override(decode: bool = False) -> str | None:
    """The benchmark override that switches our CUDA kernels off (``SWAFACTORY_CUDA_KERNELS=0``,
    or for decode ``SWAFACTORY_CUDA_DECODE=0``), as ``NAME=0``, or None."""
    for name in ("SWAFACTORY_CUDA_KERNELS", *(("SWAFACTORY_CUDA_DECODE",) if decode else ())):
        if os.environ.get(name, "1") == "0":
            return f"{name}=0"
    return None


def set_build_timeout(seconds: float) -> None:
    """Seconds nvcc may run on one kernel before the build counts as failed."""
    global _timeout_s
    _timeout_s = float(seconds)


def cuda_kernels_available(device: torch.device) -> bool:
    """True on a CUDA device of compute capability ≥ 8.0 (cp.async, ldmatrix, bf16 mma) with
    nvcc present and ``SWAFACTORY_CUDA_KERNELS`` not set to 0."""
    if env_override() or device.type != "cuda":
        return False
    return _capable(device.index)


@functools.cache
def _capable(index: int | None) -> bool:
    if not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(index)[0] >= 8 and nvcc_path() is not None


def aligned16(t: torch.Tensor) -> bool:
    """Last dim contiguous, data and every other stride 16-byte aligned (cp.async, ldmatrix)."""
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(st * t.element_size() % 16 == 0 for st in t.stride()[:-1]))


@functools.cache
def is_hopper(index: int | None) -> bool:
    """Compute capability 9.x: thread-block clusters, the kernels' sm_90a build."""
    return torch.cuda.get_device_capability(index)[0] == 9


@functools.cache
def sm_count(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def tile_knob(name: str, bns: tuple[int, ...], max_stages: int) -> tuple[int, int, int] | None:
    """A benchmark's tile from environment variable ``name``: ``BNxSTAGES[xSPLITS]`` → (keys
    per tile, stages, splits or 0), or None where unset; ValueError names a malformed value."""
    return parse_tile_knob(name, os.environ.get(name), bns, max_stages)


def parse_tile_knob(name: str, value: str | None, bns: tuple[int, ...],
                    max_stages: int) -> tuple[int, int, int] | None:
    """`tile_knob`'s rule over a value already read (a `KernelEnv` field): ``value`` of knob
    ``name`` → (keys per tile, stages, splits or 0), or None where unset."""
    if not value:
        return None
    try:
        cfg = tuple(int(x) for x in value.lower().split("x"))
    except ValueError:
        cfg = ()
    if len(cfg) not in (2, 3) or cfg[0] not in bns or not 2 <= cfg[1] <= max_stages or \
            (len(cfg) == 3 and cfg[2] not in (1, 2, 4, 8)):
        raise ValueError(f"{name}={value!r}: expected BNxSTAGES[xSPLITS] with BN "
                         f"{' or '.join(map(str, bns))}, 2-{max_stages} stages and 1, 2, 4 or 8 "
                         f"splits, e.g. {bns[0]}x3 or {bns[0]}x3x4")
    return cfg[0], cfg[1], cfg[2] if len(cfg) == 3 else 0


def _arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}{minor}" + ("a" if major == 9 else "")


def _cache_dir() -> Path:
    root = os.environ.get("SWAFACTORY_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "swafactory")
    path = Path(root) / "cuda"
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise PermissionError(f"no write permission on {path}")
    except OSError as exc:
        raise KernelBuildError(f"the kernel cache {path} is not writable ({exc}); set "
                               "SWAFACTORY_CACHE to a writable directory") from exc
    return path


def _run_nvcc(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``cmd`` in a session of its own, its output captured. On a timeout (or an interrupt) the
    whole process group is killed and waited for before the exception goes on: ``subprocess.run``
    kills only the driver, and cicc or ptxas would keep compiling and writing the output."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            _kill_group(proc)
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to ``proc``'s process group, then wait until every member is dead."""
    if proc.returncode is None:  # the driver not reaped yet: its pid, the group's id, is ours
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    try:  # every member inherited nvcc's pipes: end of file on both means all have exited
        proc.communicate(timeout=_GRACE_S)
    except subprocess.TimeoutExpired:  # one left the group (setsid): it cannot be waited for
        proc.wait()


def _remember(source: Path, key: str, flags: Sequence[str], cause: str, why: str
              ) -> KernelBuildError:
    """Records that ``source`` did not build with the flags hashed to ``key``, and says so once,
    here; returns the error to raise now and on every later request for that build."""
    _failed[source.name, key] = cause
    _log.warning("swafactory: nvcc did not build %s (flags key %s: %s): %s; it is not built "
                 "again in this process", source.name, key, " ".join(flags), why)
    return KernelBuildError(cause)


def build_cubin(source: Path, arch: str, defines: dict[str, int]) -> bytes:
    """Compile ``source`` for ``sm_<arch>`` with ``-D`` defines; cached by content (the source
    and every ``.cuh`` header beside it, which it may include). A build that timed out or that
    nvcc refused raises the same `KernelBuildError` again without running nvcc."""
    flags = ["-cubin", "-O3", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}"]
    flags += [f"-D{k}={v}" for k, v in sorted(defines.items())]
    text = source.read_bytes() + b"".join(h.read_bytes()
                                          for h in sorted(source.parent.glob("*.cuh")))
    key = hashlib.sha256(text + " ".join(flags).encode()).hexdigest()[:20]
    out = _cache_dir() / f"{source.stem}-{key}.cubin"
    if out.exists():
        return out.read_bytes()
    if (source.name, key) in _failed:  # a hanging or refused build is not waited out twice
        raise KernelBuildError(_failed[source.name, key])
    nvcc = nvcc_path()
    if nvcc is None:
        raise KernelBuildError("nvcc was not found (set CUDA_HOME or put nvcc on PATH)")
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    try:
        try:
            res = _run_nvcc([nvcc, *flags, "-o", str(tmp), str(source)], timeout=_timeout_s)
        except subprocess.TimeoutExpired as exc:  # its process group is dead by now
            raise _remember(source, key, flags, f"nvcc timed out after {_timeout_s:g} s on "
                            f"{source.name} (raise backend.kernels.build_timeout_s)",
                            f"timed out after {_timeout_s:g} s") from exc
        except OSError as exc:  # not remembered: it costs no wait, and may be fixed meanwhile
            raise KernelBuildError(f"nvcc could not run ({exc})") from exc
        if res.returncode != 0:
            tail = "\n".join(res.stderr.strip().splitlines()[-_TAIL_LINES:])
            raise _remember(source, key, flags, f"nvcc failed on {source.name} "
                            f"({' '.join(flags)}):\n{res.stderr}",
                            f"nvcc exited with {res.returncode}:\n{tail}")
        try:
            tmp.replace(out)  # atomic: a concurrent builder sees a whole file or none
            return out.read_bytes()
        except OSError as exc:
            raise KernelBuildError(f"the kernel cache {out.parent} is not writable ({exc}); "
                                   "set SWAFACTORY_CACHE to a writable directory") from exc
    finally:
        with contextlib.suppress(OSError):  # the partial output of a killed or failed nvcc
            tmp.unlink(missing_ok=True)


@functools.cache
def _libcuda() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        msg = ctypes.c_char_p()
        _libcuda().cuGetErrorString(rc, ctypes.byref(msg))
        raise KernelBuildError(f"{what} failed: CUDA error {rc} "
                               f"({(msg.value or b'?').decode()})")


class CudaKernel:
    """One ``extern "C"`` kernel of a .cu file, built per device and defines.

    ``arg_types``: the kernel's parameters in order, each "ptr" (a tensor or None → 0), "i32",
    "i64" or "f32".
    """

    _CT = {"ptr": ctypes.c_void_p, "i32": ctypes.c_int, "i64": ctypes.c_longlong,
           "f32": ctypes.c_float}

    def __init__(self, source: Path, name: str, arg_types: Sequence[str],
                 defines: dict[str, int] | None = None, smem_bytes: int = 0) -> None:
        self.source, self.name = Path(source), name
        self.arg_types = tuple(arg_types)
        self.defines = dict(defines or {})
        self.smem_bytes = smem_bytes
        self._fn: dict[int, ctypes.c_void_p] = {}
        self.launches = 0
        """Launches so far (tests check that a route reaches the kernel)."""

    def load(self, device: torch.device) -> None:
        """Builds (or reads from the cache) and loads the kernel on ``device``, before any
        capture: loading a module is not a stream operation, so do it in the eager warm-up."""
        self._function(device)

    def _function(self, device: torch.device) -> ctypes.c_void_p:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        fn = self._fn.get(idx)
        if fn is not None:
            return fn
        cubin = build_cubin(self.source, _arch(device), self.defines)
        lib = _libcuda()
        with torch.cuda.device(idx):
            torch.cuda.current_stream()  # makes torch's (primary) context current
            ctx = ctypes.c_void_p()
            _check(lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
            if not ctx.value:
                dev = ctypes.c_int()
                _check(lib.cuDeviceGet(ctypes.byref(dev), idx), "cuDeviceGet")
                _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "retain context")
                _check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
            mod = ctypes.c_void_p()
            _check(lib.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(cubin)),
                   f"loading {self.source.name}")
            fn = ctypes.c_void_p()
            _check(lib.cuModuleGetFunction(ctypes.byref(fn), mod, self.name.encode()),
                   f"finding {self.name}")
            if self.smem_bytes > 48 * 1024:
                _check(lib.cuFuncSetAttribute(fn, _DYN_SMEM_ATTR, self.smem_bytes),
                       f"{self.name}: {self.smem_bytes} bytes of shared memory")
        self._fn[idx] = fn
        return fn

    def registers(self, device: torch.device) -> int:
        """Registers per thread of the built kernel (CU_FUNC_ATTRIBUTE_NUM_REGS)."""
        val = ctypes.c_int()
        _check(_libcuda().cuFuncGetAttribute(ctypes.byref(val), 4, self._function(device)),
               "cuFuncGetAttribute")
        return val.value

    def __call__(self, grid: tuple[int, int, int], block: int, *args: Any) -> None:
        if len(args) != len(self.arg_types):
            raise TypeError(f"{self.name} takes {len(self.arg_types)} arguments, got {len(args)}")
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        fn = self._function(device)
        vals = []
        for kind, a in zip(self.arg_types, args):
            if kind == "ptr":
                a = 0 if a is None else a.data_ptr()
            vals.append(self._CT[kind](a))
        params = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p)
                                                 for v in vals])
        stream = torch.cuda.current_stream(device).cuda_stream
        _check(_libcuda().cuLaunchKernel(fn, grid[0], grid[1], grid[2], block, 1, 1,
                                         self.smem_bytes, ctypes.c_void_p(stream), params, None),
               f"launching {self.name}")
        self.launches += 1


def kernel_key(kern: CudaKernel) -> tuple:
    """What identifies a built kernel: its source, name and defines."""
    return kern.source.name, kern.name, tuple(sorted(kern.defines.items()))


def warn_once(cause: str, message: str) -> None:
    """``message`` as a RuntimeWarning, unless ``cause`` was warned about in this process."""
    if cause not in _warned:
        _warned.add(cause)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def load_kernels(kernels: Sequence[CudaKernel], index: int | None) -> str | None:
    """Builds and loads ``kernels`` on GPU ``index`` (None: the current one); returns None, or
    the cause of the first failure: nvcc missing, refusing, timing out or not starting, an
    unwritable cache, the driver refusing the module. Nothing escapes: a caller falls back."""
    try:
        device = torch.device("cuda", index if index is not None
                              else torch.cuda.current_device())
        for kern in kernels:
            try:
                kern.load(device)
            except (KernelBuildError, OSError, subprocess.SubprocessError) as exc:
                return str(exc).strip() or type(exc).__name__
    except (RuntimeError, OSError) as exc:  # no CUDA device, or the driver library is missing
        return f"no CUDA device to load on ({exc})"
    return None


def loads_or_warns(kernels: Sequence[CudaKernel], index: int | None, fallback: str) -> bool:
    """Builds and loads ``kernels`` on GPU ``index`` (None: the current one) before any capture.
    Where that fails (`load_kernels`), warns once per cause with ``fallback`` (what serves
    instead) and returns False. Callers cache it."""
    cause = load_kernels(kernels, index)
    if cause is None:
        return True
    warn_once(cause, f"swafactory: {fallback} ({cause})")
    return False
