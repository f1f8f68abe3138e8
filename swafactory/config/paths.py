"""Where the shipped Hydra configs live: inside the installed package, or at the checkout's root."""
from __future__ import annotations

from pathlib import Path

__all__ = ["conf_dir", "group_options", "GROUPS"]

GROUPS = ("model", "spec", "backend", "workload", "run", "faults")
_PKG = Path(__file__).resolve().parents[1]


def conf_dir() -> Path:
    """Absolute path of the config root (Hydra accepts absolute `config_path`s)."""
    for candidate in (_PKG / "conf", _PKG.parent / "conf"):  # wheel, then source checkout
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"swafactory's conf/ is missing next to {_PKG}; reinstall the package")


def group_options(group: str) -> list[str]:
    """The option names of one config group, sorted."""
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))
