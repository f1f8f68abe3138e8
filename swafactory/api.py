"""The embedding API: compose a config from overrides, check it, validate it, describe its plan."""
from __future__ import annotations

from collections.abc import Sequence

from swafactory.config.from_hydra import from_hydra
from swafactory.config.paths import conf_dir
from swafactory.config.schema import SwaFactoryConfig
from swafactory.config.typos import foreign_spec_field, unknown_key
from swafactory.errors import ConfigError, Reason
from swafactory.resolve.layout import PlanSummary, describe
from swafactory.registry import check as _check
from swafactory.registry.device import DeviceInfo, detect_device
from swafactory.registry.select import resolve_auto, validate as _validate

__all__ = ["compose", "check", "validate", "plan_summary", "device_for"]


def compose(overrides: Sequence[str] = (), config_name: str = "config") -> SwaFactoryConfig:
    """Compose the shipped configs with Hydra overrides (``["backend=torch", "spec.topk=2"]``).

    Raises :class:`ConfigError` for unknown options, bad override syntax and schema errors; a
    key that names no field (``spec.topkk=2``) is refused with the nearest one.
    """
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    headline = f"cannot compose {' '.join(overrides) or 'the defaults'}:"
    typos = {o: r for o in overrides
             if (r := unknown_key(o) or foreign_spec_field(o, overrides)) is not None}
    if typos:  # refused before Hydra, whose advice is to append with +; with the rest's reasons
        try:
            compose([o for o in overrides if o not in typos], config_name)
            rest: list[Reason] = []
        except ConfigError as exc:
            rest = list(exc.reasons)
        raise ConfigError([*typos.values(), *rest], headline=headline)
    if GlobalHydra.instance().is_initialized():
        raise ConfigError([Reason("config", "compose", "Hydra is already initialized in this "
                              "process (inside a @hydra.main app); pass the app's DictConfig to "
                              "swafactory.config.from_hydra instead")])
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            cfg = hydra_compose(config_name=config_name, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        msg = " ".join(str(exc).split())
        raise ConfigError([Reason("config", "overrides", msg)], headline=headline) from None
    return from_hydra(cfg)


def device_for(cfg: SwaFactoryConfig, device: DeviceInfo | None = None) -> DeviceInfo:
    """The given device, or this machine probed as the workload's `device` field asks."""
    return device if device is not None else detect_device(cfg.workload.device)


def check(cfg: SwaFactoryConfig, device: DeviceInfo | None = None) -> list[Reason]:
    """Every reason ``cfg`` cannot run on ``device`` (default: this machine); empty = it can.

    `backend=auto` is resolved first; if no backend fits, the reasons of every candidate are given.
    """
    dev = device_for(cfg, device)
    try:
        cfg = resolve_auto(cfg, dev)
    except ConfigError as exc:
        return list(exc.reasons)
    return _check(cfg, dev)


def validate(cfg: SwaFactoryConfig, device: DeviceInfo | None = None) -> SwaFactoryConfig:
    """The runnable config (`auto` resolved), or a :class:`ConfigError` with every reason."""
    return _validate(cfg, device_for(cfg, device))


def plan_summary(cfg: SwaFactoryConfig, device: DeviceInfo | None = None) -> PlanSummary:
    """Validate ``cfg`` and describe the plan it would build."""
    dev = device_for(cfg, device)
    return describe(_validate(cfg, dev), dev)
