"""The device a combination is checked against: kind, SM version and installed kernel packages."""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

__all__ = ["DeviceInfo", "detect_device", "CPU", "H200", "B200"]


@dataclass(frozen=True)
class DeviceInfo:
    """What `registry.check` needs to know about the machine."""

    kind: str
    """`cpu` or `cuda`."""
    sm: int | None = None
    """SM version, e.g. 90 for H100/H200; None on CPU."""
    name: str = ""
    """Human-readable device name."""
    packages: frozenset[str] = frozenset()
    """Importable kernel modules (e.g. `flashinfer`, `flash_attn.cute`, `triton`)."""
    triton_interpret: bool = False
    """TRITON_INTERPRET=1 is set (Triton kernels run on CPU tensors)."""

    def describe(self) -> str:
        """`cpu`, or `cuda SM90 (NVIDIA H200)`."""
        if self.kind != "cuda":
            return self.kind
        return f"cuda SM{self.sm}" + (f" ({self.name})" if self.name else "")


_PROBED = ("triton", "flashinfer", "flash_attn.cute")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is missing or broken
        return False


def detect_device(kind: str = "auto") -> DeviceInfo:
    """Probe this machine. ``kind`` is the workload's `device` field (`auto`, `cpu`, `cuda`)."""
    import torch

    packages = frozenset(m for m in _PROBED if _importable(m))
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if kind == "cpu" or not torch.cuda.is_available():
        return DeviceInfo("cpu", packages=packages, triton_interpret=interpret)
    major, minor = torch.cuda.get_device_capability()
    return DeviceInfo("cuda", sm=10 * major + minor, name=torch.cuda.get_device_name(),
                      packages=packages, triton_interpret=interpret)


# Fixed devices for tests, the support matrix and the pinned verdict snapshot.
CPU = DeviceInfo("cpu")
H200 = DeviceInfo("cuda", sm=90, name="NVIDIA H200",
                  packages=frozenset({"triton", "flashinfer", "flash_attn.cute"}))
B200 = DeviceInfo("cuda", sm=100, name="NVIDIA B200",
                  packages=frozenset({"triton", "flashinfer", "flash_attn.cute"}))
