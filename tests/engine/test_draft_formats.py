"""Feature drafts in sglang's formats: an EAGLE head (``LlamaForCausalLMEagle``), an EAGLE-3
head (``LlamaForCausalLMEagle3``), a NEXTN/MTP layer and a DFlash drafter (``DFlashDraftModel``), distilled on the target's hidden states, saved in the format sglang loads, and
loaded back through ``spec.draft_weights=<directory>`` with the same tokens and accept lengths.

Shares the suite's model cache and the "distill" worker with test_distill.py (each model trains
once per clone)."""
from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

import swafactory  # noqa: E402
from swafactory.engine.run import run_generate  # noqa: E402
from swafactory.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.xdist_group("distill")

BASE = ["run=generate", "model=tiny", "backend=torch", "run.target_weights=pretrained",
        "workload=smoke"]  # the workload its drafts were checked on
CHAIN4 = ["spec.num_steps=4", "spec.num_draft_tokens=5"]
SPECS = {"eagle": ["spec=eagle", *CHAIN4], "eagle3": ["spec=eagle3", "spec.topk=1", *CHAIN4],
         "nextn": ["spec=nextn", *CHAIN4], "dflash": ["spec=dflash"]}
TINY_LAYERS = 6  # run=generate's num_layers


def _gen(*overrides: str):
    return run_generate(swafactory.compose([*BASE, *overrides]))


def _keys(path) -> set[str]:
    from safetensors.torch import load_file

    return set(load_file(str(path / "model.safetensors")))


def _saved(family: str, tmp_path):
    """A distilled draft of ``family``: a copy of its directory, and its config.json."""
    r = _gen(*SPECS[family], "spec.draft_weights=distilled")
    assert r.status == "ok", r.checks
    path = tmp_path / family
    shutil.copytree(r.draft_training["path"], path)
    return path, json.loads((path / "config.json").read_text())


def test_an_eagle3_draft_is_saved_as_sglang_loads_it(tmp_path) -> None:
    path, config = _saved("eagle3", tmp_path)
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["num_hidden_layers"] == 1 and config["draft_vocab_size"] == 256
    assert config["target_hidden_size"] == config["hidden_size"] == 64
    # sglang's default aux layers: the outputs of layers 1, L/2 - 1 and L - 4
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 2]
    keys = _keys(path)
    for k in ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
              "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
              "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight",
              "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
              "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
              "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight"):
        assert k in keys, (k, sorted(keys))
    from safetensors.torch import load_file

    w = load_file(str(path / "model.safetensors"))
    assert w["fc.weight"].shape == (64, 3 * 64)
    assert w["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * 64  # [embeds, hidden]
    assert w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool


def test_an_eagle_draft_is_saved_as_sglang_loads_it(tmp_path) -> None:
    path, config = _saved("eagle", tmp_path)
    assert config["architectures"] == ["LlamaForCausalLMEagle"]
    keys = _keys(path)
    assert {"fc.weight", "fc.bias", "embed_tokens.weight", "layers.0.self_attn.q_proj.weight",
            "layers.0.post_attention_layernorm.weight", "layers.0.mlp.down_proj.weight"} <= keys
    # no final norm, no LM head (the target's serves), no input norm on the first layer
    assert not any(k.startswith(("norm.", "lm_head.", "layers.0.input_layernorm"))
                   for k in keys), sorted(keys)


def test_a_dflash_drafter_is_saved_in_its_published_layout(tmp_path) -> None:
    path, config = _saved("dflash", tmp_path)
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 8
    assert config["num_target_layers"] == TINY_LAYERS and config["num_hidden_layers"] == 5
    ids = config["dflash_config"]["target_layer_ids"]
    assert config["dflash_config"]["mask_token_id"] == 0 and len(ids) == 5
    keys = _keys(path)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight",
            "layers.4.self_attn.k_norm.weight", "layers.0.input_layernorm.weight",
            "layers.4.mlp.down_proj.weight"} <= keys
    # no embedding, no LM head: the target's serve
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in keys), sorted(keys)


def test_a_dflash_drafter_of_another_block_size_is_refused() -> None:
    made = _gen(*SPECS["dflash"], "spec.draft_weights=distilled")
    with pytest.raises(ConfigError) as e:
        _gen("spec=dflash", "spec.block_size=4", "spec.num_draft_tokens=4",
             f"spec.draft_weights={made.draft_training['path']}")
    assert "block_size 8; the spec's is 4" in str(e.value), str(e.value)


def test_a_split_dflash_drafter_keeps_its_sliding_layers_at_the_swa_geometry(tmp_path) -> None:
    """On a split draft pool (spec.draft_pool_split) the drafter's sliding layers live in the
    target's SWA sub-pool: on tiny (and Gemma 4) that is another KV geometry than the full
    layers', so the drafter takes it for those layers (`sliding_geometry`), saves it and loads
    back to the same tokens; a drafter without it is refused for that pool, naming both."""
    split = ["spec=dflash", "spec.draft_pool_split=true"]
    made = _gen(*split, "spec.draft_weights=distilled")
    assert made.status == "ok" and made.accept_len >= 4.0, made.checks
    path = tmp_path / "split"
    shutil.copytree(made.draft_training["path"], path)
    config = json.loads((path / "config.json").read_text())
    assert config["sliding_geometry"] == {"num_key_value_heads": 4, "head_dim": 16}
    assert (config["num_key_value_heads"], config["head_dim"]) == (2, 32)  # the full layers'
    assert config["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention",
                                     "sliding_attention", "full_attention"]
    from safetensors.torch import load_file

    state = load_file(str(path / "model.safetensors"))
    assert state["layers.0.self_attn.k_proj.weight"].shape == (4 * 16, 64)  # sliding
    assert state["layers.1.self_attn.k_proj.weight"].shape == (2 * 32, 64)  # full
    loaded = _gen(*split, f"spec.draft_weights={path}")
    assert [q.generated_ids for q in loaded.requests] == [q.generated_ids for q in made.requests]
    assert [q.accept_lengths for q in loaded.requests] == [q.accept_lengths for q in made.requests]
    plain, _ = _saved("dflash", tmp_path)
    with pytest.raises(ConfigError) as e:
        _gen(*split, f"spec.draft_weights={plain}")
    assert "sliding layers of 2 KV heads × 32" in str(e.value), str(e.value)
    assert "SWA geometry 4 × 16" in str(e.value), str(e.value)


def test_an_mtp_layer_is_saved_at_layer_index_num_hidden_layers(tmp_path) -> None:
    path, config = _saved("nextn", tmp_path)
    assert config["num_nextn_predict_layers"] == 1 and config["model_type"] == "gemma4_text"
    assert config["num_hidden_layers"] == TINY_LAYERS
    pre = f"model.layers.{TINY_LAYERS}."
    keys = _keys(path)
    assert all(k.startswith(pre) for k in keys), sorted(keys)
    for k in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
              "shared_head.head.weight", "embed_tokens.weight", "self_attn.k_proj.weight",
              "input_layernorm.weight"):
        assert pre + k in keys, (k, sorted(keys))


@pytest.mark.parametrize("family", sorted(SPECS))
def test_a_saved_feature_draft_serves_the_same_tokens_and_accepts(family: str, tmp_path) -> None:
    made = _gen(*SPECS[family], "spec.draft_weights=distilled")
    path = tmp_path / family  # the format alone: no swafactory.json beside it
    shutil.copytree(made.draft_training["path"], path,
                    ignore=shutil.ignore_patterns("swafactory.json"))
    loaded = _gen(*SPECS[family], f"spec.draft_weights={path}")
    assert loaded.status == "ok", loaded.checks
    assert loaded.draft_training is None and str(path) in loaded.draft
    assert [q.generated_ids for q in loaded.requests] == [q.generated_ids for q in made.requests]
    assert [q.accept_lengths for q in loaded.requests] == [q.accept_lengths for q in made.requests]
    assert made.accept_len >= 2.0, made.accept_len


@pytest.mark.parametrize("family", sorted(SPECS))
def test_a_feature_draft_through_graphs_and_a_host_ahead(family: str) -> None:
    r = _gen(*SPECS[family], "spec.draft_weights=distilled", "backend.cuda_graph=true",
             "run.overlap=true")
    assert r.status == "ok" and r.lossless is True, r.checks
    assert r.cuda_graphs["draft"]["replays"] > 0 and r.cuda_graphs["target"]["replays"] > 0
    assert r.accept_len >= 2.0


def test_a_reduced_draft_vocabulary_maps_to_target_ids(tmp_path) -> None:
    """d2t: target id = draft id + d2t[draft id]; tokens outside the draft vocabulary get -inf."""
    from swafactory.drafts.drafters import Eagle3Draft
    from swafactory.drafts.formats import load_feature_draft, save_feature_draft
    from swafactory.models.hf import load_target

    cfg = swafactory.validate(swafactory.compose(["run=generate", "model=tiny",
                                                  "backend=torch"]))
    target, _, _ = load_target(cfg, torch.float32, "cpu")
    from swafactory.drafts.drafters import make_feature_draft

    full = make_feature_draft("eagle3", target, 5, 0, random=True)
    config = full.config
    config.draft_vocab_size = 8
    small = Eagle3Draft(config)
    hot = torch.tensor([3, 7, 11, 40, 41, 100, 200, 255])
    with torch.no_grad():
        small.d2t.copy_(hot - torch.arange(8))
        small.t2d.zero_()
        small.t2d[hot] = True
    ids, pos = torch.tensor([[5, 9, 12]]), torch.arange(3)[None]
    out = small(ids, pos, torch.randn(1, 3, 64)).logits
    assert out.shape == (1, 3, 256)
    assert torch.isfinite(out[..., hot]).all() and torch.isinf(out).sum() == 3 * (256 - 8)
    save_feature_draft(small, tmp_path / "small")
    back = load_feature_draft(tmp_path / "small", target, "cpu")
    assert torch.equal(back.d2t, small.d2t) and back.config.draft_vocab_size == 8
    torch.testing.assert_close(back(ids, pos, torch.ones(1, 3, 64)).logits,
                               small(ids, pos, torch.ones(1, 3, 64)).logits)


def test_a_feature_draft_that_does_not_fit_is_refused_before_allocation(tmp_path,
                                                                        monkeypatch) -> None:
    r = _gen(*SPECS["eagle3"], "spec.draft_weights=distilled")
    path = tmp_path / "bad"
    shutil.copytree(r.draft_training["path"], path)
    config = json.loads((path / "config.json").read_text())
    config.update(vocab_size=100, target_hidden_size=32, num_key_value_heads=4,
                  eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 9]})
    (path / "config.json").write_text(json.dumps(config))
    from swafactory.models import build as build_mod

    monkeypatch.setattr(build_mod, "build_serving", lambda *a, **k: pytest.fail("allocated"))
    with pytest.raises(ConfigError) as e:
        _gen(*SPECS["eagle3"], f"spec.draft_weights={path}")
    text = str(e.value)
    for fragment in ("spec.draft_weights", "vocabulary 100", "3 × 32 aux features",
                     "eagle_aux_hidden_state_layer_ids is [1, 2, 9]", "KV heads"):
        assert fragment in text, (fragment, text)


def test_a_draft_of_another_family_is_refused() -> None:
    r = _gen(*SPECS["nextn"], "spec.draft_weights=distilled")
    with pytest.raises(ConfigError) as e:
        _gen(*SPECS["eagle3"], f"spec.draft_weights={r.draft_training['path']}")
    assert "holds an mtp draft" in str(e.value) and "spec=nextn" in str(e.value)
