"""swafactory: validated attention backends for hybrid sliding-window models, from declarative config.

    >>> import swafactory
    >>> cfg = swafactory.compose(["backend=torch", "spec=eagle3", "model=gemma4"])
    >>> swafactory.check(cfg)          # [] when it can run here, else every Reason
    []
"""
from swafactory.api import check, compose, plan_summary, validate
from swafactory.config.schema import SwaFactoryConfig
from swafactory.errors import ConfigError, Reason, SpaceError, SwaFactoryError
from swafactory.registry.device import DeviceInfo, detect_device

__all__ = ["compose", "check", "validate", "plan_summary", "SwaFactoryConfig", "ConfigError",
           "Reason", "SpaceError", "SwaFactoryError", "DeviceInfo", "detect_device"]
__version__ = "0.1.0"
