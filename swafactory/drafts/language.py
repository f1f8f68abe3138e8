"""The built-in synthetic language a ``run.target_weights=pretrained`` target is trained on.

Lag copy: a sequence's first tokens (its head: ``lag`` of them; up to `longest_prompt` under
`WIDE_HEADS`) are random, and every later token repeats the one ``lag`` positions back. A model
that has learnt it predicts its next token by attending to one key ``lag - 1`` positions back:
its greedy continuation of any prompt is the prompt's last ``lag`` tokens, repeated. A draft can
learn that exactly, but only by reading the right K/V.

The lag is the model's sliding window plus 8 (`lag_for`): the key a token copies lies outside
the window, so only full-attention layers reach it, in the target and in a full-attention
draft. A draft whose out-of-window keys are lost (translated through the SWA mapping, evicted,
read from the wrong pool) then loses its accept length at once: the symptom users saw.

Token 0 never occurs: it is the models' padding id (a zero embedding) and DFlash's mask token.

A target whose full layers have many RoPE frequencies (Gemma 4: 64 rotary pairs of its 512-dim
full heads) starts from `wire_copy_head` and trains with `WIRED_PRETRAIN`: learning to attend
exactly ``lag - 1`` keys back from chance is the slow part (Gemma 4's window 1024: still at
chance after 176 steps on an H100), and its full layers' slowest frequency turns once every 188
positions, so no smooth score leads gradient descent towards a key a thousand back. Wired, only
the token path is learnt, and that does not depend on the lag (`wire_copy_head`).
"""
from __future__ import annotations

from dataclasses import asdict
from typing import TextIO

import torch

from swafactory.engine.runner import attn_implementation
from swafactory.drafts.train import (Batch, Recipe, Trained, batch_size, cache_dir, load_cached,
                                     load_weights, save_cached, say_cached, say_training, train)

__all__ = ["PRETRAIN", "WIRED_PRETRAIN", "wire_copy_head", "wired", "rotary_angles", "lag_for",
           "longest_prompt", "lag_copy", "lag_copy_agreement", "greedy", "pretrain"]


def lag_for(window: int | None) -> int:
    """The language's lag for a model of sliding ``window`` (None: no sliding layers): 8 keys
    beyond the window, so every workload's prompt (the window plus at least 8) holds a period."""
    return (window or 0) + 8


def longest_prompt(window: int | None) -> int:
    """The longest random prompt a draft is distilled on (and, under `WIDE_HEADS`, the target's
    longest head): the window plus the lag (at least 64). A random prompt longer than the lag
    is not periodic, so it lies outside a language of ``lag``-token heads; the distillation
    measures how closely the target still follows the rule there (`distill.target_follows`)."""
    return (window or 0) + max(64, lag_for(window))


def lag_copy(batch: int, length: int, vocab: int, gen: torch.Generator, lag: int,
             head: int | None = None) -> torch.Tensor:
    """[batch, length] int64 sequences of the language, ids in [1, vocab): ``head`` random
    tokens (default ``lag``), then each token the one ``lag`` back."""
    head = lag if head is None else head
    first = torch.randint(1, vocab, (batch, head), generator=gen)
    pos = torch.arange(length)
    return first[:, torch.where(pos < head, pos, head - lag + (pos - head) % lag)]


def lag_copy_agreement(seqs: torch.Tensor, start: int, lag: int) -> float:
    """The share of positions ≥ ``start`` of [batch, length] ``seqs`` that repeat the token
    ``lag`` back: how well a model's greedy continuations (from ``start``) follow the language."""
    return float((seqs[:, start:] == seqs[:, start - lag:seqs.shape[1] - lag]).float().mean())


PRETRAIN = Recipe(steps=1500, lr=1e-2, batch=32, stop_loss=0.05)
"""The target's recipe: until the loss is near 0. At the tiny geometry that takes about 150
steps (measured on the CPU machine); a model whose only full layers must reach a long lag may
need more, which a GPU gives in seconds."""
PERIODS = 3
"""A training sequence holds at least this many periods of the lag (the first one random)."""
WIDE_HEADS = False
"""Train the target on random heads of ``lag`` to `longest_prompt` tokens (one length per
batch, and a period after the head) rather than of ``lag`` alone. Off: on `model=tiny` such a
target carries the copied tokens in hidden states inside the window, so a DFlash drafter
reading them needs no out-of-window key and a pool fault that loses those keys no longer
lowers its accept length (`bench/probes/distill_prompts.py --heads wide` compares)."""


WIRED_PRETRAIN = Recipe(steps=100, lr=1e-2, batch=8, stop_loss=0.05)
"""The recipe of a `wired` target. At Gemma 4's geometry with window 8 (lag 16) on the CPU
machine it converged in 65 steps (held-out agreement 0.996); 8 rows are also what an H100 runs
at window 1024 (8 × 3096 tokens, under `TOKENS_PER_BATCH`), about 1.7 s a step in fp32."""
MIN_ROTARY_PAIRS = 16
"""`wired` needs this many RoPE frequencies in the full layers: their sum peaks at one offset
(at 64, the neighbours score 0.93 of the peak and every other offset less). `model=tiny` has 4
(head_dim 32, partial rotary 0.25) and keeps its plain recipe and cached target."""
QUIET = 0.1
"""`wire_copy_head`'s starting scale of the sliding layers' post-norms."""


def rotary_angles(model, layer_type: str = "full_attention") -> torch.Tensor:
    """[head_dim] fp32: the RoPE angle per position of each query/key dim of ``layer_type``
    (0 where the dim is not rotated; dim i pairs with i + head_dim / 2)."""
    x = torch.zeros(1, 1, model.config.hidden_size, device=model.device)
    pos = torch.ones(1, 1, dtype=torch.long, device=model.device)
    cos, sin = model.model.rotary_emb(x, pos, layer_type)
    return torch.atan2(sin[0, 0], cos[0, 0]).float()


def _pairs(model) -> torch.Tensor | None:
    if getattr(model.config, "model_type", None) != "gemma4_text" or \
            "full_attention" not in (model.config.layer_types or []):
        return None
    th = rotary_angles(model)
    return (th[:th.numel() // 2] != 0).nonzero().flatten()


def wired(model) -> bool:
    """Whether ``model`` trains from `wire_copy_head` (a Gemma 4 text model whose full layers
    have `MIN_ROTARY_PAIRS` RoPE frequencies or more)."""
    pairs = _pairs(model)
    return pairs is not None and pairs.numel() >= MIN_ROTARY_PAIRS


def wire_copy_head(model, lag: int, dim: int = 0) -> None:
    """Start ``model`` (a `wired` Gemma 4) with every full-layer query attending ``lag - 1`` keys
    back, whatever the tokens: the language's key, outside the window.

    * Residual dim ``dim`` holds a constant: every token's embedding there is 1, and no layer
      writes it (its rows of the output projections are 0).
    * Each full-layer query reads only that constant into the real parts of its rotary pairs:
      after QK-norm a fixed vector. Each key reads it into pair i as angle θ_i·(lag - 1), so the
      score of a key Δ back is Σ_i a cos(θ_i (Δ - lag + 1)): it peaks at lag - 1 for any lag.
      q_norm at 1 puts 0.99 of the attention there. The key's other dims (its value too: K = V
      in Gemma 4's full layers) keep their random weights and carry the copied token.
    * The sliding layers start quiet (post-norms at `QUIET`): their random outputs would drown
      the copied token in the residual stream (with them at 1, chance after 60 steps).

    Everything stays trainable; training learns the token path (embedding → value → logits),
    whose difficulty does not grow with the lag."""
    pairs, th = _pairs(model), rotary_angles(model)
    half = th.numel() // 2
    layers, types = model.model.layers, model.config.layer_types
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb[1:, dim] = 1.0  # token 0: the padding id's zero embedding stays
        for layer, kind in zip(layers, types):
            layer.self_attn.o_proj.weight[dim] = 0.0
            layer.mlp.down_proj.weight[dim] = 0.0
            if kind == "sliding_attention":
                layer.post_attention_layernorm.weight.fill_(QUIET)
                layer.post_feedforward_layernorm.weight.fill_(QUIET)
                continue
            attn, d = layer.self_attn, 2 * half
            wq = attn.q_proj.weight.view(attn.q_proj.out_features // d, d, -1)
            wk = attn.k_proj.weight.view(attn.k_proj.out_features // d, d, -1)
            wq.zero_()
            wq[:, pairs, dim] = 1.0
            wk[:, :, dim] = 0.0
            wk[:, pairs] = 0.0
            wk[:, pairs + half] = 0.0
            wk[:, pairs, dim] = torch.cos(th[pairs] * (lag - 1))
            wk[:, pairs + half, dim] = torch.sin(th[pairs] * (lag - 1))
            attn.q_norm.weight.fill_(1.0)


def greedy(model, prompts: torch.Tensor, new: int) -> torch.Tensor:
    """[B, P + new] int64: ``prompts`` ([B, P] int64) and ``model``'s greedy continuation, by
    transformers' own generate with torch's SDPA attention (no swafactory in the loop; the same
    tokens as its eager attention on the tiny target, in two thirds of the time on the CPU;
    eager where the model has no SDPA path: GPT-OSS's sinks)."""
    sdpa = getattr(model, "_supports_sdpa", False)
    with torch.no_grad(), attn_implementation(model, "sdpa" if sdpa else "eager"):
        return model.generate(prompts, attention_mask=torch.ones_like(prompts),
                              max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              pad_token_id=0)


def pretrain(model, window: int | None, seed: int, key: dict,
             progress: TextIO | None = None) -> Trained:
    """Train ``model`` (fp32, eager, random weights) on the lag-copy language of its sliding
    ``window``, or load the cached result for ``key`` (the fields its weights depend on:
    config, seed, post_init)."""
    lag = lag_for(window)
    heads = (lag, longest_prompt(window) if WIDE_HEADS else lag)  # longest > lag always
    wire = wired(model)
    recipe = WIRED_PRETRAIN if wire else PRETRAIN
    fields = {**key, "seed": seed, "recipe": asdict(recipe), "language": f"lag_copy/{lag}",
              "periods": PERIODS, "batch": batch_size(recipe, PERIODS * lag, model.device),
              **({"heads": list(heads)} if WIDE_HEADS else {}),
              **({"init": f"copy_head/quiet={QUIET}"} if wire else {})}
    path = cache_dir("targets", fields)
    hit = load_cached(path, fields)
    if hit is not None:
        say_cached(progress, "target", path, hit)
        load_weights(model, path)
        model.eval()
        return Trained(**{**hit, "seconds": 0.0, "cached": True, "path": str(path)})
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    rows = batch_size(recipe, PERIODS * lag, model.device)
    if wire:
        wire_copy_head(model, lag)

    def batch(step: int) -> Batch:
        head = int(torch.randint(heads[0], heads[1] + 1, (1,), generator=gen)) \
            if WIDE_HEADS else lag
        x = lag_copy(rows, max(PERIODS * lag, head + lag) + 1, vocab, gen, lag, head)
        x = x.to(model.device)
        labels = x[:, 1:].clone()
        labels[:, :head - 1] = -100  # the random head cannot be predicted
        return Batch(x[:, :-1], labels)

    if progress is not None:
        print(f"pretraining the target on the lag-{lag} copy language (up to {recipe.steps} "
              "steps" + (", its full layers wired to attend the lag" if wire else "") + ")",
              file=progress, flush=True)
    say_training(progress, "targets", "target", path, fields, recipe)
    seconds, loss, steps = train(model, batch, recipe, label="target", progress=progress)
    held = torch.Generator().manual_seed(seed + 1)
    agree = 1.0
    for length in sorted({lag + 8, heads[1]} if WIDE_HEADS else {lag + 8}):
        prompts = torch.randint(1, vocab, (16, length), generator=held).to(model.device)
        agree = min(agree, lag_copy_agreement(greedy(model, prompts, 16).cpu(), length, lag))
    trained = Trained("target", steps, seconds, seconds, loss, agree, False, str(path),
                      asdict(recipe))
    save_cached(model, path, fields, trained)
    return trained
