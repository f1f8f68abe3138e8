"""Kernels of our own in CUDA C++, for the tiles Triton's `tl` cannot lay out well (see each
.cu file's header). Chosen by `backend.kernels`, built with nvcc when the backend is built
(`prepare`) and cached; launched through the driver.

`KernelEnv` holds the environment overrides our kernels obey (the switches and tile knobs of
docs/gpu.md, and ``TRITON_INTERPRET``) as one snapshot. `build_backend` reads it once; each
adapter keeps it and runs its kernels under it (`CURRENT`), so a layer's call reads no
``os.environ``. A kernel function called outside an adapter (a test, a benchmark that changes a
knob between calls) reads the environment at that call (`kernel_env`).
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

__all__ = ["KernelEnv", "CURRENT", "kernel_env", "running_under", "parse_tile_knob", "CudaKernel",
           "cuda_kernels_available", "nvcc_path", "dense_verify_d512", "verify_d512_serves",
           "decode_d64", "decode_d64_serves"]


@dataclass(frozen=True)
class KernelEnv:
    """The kernels' environment overrides, read at one moment (`read`)."""

    interpret: bool = False
    """``TRITON_INTERPRET=1``: Triton kernels run in the CPU interpreter."""
    cuda_kernels: bool = True
    """``SWAFACTORY_CUDA_KERNELS`` is not 0: our CUDA kernels may serve."""
    cuda_decode: bool = True
    """``SWAFACTORY_CUDA_DECODE`` is not 0: our CUDA decode kernels may serve."""
    decode_tile: str | None = None
    """``SWAFACTORY_DECODE_TILE`` as set (parsed by `decode.tile`), or None."""
    fp8_tile: str | None = None
    """``SWAFACTORY_FP8_TILE`` as set (parsed by `decode_fp8.fp8_tile`), or None."""
    verify_tile: str | None = None
    """``SWAFACTORY_VERIFY_TILE`` as set (parsed by `verify.tile_config`), or None."""

    @classmethod
    def read(cls) -> KernelEnv:
        """The overrides as ``os.environ`` holds them now (unparsed: a malformed knob raises
        where its kernel is chosen, as it did when read there)."""
        env = os.environ
        return cls(interpret=env.get("TRITON_INTERPRET", "0") == "1",
                   cuda_kernels=env.get("SWAFACTORY_CUDA_KERNELS", "1") != "0",
                   cuda_decode=env.get("SWAFACTORY_CUDA_DECODE", "1") != "0",
                   decode_tile=env.get("SWAFACTORY_DECODE_TILE") or None,
                   fp8_tile=env.get("SWAFACTORY_FP8_TILE") or None,
                   verify_tile=env.get("SWAFACTORY_VERIFY_TILE") or None)

    def cuda_on(self, device) -> bool:
        """`launch.cuda_kernels_available` under this snapshot: the switch from here, then the
        device's compute capability and nvcc (cached per device), no environment read."""
        from swafactory.kernels.cuda import launch

        return self.cuda_kernels and device.type == "cuda" and launch._capable(device.index)


CURRENT: ContextVar[KernelEnv | None] = ContextVar("swafactory_kernel_env", default=None)
"""The snapshot of the adapter whose kernels run now (set around each `run`/`merge`); None
outside one."""


@contextmanager
def running_under(env: KernelEnv):
    """The block's kernels read ``env`` (an adapter's snapshot), not the environment."""
    token = CURRENT.set(env)
    try:
        yield
    finally:
        CURRENT.reset(token)


def kernel_env() -> KernelEnv:
    """The running adapter's snapshot; outside an adapter, the environment as it is now."""
    env = CURRENT.get()
    return env if env is not None else KernelEnv.read()


# the modules below import `kernel_env` from this package: it is defined before them
from swafactory.kernels.cuda.launch import (CudaKernel, cuda_kernels_available,  # noqa: E402
                                            nvcc_path, parse_tile_knob)
from swafactory.kernels.cuda.decode import decode_d64, decode_d64_serves  # noqa: E402
from swafactory.kernels.cuda.verify import dense_verify_d512, verify_d512_serves  # noqa: E402
