"""Resolve `backend=auto`, list the backends that would work, and raise one ConfigError."""
from __future__ import annotations

from omegaconf import OmegaConf

from swafactory.config.paths import conf_dir
from swafactory.config.schema import BackendSpec, SwaFactoryConfig
from swafactory.errors import ConfigError, Reason
from swafactory.registry.check import check
from swafactory.registry.device import DeviceInfo
from swafactory.registry.table import list_backends

__all__ = ["AUTO_PREFERENCE", "shipped_backend", "working_backends", "resolve_auto", "validate"]

# Fastest first on a GPU; on CPU the torch reference (the interpreter is for tests only).
AUTO_PREFERENCE = {"cuda": ("flashinfer", "flash_attn", "triton", "flex", "torch"),
                   "cpu": ("torch",)}


def shipped_backend(name: str) -> BackendSpec:
    """The backend exactly as `backend=<name>` composes it from `conf/backend/<name>.yaml`."""
    path = conf_dir() / "backend" / f"{name}.yaml"
    return BackendSpec.model_validate(OmegaConf.to_container(OmegaConf.load(path), resolve=True))


def working_backends(cfg: SwaFactoryConfig, device: DeviceInfo) -> list[str]:
    """Registered backends whose shipped YAML passes `check` with the rest of ``cfg``."""
    out = []
    for name in list_backends():
        try:
            alt = cfg.model_copy(update={"backend": shipped_backend(name)})
        except FileNotFoundError:
            continue  # registered out of tree without a shipped YAML
        if not check(alt, device):
            out.append(name)
    return out


def resolve_auto(cfg: SwaFactoryConfig, device: DeviceInfo) -> SwaFactoryConfig:
    """Replace `backend=auto` with the first preferred backend that passes, keeping auto's fields."""
    if cfg.backend.name != "auto":
        return cfg
    tried: list[Reason] = []
    for name in AUTO_PREFERENCE.get(device.kind, ()):
        cand = cfg.model_copy(update={"backend": cfg.backend.model_copy(update={"name": name})})
        reasons = check(cand, device)
        if not reasons:
            return cand
        tried.extend(Reason(r.part, r.field, f"[{name}] {r.message}", r.fix) for r in reasons)
    alts = working_backends(cfg.model_copy(update={"backend": shipped_backend("torch")}), device)
    raise ConfigError(tried, combination=cfg.combination, alternatives=alts,
        suggestion=_suggest(cfg, tried, alts), headline=f"backend=auto found no backend for spec={cfg.spec.name} model={cfg.model.name} "
                 f"on {device.describe()}:")


def validate(cfg: SwaFactoryConfig, device: DeviceInfo) -> SwaFactoryConfig:
    """Resolve auto and check; return the runnable config or raise ConfigError with every reason."""
    cfg = resolve_auto(cfg, device)
    reasons = check(cfg, device)
    if not reasons:
        return cfg
    alts = working_backends(cfg, device)
    return _raise(cfg, device, reasons, alts)


def _suggest(cfg: SwaFactoryConfig, reasons: list[Reason], alts: list[str]) -> str | None:
    fixes = " ".join(dict.fromkeys(r.fix for r in reasons if r.fix))
    if fixes and (cfg.backend.name in alts or not alts):
        return fixes  # the backend itself can serve this; only fields need changing
    if alts:
        return f"backend={alts[0]} spec={cfg.spec.name} model={cfg.model.name}"
    return None


def _raise(cfg: SwaFactoryConfig, device: DeviceInfo, reasons: list[Reason], alts: list[str]):
    raise ConfigError(reasons, combination=f"{cfg.combination} on {device.describe()}",
                      alternatives=alts, suggestion=_suggest(cfg, reasons, alts))
