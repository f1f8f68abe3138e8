"""The one conversion from a composed DictConfig to the schema, with errors by override path."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import ValidationError

from swafactory.config.schema import SPEC_ALGORITHMS, SwaFactoryConfig
from swafactory.config.typos import nearest_field, spec_owners
from swafactory.errors import ConfigError, FieldError, Reason

__all__ = ["from_hydra", "reasons_from_validation"]


def from_hydra(cfg: DictConfig | Mapping[str, Any]) -> SwaFactoryConfig:
    """Validate a composed config. Raises :class:`ConfigError` listing every schema error."""
    try:
        data = (OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
                if isinstance(cfg, DictConfig) else dict(cfg))
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "config"
        raise ConfigError([Reason(key.split(".")[0], key, str(exc).splitlines()[0])]) from None
    assert isinstance(data, dict)
    data.pop("hydra", None)
    try:
        return SwaFactoryConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(reasons_from_validation(exc)) from None


def _dotted(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc]
    if len(parts) > 1 and parts[0] == "spec" and parts[1] in SPEC_ALGORITHMS:
        del parts[1]  # the discriminated union's tag is not part of the override path
    return ".".join(parts) or "config"


def _message(err: Mapping[str, Any], field: str) -> str:
    kind, ctx, got = err["type"], err.get("ctx") or {}, err.get("input")
    if kind == "greater_than_equal":
        return f"must be ≥ {ctx['ge']}, got {got!r}"
    if kind == "greater_than":
        return f"must be > {ctx['gt']}, got {got!r}"
    if kind == "less_than_equal":
        return f"must be ≤ {ctx['le']}, got {got!r}"
    if kind == "extra_forbidden":  # appended with +, so nothing refused the key before
        loc, owners = err["loc"], spec_owners(field.split(".")[-1])
        if field.count(".") == 1 and field.startswith("spec.") and owners:  # another algorithm's
            return (f"spec={loc[1]} has no {loc[-1]} (got {got!r}); it is a field of "
                    f"{' and '.join(f'spec={o}' for o in owners)}")
        guess = nearest_field(field)
        return f"unknown field (got {got!r}); " + (f"did you mean {guess}={got}?" if guess else
                                                    "remove it or check its spelling")
    if kind == "missing":
        return "is required"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}, got {got!r}"
    if kind == "union_tag_invalid":
        return f"unknown algorithm {ctx.get('tag')!r}; must be one of {ctx.get('expected_tags')}"
    if kind == "value_error":
        return str(ctx.get("error", err["msg"]))
    return f"{err['msg'][0].lower()}{err['msg'][1:]}, got {got!r}"


def reasons_from_validation(exc: ValidationError) -> list[Reason]:
    """One Reason per pydantic error, located by the dotted override path."""
    out = []
    for err in exc.errors():
        cause = (err.get("ctx") or {}).get("error")
        loc = err["loc"] + ((cause.field,) if isinstance(cause, FieldError) else ())
        field = _dotted(loc)
        out.append(Reason(field.split(".")[0], field, _message(err, field)))
    return out
