"""swafactory: validated attention backends for hybrid sliding-window models, from declarative config.

    >>> import swafactory
    >>> cfg = swafactory.compose(["backend=torch", "spec=eagle3", "model=gemma4"])
    >>> swafactory.check(cfg)          # [] when it can run here, else every Reason
    []
"""
from swafactory.api import check, compose, plan_summary, validate
from swafactory.config.schema import SwaFactoryConfig
from swafactory.errors import CapacityError, ConfigError, Reason, SpaceError, SwaFactoryError
from swafactory.registry.device import DeviceInfo, detect_device

__all__ = ["compose", "check", "validate", "plan_summary", "build_backend", "run", "SwaFactoryConfig",
           "ConfigError", "Reason", "SpaceError", "CapacityError", "SwaFactoryError", "DeviceInfo",
           "detect_device"]
__version__ = "0.1.0"


def __getattr__(name: str):  # these pull in torch: import them on first use only
    if name == "build_backend":
        from swafactory.backend import build_backend

        return build_backend
    if name == "run":
        from swafactory.harness.run import run

        return run
    raise AttributeError(f"module 'swafactory' has no attribute {name!r}")
