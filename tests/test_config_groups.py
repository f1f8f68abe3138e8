"""Every shipped YAML composes and validates, carries its launch command, and means what it says."""
from __future__ import annotations

import pytest

import swafactory
from swafactory.config.paths import GROUPS, conf_dir, group_options
from swafactory.registry.table import list_backends

OPTIONS = [(g, o) for g in GROUPS for o in group_options(g)]


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_shipped_option_composes_and_validates(group: str, option: str) -> None:
    cfg = swafactory.compose([f"{group}={option}"])
    node = getattr(cfg, group)
    if group != "run":
        assert node.name == option, "the `name` field must equal the file stem (the registry key)"


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_yaml_starts_with_its_launch_command(group: str, option: str) -> None:
    text = (conf_dir() / group / f"{option}.yaml").read_text()
    assert text.startswith("#")
    header = text.split("\n\n")[0]
    assert "python -m swafactory" in header
    if group == "model":
        assert "Source:" in header, "a model file names the source of its numbers"


def test_required_options_are_shipped() -> None:
    assert {"gemma4", "gemma4_26b_a4b", "gpt_oss_20b", "gpt_oss_120b", "gemma3_4b", "mistral_7b",
            "tiny"} <= set(group_options("model"))
    assert {"none", "eagle", "eagle3", "nextn", "frozen_kv_mtp", "dflash",
            "standalone"} <= set(group_options("spec"))
    assert set(group_options("backend")) == {"auto", *list_backends()}


def test_gemma4_layer_groups() -> None:
    m = swafactory.compose(["model=gemma4"]).model
    assert len(m.swa_layers) == 50 and len(m.full_layers) == 10
    assert m.full_layers == tuple(range(5, 60, 6))
    assert (m.swa.num_kv_heads, m.swa.head_dim) == (16, 256)
    assert (m.full.num_kv_heads, m.full.head_dim) == (4, 512)
    assert m.sliding_window == 1024


@pytest.mark.parametrize(("model", "n_swa", "n_full", "window"), [
    ("gpt_oss_20b", 12, 12, 128), ("gpt_oss_120b", 18, 18, 128), ("mistral_7b", 32, 0, 4096),
    ("gemma3_4b", 29, 5, 1024), ("gemma4_26b_a4b", 25, 5, 1024)])
def test_layer_patterns_expand(model: str, n_swa: int, n_full: int, window: int) -> None:
    m = swafactory.compose([f"model={model}"]).model
    assert (len(m.swa_layers), len(m.full_layers), m.sliding_window) == (n_swa, n_full, window)
    if model.startswith("gpt_oss"):
        assert m.layer_types[0] == "sliding_attention" and m.attention_sinks


def test_each_spec_says_who_owns_the_draft_kv() -> None:
    owners = {o: swafactory.compose([f"spec={o}"]).spec.draft_kv for o in group_options("spec")}
    assert owners["none"] == "none"
    assert owners["frozen_kv_mtp"] == "target_pool"
    assert {owners[s] for s in ("eagle", "eagle3", "nextn", "dflash", "standalone")} == {"own_pool"}
    assert swafactory.compose(["spec=eagle3"]).spec.topk > 1
