"""Every "Try:" line and every listed backend works: the user's overrides plus the suggestion,
composed again, pass `check` on the same device.

Hydra's compose costs ~0.2 s, so the fuzz composes with `_compose` below: the same defaults, the
same option YAMLs and Hydra's own override parser, merged as Hydra does (group choices, last one
wins, then field overrides in order) and validated by the schema. A test holds it equal to
`swafactory.compose` on a sample.
"""
from __future__ import annotations

import copy
import random
from functools import cache

import pytest
from hydra.errors import HydraException
from omegaconf import OmegaConf
from pydantic import ValidationError

import swafactory
from swafactory import ConfigError
from swafactory.config.paths import GROUPS, conf_dir, group_options
from swafactory.config.schema import SwaFactoryConfig
from swafactory.registry.device import B200, CPU, H200, DeviceInfo
from swafactory.registry.select import validate

DEVICES = {"cpu": CPU, "cpu+interpreter": DeviceInfo("cpu", packages=frozenset({"triton"}),
                                                     triton_interpret=True),
           "h200": H200, "h200 bare": DeviceInfo("cuda", sm=90, name="H200, no kernel packages"),
           "b200": B200}

# Field overrides a user types; values Hydra and the schema both accept in some combination.
FIELDS = {
    "backend.page_size": ["1", "16", "64", "3"], "backend.tree_mask": ["custom_mask", "cascade"],
    "backend.resolver": ["auto", "allocator", "active_pool"],
    "backend.kv_dtype": ["float32", "float16", "bfloat16", "fp8_e4m3"],
    "backend.cuda_graph": ["true", "false"], "spec.topk": ["1", "2", "4"],
    "spec.num_steps": ["1", "3"], "spec.num_draft_tokens": ["2", "4", "8"],
    "workload.swa_full_tokens_ratio": ["0.01", "0.1", "0.5", "1.0", "auto"],
    "workload.context_len": ["512", "8192"], "model.attention_sinks": ["true", "false"],
    "model.logit_softcap": ["30.0", "null"], "model.sliding_window": ["16", "4096"],
    "parallel.tp": ["1", "2", "3"], "backend.groups.full": ["null", "triton", "flash_attn"],
    "backend.groups.swa": ["null", "flashinfer", "torch"]}


@cache
def _parser():
    from hydra.core.override_parser.overrides_parser import OverridesParser
    return OverridesParser.create()


@cache
def _parse(override: str):
    return _parser().parse_overrides([override])[0]


@cache
def _yaml(path: str) -> dict:
    return OmegaConf.to_container(OmegaConf.load(conf_dir() / path), resolve=True)


def _defaults() -> tuple[dict[str, str], dict]:
    root = _yaml("config.yaml")
    choices = {k: v for d in root["defaults"] if isinstance(d, dict) for k, v in d.items()}
    return choices, {k: v for k, v in root.items() if k not in ("defaults", "hydra")}


def _compose(overrides: list[str]) -> SwaFactoryConfig | None:
    """What `swafactory.compose(overrides)` gives, or None where it raises ConfigError."""
    choices, rest = _defaults()
    fields = []
    for text in overrides:
        o = _parse(text)
        if o.key_or_group in GROUPS:
            choices[o.key_or_group] = o.value()
        else:
            fields.append((o.key_or_group, o.value()))
    # deep copies: an override of a nested field (backend.groups.full) must not edit the cache
    data = copy.deepcopy({**{g: _yaml(f"{g}/{n}.yaml") for g, n in choices.items()}, **rest})
    for key, value in fields:
        *parents, leaf = key.split(".")
        node = data
        for p in parents:
            node = node[p]
        if leaf not in node:
            return None  # Hydra: key not in struct
        node[leaf] = value
    try:
        return SwaFactoryConfig.model_validate(data)
    except ValidationError:
        return None


def _random_overrides(rng: random.Random) -> list[str]:
    out = [f"{g}={rng.choice(group_options(g))}" for g in ("model", "spec", "backend")
           if rng.random() < 0.8]
    for key in rng.sample(sorted(FIELDS), rng.randint(0, 3)):
        out.append(f"{key}={rng.choice(FIELDS[key])}")
    rng.shuffle(out)
    return out


def _problems(overrides: list[str], err: ConfigError, device: DeviceInfo) -> list[str]:
    """Each suggestion or alternative of a refusal that does not pass when typed."""
    bad = []
    tries = ([err.suggestion.split()] if err.suggestion else []) + \
            [[f"backend={alt}"] for alt in err.alternatives]
    for extra in tries:
        try:
            cfg = _compose(overrides + extra)
        except HydraException as exc:  # e.g. `Try: pip install …`, which is not an override
            bad.append(f"{' '.join(extra)} is not overrides: {exc}")
            continue
        reasons = ["does not compose"] if cfg is None else swafactory.check(cfg, device)
        if reasons:
            bad.append(f"{' '.join(overrides)} + {' '.join(extra)} on {device.describe()}: "
                       f"{[str(r) for r in reasons]}")
    return bad


def test_the_fast_compose_is_hydras_compose() -> None:
    rng = random.Random(7)
    cases = [["backend=auto", "backend.kv_dtype=fp8_e4m3", "backend.kv_dtype=bfloat16"],
             ["backend.kv_dtype=float32", "backend=flashinfer", "backend=torch", "spec=eagle"],
             ["model=tiny", "spec.topk=2", "workload.swa_full_tokens_ratio=0.5"]]
    cases += [_random_overrides(rng) for _ in range(7)]
    for overrides in cases:
        try:
            want = swafactory.compose(overrides)
        except ConfigError:
            want = None
        assert _compose(overrides) == want, overrides


def test_fp8_suggestions_are_lines_that_work() -> None:
    # fp8 on auto resolves to a backend that reads it (torch on CPU); a backend that stores no
    # fp8 is refused with a line that works: switching to torch keeps fp8, which torch reads
    assert validate(_compose(["backend=auto", "backend.kv_dtype=fp8_e4m3"]), CPU).backend.name == \
        "torch"
    for model in ("gemma4", "gpt_oss_20b"):
        overrides = ["backend=flex", "backend.kv_dtype=fp8_e4m3", f"model={model}"]
        err = pytest.raises(ConfigError, validate, _compose(overrides), CPU).value
        assert err.suggestion and not _problems(overrides, err, CPU)
        assert err.alternatives == ("torch",)


def test_a_switch_pins_the_fields_a_user_may_have_typed(monkeypatch) -> None:
    # trtllm_mha's YAML has cuda_graph: true, so a config cannot tell whether the user also typed
    # `backend.cuda_graph=true`; `backend=torch` keeps it if typed, and this torch has no graph
    # path (the shipped one emulates graphs on CPU, which makes the pin unnecessary there)
    import dataclasses

    from swafactory.kernels import torch_ref
    from swafactory.registry import table
    monkeypatch.setattr(torch_ref, "CAPABILITIES",
                        dataclasses.replace(torch_ref.CAPABILITIES, graph_emulation=False))
    table.get_capabilities.cache_clear()
    try:
        _pins_what_may_have_been_typed()
    finally:
        monkeypatch.undo()
        table.get_capabilities.cache_clear()  # the shipped torch again for later tests


def _pins_what_may_have_been_typed() -> None:
    plain = ["backend=trtllm_mha", "spec=eagle", "model=gemma4"]
    typed = [*plain, "backend.cuda_graph=true"]
    assert _compose(plain) == _compose(typed)
    err = pytest.raises(ConfigError, validate, _compose(plain), CPU).value
    assert err.suggestion and "backend=torch" in err.suggestion
    assert not _problems(plain, err, CPU) and not _problems(typed, err, CPU)
    unpinned = err.suggestion.replace("backend.cuda_graph=false", "").split()
    assert swafactory.check(_compose(typed + unpinned), CPU), "the pin is needed"


def test_a_tree_on_a_chain_only_backend_suggests_a_chain_spec(monkeypatch) -> None:
    import sys
    import types

    from swafactory.registry import table
    from swafactory.registry.capabilities import Capabilities

    mod = types.ModuleType("chain_only_backend")
    mod.CAPABILITIES = Capabilities(name="chain_only", summary="test", kernel="test",
                                    devices=frozenset({"cpu"}),
                                    kv_dtypes=frozenset({"float32"}))  # no tree masks
    mod.Adapter = object
    monkeypatch.setitem(sys.modules, "chain_only_backend", mod)
    monkeypatch.setattr(table, "BACKENDS", {**table.BACKENDS, "chain_only": "chain_only_backend"})
    overrides = ["backend=torch", "backend.name=chain_only", "spec=eagle3", "model=tiny"]
    err = pytest.raises(ConfigError, validate, _compose(overrides), CPU).value
    assert [r.rule for r in err.reasons] == ["tree"]
    # eagle3's topk 4 and 8 tokens may have been typed too; eagle keeps them if so: both pinned
    assert err.suggestion == "spec=eagle spec.topk=1 spec.num_draft_tokens=4"
    assert not _problems(overrides, err, CPU)
    assert not _problems([*overrides, "spec.topk=4", "spec.num_draft_tokens=8"], err, CPU)


def test_random_refusals_suggest_only_what_passes() -> None:
    rng = random.Random(14)
    problems, suggested, refused = [], 0, 0
    for _ in range(300):
        overrides = _random_overrides(rng)
        cfg = _compose(overrides)
        if cfg is None:
            continue
        for device in DEVICES.values():
            try:
                validate(cfg, device)
            except ConfigError as err:
                refused += 1
                suggested += bool(err.suggestion)
                problems += _problems(overrides, err, device)
    assert not problems, "\n".join(problems[:10])
    assert refused > 300 and suggested > refused // 2, (refused, suggested)
