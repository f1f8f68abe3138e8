"""What a refusal suggests ("Backends that would work", "Try:"), each suggestion checked first.

A suggestion is overrides the user types after their own. Hydra applies group choices before
field overrides, so `backend=X` keeps every `backend.*` field the user typed. A composed config
does not say which fields were typed: one that differs from its option's YAML surely was, one that
equals it may have been. So a group switch is checked in every *world* (each such field typed or
not), and where a world fails the switch is tried again with the fewest of those fields pinned.
Nothing is suggested unless every world composes and passes `check` on the same device. A field
that names the option (`backend.name`, `spec.algorithm`) is taken to come from the group choice.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cache
from typing import Any

from omegaconf import OmegaConf
from pydantic import TypeAdapter, ValidationError

from swafactory.config.paths import GROUPS, conf_dir
from swafactory.config.schema import BackendSpec, SpecConfig, SwaFactoryConfig
from swafactory.errors import Reason
from swafactory.registry.check import check
from swafactory.registry.device import DeviceInfo
from swafactory.registry.table import list_backends

__all__ = ["AUTO_PREFERENCE", "Suggestion", "pick_auto", "reasons_for", "working_backends",
           "suggest"]

# Fastest first on a GPU; on CPU the torch reference (the interpreter is for tests only).
AUTO_PREFERENCE = {"cuda": ("flashinfer", "flash_attn", "triton", "flex", "torch"),
                   "cpu": ("torch",)}

# Groups a suggestion may switch to another option (their YAML is loaded to replay the switch).
_SWITCHABLE = {"backend": TypeAdapter(BackendSpec), "spec": TypeAdapter(SpecConfig)}
_MISSING = object()
_IDENTITY = ("name", "algorithm")  # what an option is; nobody retypes these next to `group=option`
_REPAIR_ROUNDS = 3


@dataclass(frozen=True)
class Suggestion:
    """Overrides to type after the user's own: group choices, then dotted fields."""

    groups: tuple[tuple[str, str], ...] = ()
    fields: tuple[tuple[str, Any], ...] = ()

    def __str__(self) -> str:
        return " ".join([f"{g}={n}" for g, n in self.groups] +
                        [f"{k}={_format(v)}" for k, v in self.fields])

    def plus(self, other: Suggestion) -> Suggestion:
        """``self`` with ``other``'s groups and fields whose key it does not set yet."""
        have_g, have_f = dict(self.groups), dict(self.fields)
        return Suggestion(self.groups + tuple((g, n) for g, n in other.groups if g not in have_g),
                          self.fields + tuple((k, v) for k, v in other.fields if k not in have_f))


def pick_auto(cfg: SwaFactoryConfig,
              device: DeviceInfo) -> tuple[SwaFactoryConfig | None, list[Reason]]:
    """`backend=auto` → the first preferred backend that passes, keeping auto's fields; else None
    and every candidate's reasons (each message prefixed with `[name]`)."""
    tried: list[Reason] = []
    for name in AUTO_PREFERENCE.get(device.kind, ()):
        cand = cfg.model_copy(update={"backend": cfg.backend.model_copy(update={"name": name})})
        reasons = check(cand, device)
        if not reasons:
            return cand, []
        tried.extend(Reason(r.part, r.field, f"[{name}] {r.message}", r.fix, r.rule) for r in reasons)
    return None, tried


def reasons_for(cfg: SwaFactoryConfig, device: DeviceInfo) -> list[Reason]:
    """`check` with `backend=auto` resolved first; empty means ``cfg`` runs on ``device``."""
    return pick_auto(cfg, device)[1] if cfg.backend.name == "auto" else check(cfg, device)


def working_backends(cfg: SwaFactoryConfig, device: DeviceInfo) -> list[str]:
    """Backends X (table order) such that the overrides that gave ``cfg`` plus `backend=X` pass."""
    return [x for x in list_backends() if x != cfg.backend.name
            and _verify(cfg, device, Suggestion((("backend", x),)), pin=False)[0] is not None]


def suggest(cfg: SwaFactoryConfig, device: DeviceInfo, reasons: list[Reason],
            alternatives: list[str]) -> Suggestion | None:
    """The first of these that passes in every world, or None: the reasons' own fixes; the most
    preferred working backend; each other backend repaired with its own reasons' fixes."""
    if (fixed := _repair(cfg, device, _fixes(reasons), rounds=1)) is not None:
        return fixed
    pref = AUTO_PREFERENCE.get(device.kind, ())
    order = [*pref, *(b for b in list_backends() if b not in pref)]
    # one layer group on another kernel keeps the chosen kernel for the rest (fp8 at D = 512)
    for group in _refused_groups(cfg, reasons):
        for name in order:
            if name != cfg.backend.kernel_for(group == "swa"):
                s = Suggestion(fields=((f"backend.groups.{group}", name),))
                if (fixed := _verify(cfg, device, s)[0]) is not None:
                    return fixed
    # the current spec and model, spelled out to make a whole combination; they change nothing
    same = tuple((g, n) for g, n in (("spec", cfg.spec.name), ("model", cfg.model.name))
                 if _option(g, n) is not None)
    if alternatives:
        return Suggestion((("backend", min(alternatives, key=order.index)), *same))
    for name in order:
        if name == cfg.backend.name:
            continue
        if (fixed := _repair(cfg, device, Suggestion((("backend", name), *same)))) is not None:
            return fixed
    return None


def _refused_groups(cfg: SwaFactoryConfig, reasons: list[Reason]) -> list[str]:
    """Layer groups a reason is about (a group's head_dim, or its kernel's field), when the
    model has both groups: moving that group alone to another kernel may be the whole fix."""
    if not (cfg.model.swa_layers and cfg.model.full_layers):
        return []
    out = []
    for r in reasons:
        for g in ("swa", "full"):
            if g not in out and (r.field in (f"model.{g}.head_dim", f"backend.groups.{g}") or
                                 f" {g} layer of " in r.message or
                                 f" {g} layers of " in r.message):
                out.append(g)
    return out


# ------------------------------------------------------------------ replaying the overrides
def _repair(cfg: SwaFactoryConfig, device: DeviceInfo, s: Suggestion,
            rounds: int = _REPAIR_ROUNDS) -> Suggestion | None:
    """``s``, grown by the fixes of the reasons it still meets, once it passes in every world."""
    if not s.groups and not s.fields:
        return None
    for _ in range(rounds):
        good, reasons = _verify(cfg, device, s)
        if good is not None:
            return good
        grown = s.plus(_fixes(reasons))
        if grown == s:
            return None
        s = grown
    return _verify(cfg, device, s)[0]


def _verify(cfg: SwaFactoryConfig, device: DeviceInfo, s: Suggestion,
            pin: bool = True) -> tuple[Suggestion | None, list[Reason]]:
    """``s`` (or ``s`` with the fewest of its uncertain fields pinned) if it passes in every
    world, and the reasons of the first world that failed."""
    replay = _worlds(cfg, s)
    if replay is None:
        return None, []
    worlds, pins = replay
    for data in worlds:
        reasons = _reasons(data, device)
        if reasons is None or reasons:
            first = reasons or []  # a world the schema refuses has no reasons to repair from
            break
    else:
        return s, []
    for n in range(1, len(pins) + 1 if pin else 0):  # the fewest pins that make every world pass
        for some in itertools.combinations(pins, n):
            pinned = s.plus(Suggestion(fields=some))
            if _verify(cfg, device, pinned, pin=False)[0] is not None:
                return pinned, first
    return None, first


def _reasons(data: dict, device: DeviceInfo) -> list[Reason] | None:
    """Reasons a composed world cannot run; None when it does not even pass the schema."""
    try:
        cfg = SwaFactoryConfig.model_validate(data)
    except ValidationError:
        return None
    return reasons_for(cfg, device)


def _worlds(cfg: SwaFactoryConfig, s: Suggestion) -> tuple[list[dict], tuple] | None:
    """Every config the user's command line + ``s`` may compose to (the world where no uncertain
    field was typed first), and the pins that remove the uncertainty; None if one cannot compose."""
    base = cfg.model_dump()
    fixed = {k for k, _ in s.fields}
    switched: dict[str, dict] = {}
    maybe: list[tuple[str, str]] = []
    pins: list[tuple[str, Any]] = []
    for group, name in s.groups:
        cur = base[group]
        if cur.get("name") == name:
            continue  # re-selecting the current option changes nothing
        new_raw, cur_raw = _option(group, name), _option(group, cur.get("name"))
        if group not in _SWITCHABLE or new_raw is None or cur_raw is None:
            return None
        cur_full, new_full = _full(group, cur["name"]), _full(group, name)
        typed = {k: v for k, v in cur.items()
                 if k not in _IDENTITY and cur_full.get(k, _MISSING) != v}
        uncertain = [k for k in cur_raw if k not in _IDENTITY and k not in typed and k in cur
                     and new_full.get(k, _MISSING) != cur[k] and f"{group}.{k}" not in fixed]
        if any(k not in new_raw for k in (*typed, *uncertain)):
            return None  # Hydra refuses to set a key the new option's YAML does not have
        switched[group] = {**new_raw, **typed}
        maybe += [(group, k) for k in uncertain]
        pins += [(f"{group}.{k}", new_full[k]) for k in uncertain]
    worlds = []
    for typed_now in itertools.product((False, True), repeat=len(maybe)):
        data = {**base, **{g: dict(v) for g, v in switched.items()}}
        for (g, k), on in zip(maybe, typed_now):
            if on:
                data[g][k] = base[g][k]
        if not all(_set(data, path, value) for path, value in s.fields):
            return None
        worlds.append(data)
    return worlds, tuple(pins)


def _set(data: dict, path: str, value: Any) -> bool:
    """Set a dotted field as a Hydra override would (copying dicts on the way); False if absent."""
    *parents, leaf = path.split(".")
    node = data
    for p in parents:
        if not isinstance(node.get(p), dict):
            return False
        node[p] = dict(node[p])
        node = node[p]
    if leaf not in node:
        return False
    node[leaf] = value
    return True


@cache
def _option(group: str, name: str | None) -> dict | None:
    """An option's YAML as plain data (`conf/<group>/<name>.yaml`), or None if not shipped."""
    path = conf_dir() / group / f"{name}.yaml"
    if not name or not path.is_file():
        return None
    data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    return data if isinstance(data, dict) else None


@cache
def _full(group: str, name: str) -> dict:
    """An option as the schema reads it (defaults filled in)."""
    return _SWITCHABLE[group].validate_python(_option(group, name)).model_dump()


# ------------------------------------------------------------------ fixes as overrides
def _fixes(reasons: list[Reason]) -> Suggestion:
    """The reasons' fixes that are overrides (not `pip install …`), the first per key."""
    out = Suggestion()
    for r in reasons:
        if r.fix and (s := _parse(r.fix)) is not None:
            out = out.plus(s)
    return out


@cache
def _parse(fix: str) -> Suggestion | None:
    """A fix as overrides, read by Hydra's own parser; None when it is not plain overrides."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(fix.split())
    except HydraException:
        return None
    groups, fields = [], []
    for o in parsed:
        if o.is_add() or o.is_delete() or o.is_sweep_override() or o.package:
            return None
        key, value = o.key_or_group, o.value()
        if key in GROUPS:
            groups.append((key, str(value)))
        elif "." in key and key.split(".")[0] in GROUPS + ("parallel",):
            fields.append((key, value))
        else:
            return None
    return Suggestion(tuple(groups), tuple(fields))


def _format(value: Any) -> str:
    """A value as it is typed on the command line."""
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else str(value)
