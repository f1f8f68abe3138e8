"""Resolve `backend=auto`, validate a combination, and raise one ConfigError with what would work."""
from __future__ import annotations

from omegaconf import OmegaConf

from swafactory.config.paths import conf_dir
from swafactory.config.schema import BackendSpec, SwaFactoryConfig
from swafactory.errors import ConfigError, Reason
from swafactory.registry.check import check
from swafactory.registry.device import DeviceInfo
from swafactory.registry.fault_needs import fault_needs_unmet
from swafactory.registry.suggest import AUTO_PREFERENCE, pick_auto, suggest, working_backends

__all__ = ["AUTO_PREFERENCE", "shipped_backend", "working_backends", "resolve_auto", "validate",
           "refuse_idle_faults"]


def shipped_backend(name: str) -> BackendSpec:
    """The backend exactly as `backend=<name>` composes it from `conf/backend/<name>.yaml`."""
    path = conf_dir() / "backend" / f"{name}.yaml"
    return BackendSpec.model_validate(OmegaConf.to_container(OmegaConf.load(path), resolve=True))


def resolve_auto(cfg: SwaFactoryConfig, device: DeviceInfo) -> SwaFactoryConfig:
    """Replace `backend=auto` with the first preferred backend that passes, keeping auto's fields."""
    if cfg.backend.name != "auto":
        return cfg
    refuse_idle_faults(cfg, device)  # else every candidate would be refused for it alike
    picked, tried = pick_auto(cfg, device)
    if picked is not None:
        return picked
    _refuse(cfg, device, tried, combination=cfg.combination,
            headline=f"backend=auto found no backend for spec={cfg.spec.name} "
                     f"model={cfg.model.name} on {device.describe()}:")


def validate(cfg: SwaFactoryConfig, device: DeviceInfo) -> SwaFactoryConfig:
    """Resolve auto and check; return the runnable config or raise ConfigError with every reason."""
    refuse_idle_faults(cfg, device)
    cfg = resolve_auto(cfg, device)
    reasons = check(cfg, device)
    if not reasons:
        return cfg
    _refuse(cfg, device, reasons, combination=f"{cfg.combination} on {device.describe()}")


def refuse_idle_faults(cfg: SwaFactoryConfig, device: DeviceInfo) -> None:
    """Raise ConfigError when a switched-on fault cannot act in ``cfg`` (`fault_needs`): the
    configuration's own fault, in every run mode, before any backend is chosen or blamed."""
    reasons = fault_needs_unmet(cfg)
    if not reasons:
        return
    hint = suggest(cfg, device, reasons, [])  # the needs' own fixes, checked like any suggestion
    raise ConfigError(reasons, suggestion=None if hint is None else str(hint),
                      headline=f"faults={cfg.faults.name} cannot act with {cfg.combination} (a run "
                               "would prove nothing):")


def _refuse(cfg: SwaFactoryConfig, device: DeviceInfo, reasons: list[Reason], **text: str):
    """Raise the refusal; its alternatives and suggestion have passed `check` on ``device``
    together with the overrides that gave ``cfg`` (registry.suggest)."""
    alts = working_backends(cfg, device)
    hint = suggest(cfg, device, reasons, alts)
    raise ConfigError(reasons, alternatives=alts, suggestion=None if hint is None else str(hint),
                      **text)
