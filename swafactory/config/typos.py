"""Overrides whose key names no field: `spec.topkk=2`, `modle=tiny`, `+spec.topkk=2`.

Hydra answers the first two with "Key … is not in struct … To append use +spec.topkk=2", advice
that only moves the error to the schema ("unknown field"). The keys are checked here against the
schema's field paths before Hydra composes anything, and each unknown one gets the nearest valid
field. A spec field is known if any algorithm has it; one the chosen spec lacks
(`spec=none spec.draft_window=64`) is refused with the specs that have it (`foreign_spec_field`).
Group options (`spec=eagel3`) are `cli.jobs.did_you_mean`'s.
"""
from __future__ import annotations

import types
import typing
from collections.abc import Sequence
from difflib import get_close_matches
from functools import cache

from omegaconf import DictConfig, OmegaConf
from pydantic import BaseModel

from swafactory.config.paths import conf_dir
from swafactory.config.schema import SwaFactoryConfig
from swafactory.errors import Reason

__all__ = ["field_paths", "nearest_field", "spec_owners", "unknown_key", "unknown_keys",
           "foreign_spec_field"]


def _models(annotation) -> list[type[BaseModel]]:
    """The pydantic models an annotation may hold (through Annotated, unions and Optional)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) is typing.Annotated:
        return _models(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [m for a in typing.get_args(annotation) for m in _models(a)]
    return []


@cache
def field_paths() -> dict[str, bool]:
    """Every dotted field path of the schema → whether it holds a model (has fields below)."""
    out: dict[str, bool] = {}

    def walk(prefix: str, models: list[type[BaseModel]]) -> None:
        for model in models:
            for name, info in model.model_fields.items():
                path = f"{prefix}{name}"
                below = _models(info.annotation)
                out[path] = out.get(path, False) or bool(below)
                walk(f"{path}.", below)

    walk("", [SwaFactoryConfig])
    return out


def spec_owners(name: str) -> list[str]:
    """The spec algorithms that have a field ``name`` (``block_size``: dflash)."""
    variants = _models(SwaFactoryConfig.model_fields["spec"].annotation)
    return [m.model_fields["algorithm"].annotation.__args__[0] for m in variants
            if name in m.model_fields]


def nearest_field(key: str) -> str | None:
    """The valid field path closest to ``key`` (same depth, not ``key``), or None."""
    depth = key.count(".")
    names = [p for p in field_paths() if p.count(".") == depth and p != key]
    if depth == 0:  # a top-level key may be a group added with + (experiment)
        names += [d.name for d in conf_dir().iterdir() if d.is_dir()]
    close = get_close_matches(key, names, n=1, cutoff=0.6)
    return close[0] if close else None


def _known(key: str) -> bool:
    paths = field_paths()
    parts = key.split(".")
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if prefix not in paths:
            return False
        if not paths[prefix]:  # a leaf (a value, a list, a dict): what lies below is Hydra's
            return True
    return True


def unknown_key(arg: str) -> Reason | None:
    """A reason when override ``arg`` has a key that is no field of the schema nor a config
    group, naming the key, the value and the nearest field; else None. Flags (`-m`), deletions
    (`~key`), `hydra.*` and package-qualified keys (`group@pkg=…`) are left to Hydra."""
    key, eq, value = arg.partition("=")
    bare = key.lstrip("+")
    if not eq or arg.startswith(("-", "~")) or not bare or "@" in bare or "/" in bare:
        return None
    if bare.split(".")[0] == "hydra" or (conf_dir() / bare).is_dir() or _known(bare):
        return None
    guess = nearest_field(bare)
    what = "config group or field" if "." not in bare else "field"
    return Reason((guess or bare).split(".")[0], bare, f"unknown {what} (got {arg})"
                  + (f"; did you mean {guess}?" if guess else ""),
                  f"{guess}={value}" if guess else None, rule="overrides")


def _chosen_spec(overrides: Sequence[str]) -> str:
    """The spec option the overrides pick (the last ``spec=NAME``), else the shipped default."""
    picked = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("spec=")]
    if picked:
        return picked[-1]
    defaults = OmegaConf.load(conf_dir() / "config.yaml").defaults
    return next((str(d["spec"]) for d in defaults if isinstance(d, DictConfig) and "spec" in d),
                "")


def foreign_spec_field(arg: str, overrides: Sequence[str]) -> Reason | None:
    """A reason when ``arg`` sets a field (``spec.draft_window=64``) that some algorithm has but
    the chosen spec does not (``spec=none``): Hydra would say only "not in struct"."""
    key, eq, value = arg.partition("=")
    if not eq or not key.startswith("spec.") or key.count(".") != 1:
        return None
    name = _chosen_spec(overrides)
    path = conf_dir() / "spec" / f"{name}.yaml"
    if not path.is_file():
        return None  # an unknown option is did_you_mean's
    algo = str(OmegaConf.load(path).get("algorithm", name))
    owners = spec_owners(key[5:])
    if not owners or algo in owners:
        return None
    why = " (it runs no draft)" if algo == "none" else ""
    return Reason("spec", key, f"spec={name} has no {key[5:]}{why} (got {arg}); it is a field of "
                  + ", ".join(f"spec={o}" for o in owners),
                  f"spec={owners[0]} {arg}", rule="overrides")


def unknown_keys(overrides: Sequence[str]) -> list[Reason]:
    """`unknown_key`'s reason for each override that has one, and `foreign_spec_field`'s."""
    return [r for o in overrides
            if (r := unknown_key(o) or foreign_spec_field(o, overrides)) is not None]
