"""The pretrained target's recipe at Gemma 4's attention geometry (`language.wire_copy_head`,
`language.WIRED_PRETRAIN`), trained on the CPU before any GPU run trains it at full size.

Gemma 4's heads, head dims and layer pattern are kept (32 query heads; sliding 16 KV heads ×
256, full 4 × 512; SSSSSF; scale 1.0 with QK-norm) at run=generate's hidden size; the window is
8 (lag 16) instead of 1024 (lag 1032). That is a fair stand-in because the recipe's difficulty
does not grow with the lag: the full layers start attending ``lag - 1`` keys back by RoPE
(checked here at both lags: the same share of the attention on the key), and what training
learns is the token path, the same at any lag. The copied key lies outside the window at both.
"""
from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

import swafactory  # noqa: E402
from swafactory.drafts import language  # noqa: E402
from swafactory.models.hf import load_target, target_config, require_transformers  # noqa: E402

STEPS = 36
"""Steps the CPU test trains (the recipe stops at 0.05 loss, about 65 steps at this size: held-out
agreement 0.97 at 40 steps, 0.996 at 65; a target at chance agrees on 1/256 of the tokens)."""
BASE = ["run=generate", "model=gemma4", "run.target_weights=pretrained"]


def _random_target(window: int):
    tf = require_transformers()
    cfg = swafactory.compose([*BASE, f"model.sliding_window={window}"])
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(target_config(cfg), attn_implementation="eager",
                                               dtype=torch.float32)


def _copy_head_share(model, lag: int) -> float:
    """The full layer's mean attention, over its heads, on the key ``lag - 1`` back from the last
    of ``lag + 8`` random tokens (its own projections, on the embeddings: the sliding layers
    write nothing to the constant dim the queries and keys read)."""
    layer = next(l for l, t in zip(model.model.layers, model.config.layer_types)
                 if t == "full_attention")
    attn, T = layer.self_attn, lag + 8
    ids = torch.randint(1, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        n = layer.input_layernorm(model.model.embed_tokens(ids))
        cos, sin = model.model.rotary_emb(n, torch.arange(T)[None], "full_attention")
        d = attn.head_dim
        q = attn.q_norm(attn.q_proj(n).view(1, T, -1, d))
        k = attn.k_norm(attn.k_proj(n).view(1, T, -1, d))
        from transformers.models.gemma4.modeling_gemma4 import apply_rotary_pos_emb
        q = apply_rotary_pos_emb(q, cos, sin, unsqueeze_dim=2)[0, -1]  # [H, d]
        k = apply_rotary_pos_emb(k, cos, sin, unsqueeze_dim=2)[0]  # [T, KV, d]
        k = k.repeat_interleave(q.shape[0] // k.shape[1], dim=1)  # [T, H, d]
        p = torch.softmax(torch.einsum("hd,thd->ht", q, k) * attn.scaling, dim=-1)
    return float(p[:, T - lag].mean())


def test_only_a_full_layer_with_many_rope_pairs_is_wired() -> None:
    """Gemma 4's full heads (512, partial rotary 0.25: 64 pairs) take the wired recipe;
    `model=tiny` (4 pairs) keeps the plain one, so its cache key and cached target stay."""
    assert language.wired(_random_target(8))
    tf = require_transformers()
    tiny = tf.AutoModelForCausalLM.from_config(
        target_config(swafactory.compose(["run=generate", "model=tiny"])))
    assert not language.wired(tiny)


def test_the_copy_head_attends_the_lag_at_any_lag() -> None:
    """Wired, the full layer puts the same share of its attention on the key a lag back at
    Gemma 4's own window (lag 1032) as at the test's (lag 16); random, almost none."""
    shares = {}
    for window in (8, 1024):
        model, lag = _random_target(window), language.lag_for(window)
        assert _copy_head_share(model, lag) < 0.1
        language.wire_copy_head(model, lag)
        shares[window] = _copy_head_share(model, lag)
    assert min(shares.values()) > 0.9 and abs(shares[8] - shares[1024]) < 0.02, shares


def test_the_gemma4_target_learns_the_language_outside_its_window(monkeypatch, tmp_path) -> None:
    """The recipe, through run=generate's own path (`load_target` → `language.pretrain`), cut to
    `STEPS` steps: the trained target's greedy continuations of held-out random prompts repeat
    the token a lag back (outside the window) at 0.8 or more; before training, at chance."""
    monkeypatch.setenv("SWAFACTORY_CACHE_DIR", str(tmp_path))  # not the suite's shared cache
    monkeypatch.setattr(language, "WIRED_PRETRAIN",
                        dataclasses.replace(language.WIRED_PRETRAIN, steps=STEPS))
    window = 8
    lag = language.lag_for(window)
    cfg = swafactory.compose([*BASE, f"model.sliding_window={window}"])
    before = _random_target(window)
    prompts = torch.randint(1, 256, (16, lag + 8), generator=torch.Generator().manual_seed(1))
    chance = language.lag_copy_agreement(language.greedy(before.eval(), prompts, 16), lag + 8, lag)
    assert chance < 0.2
    model, _, trained = load_target(cfg, torch.float32, "cpu")
    assert trained is not None and not trained.cached and trained.steps <= STEPS
    assert trained.heldout_top1 >= 0.8, trained
    assert len(list((tmp_path / "targets").iterdir())) == 1
