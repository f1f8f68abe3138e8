"""Schema errors are reported by dotted override path, all at once, as ConfigError."""
from __future__ import annotations

import pytest

import swafactory
from swafactory import ConfigError


def _fields(overrides: list[str]) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        swafactory.compose(overrides)
    return {r.field: r.message for r in info.value.reasons}


def test_topk_zero_is_reported_at_its_path() -> None:
    with pytest.raises(ConfigError) as info:
        swafactory.compose(["spec.topk=0"])
    assert "- `spec.topk`: must be ≥ 1, got 0" in str(info.value)


def test_every_error_at_once() -> None:
    got = _fields(["spec.topk=0", "backend.page_size=0", "workload.swa_full_tokens_ratio=1.5",
                   "+backend.pagesize=16"])
    assert set(got) == {"spec.topk", "backend.page_size", "workload.swa_full_tokens_ratio",
                        "backend.pagesize"}
    assert "unknown field" in got["backend.pagesize"]


def test_validator_errors_land_on_their_field() -> None:
    assert "topk must be 1" in _fields(["spec=eagle", "spec.topk=2"])["spec.topk"]
    assert "block_size" in _fields(["spec=dflash", "spec.block_size=4"])["spec.num_draft_tokens"]
    assert "S and F" in _fields(["model.layer_pattern=SXF"])["model.layer_pattern"]


def test_literal_and_unknown_backend() -> None:
    got = _fields(["backend.tree_mask=tree", "backend.name=flashinfr"])
    assert "custom_mask" in got["backend.tree_mask"]
    assert "unknown backend 'flashinfr'" in got["backend.name"]


def test_typo_in_option_becomes_config_error_listing_options() -> None:
    with pytest.raises(ConfigError) as info:
        swafactory.compose(["backend=flashinfr"])
    text = str(info.value)
    assert "Available options in 'backend'" in text and "flashinfer" in text


def test_override_of_missing_key_without_plus() -> None:
    with pytest.raises(ConfigError):
        swafactory.compose(["backend.pagesize=16"])


def test_a_field_typo_names_the_key_the_value_and_the_nearest_field() -> None:
    """`spec.topkk=2` is refused before Hydra (whose advice, "use +", only moved the error),
    with the overrides' other errors; `+spec.topkk=2` the same; a group typo too."""
    with pytest.raises(ConfigError) as info:
        swafactory.compose(["spec.topkk=2", "backend.page_size=0", "modle=tiny"])
    got = {r.field: r for r in info.value.reasons}
    assert set(got) == {"spec.topkk", "modle", "backend.page_size"}
    assert got["spec.topkk"].message == "unknown field (got spec.topkk=2); did you mean spec.topk?"
    assert got["spec.topkk"].fix == "spec.topk=2" and got["modle"].fix == "model=tiny"
    assert "To append" not in str(info.value)
    assert _fields(["+spec.topkk=2"]) == {
        "spec.topkk": "unknown field (got +spec.topkk=2); did you mean spec.topk?"}


def test_another_algorithms_field_appended_says_whose_it_is() -> None:
    assert _fields(["spec=eagle3", "+spec.block_size=4"])["spec.block_size"] == (
        "spec=eagle3 has no block_size (got 4); it is a field of spec=dflash")
