"""The capability registry: backend table, capabilities, combination checks and selection."""
from swafactory.registry.capabilities import Capabilities
from swafactory.registry.check import check
from swafactory.registry.device import CPU, H200, DeviceInfo, detect_device
from swafactory.registry.select import resolve_auto, validate, working_backends
from swafactory.registry.table import get_capabilities, list_backends, register_backend

__all__ = ["Capabilities", "check", "DeviceInfo", "detect_device", "CPU", "H200", "get_capabilities",
           "list_backends", "register_backend", "resolve_auto", "validate", "working_backends"]
