"""Distilling a feature draft (`drafters`: EAGLE, EAGLE-3, MTP) from the target, as EAGLE-3 and
SpecForge train theirs: on the target's greedy continuations of random prompts
(`distill._data`), with the target's hidden states at every position computed once.

Row p reads the token at p and the feature of p - 1 and learns the target's token at p + 1.
The first pass reads the target's features (teacher forcing); each of the next ``UNROLL - 1``
passes reads the draft's own outputs of the pass before, shifted by one, as later draft steps
do at serving time (training-time test). The embedding (and an MTP layer's head) stay the
target's: sglang serves these drafts with the target's (EAGLE-3 has its own head over its
draft vocabulary). The result is cached in the sglang
format (`formats.save_feature_draft`), so ``spec.draft_weights=<that directory>`` loads it.
"""
from __future__ import annotations

import time
from dataclasses import asdict
from typing import TextIO

import torch

from swafactory.drafts.dflash import DFlashDraft
from swafactory.drafts.distill import (NEW_TOKENS, PromptLosses, _data, _masks, data_key,
                                      target_follows)
from swafactory.drafts.drafters import EagleDraft, MtpDraft
from swafactory.drafts.formats import load_feature_draft, save_feature_draft
from swafactory.engine.runner import attn_implementation
from swafactory.drafts.train import (TOKENS_PER_BATCH, Batch, Recipe, Trained, batch_size,
                                     cache_dir, load_cached, save_cached, say_cached,
                                     say_training, train)

__all__ = ["FEATURE_DISTILL", "BLOCK_DISTILL", "UNROLL", "distill_features", "recipe_for",
           "target_features"]

FEATURE_DISTILL = Recipe(steps=200, lr=1e-2, batch=16, stop_loss=0.15, stop_each=0.3)
"""The feature drafts' (EAGLE, EAGLE-3, MTP): they stop once the loss is below 0.15 and every
prompt length's last two losses are below 0.3. At `model=tiny` on the CPU machine: EAGLE at step
150, EAGLE-3 and NEXTN at 129 of 200 (worst prompt length 0.26, held-out top-1 ≥ 0.998, accept
3.8, 2.7 and 4.5). A stop on the mean alone left NEXTN at step 84 with a length at chance."""
BLOCK_DISTILL = Recipe(steps=240, lr=5e-3, batch=12, stop_loss=0.25)
"""DFlash's: a block row learns a token up to a block ahead, from fresh Qwen3 layers. At
`model=tiny` on the CPU machine 1e-2 sat at chance for 100 steps, and after 320 its worst prompt
length's loss was 0.81 (accept 6.86 of 8); 5e-3 after 240 steps: 0.90 (final loss 0.14, held-out
top-1 1.00, accept 6.00). Batch 16 took 63 CPU s beside another test process, past the 60 s
budget; batch 12 costs about a fifth less a step and reached 1.20 on its worst prompt length
(final loss 0.18, held-out top-1 1.00, accept 6.86), where 180 steps of 16 left it at 3.01. It
stops once its loss is below 0.25: at step 196 (46 CPU s in the suite) its worst prompt length's
loss was 0.74 (held-out top-1 1.00, accept 6.29 of 8; the seed-2 fault takes it to 1.94). At 0.2
it stopped at step 221 (accept 6.86) after 60.1 CPU s, past the 60 s budget on a slow day."""
GPU_STEPS, GPU_STOP_LOSS = 2000, 0.05
"""On a GPU a step costs about 20 ms at run=generate's sizes, and a longer lag needs more of
them (GPT-OSS's window 128: 320 DFlash steps at 1e-2 left held-out top-1 at 0.25 on the H200):
up to this many steps, stopping once the loss is below GPU_STOP_LOSS."""
GPU_BLOCK_LR = 3e-3
"""DFlash's learning rate on a GPU. At GPT-OSS's geometry (64 query heads, lag 136) 1e-2 left
its loss at 1.1-2.1 on every prompt length after 2000 steps (held-out top-1 0.36, accept 1.70
of 8); 3e-3 reached 0.16-0.61 (top-1 0.85, accept 3.89; H100, the same target)."""


def recipe_for(draft, device: torch.device) -> Recipe:
    """The recipe of ``draft`` on ``device`` (a GPU trains longer, until its loss is low)."""
    base = BLOCK_DISTILL if isinstance(draft, DFlashDraft) else FEATURE_DISTILL
    if device.type != "cuda":
        return base
    lr = GPU_BLOCK_LR if base is BLOCK_DISTILL else base.lr
    return Recipe(steps=GPU_STEPS, lr=lr, batch=base.batch, stop_loss=GPU_STOP_LOSS)
UNROLL = 2
"""Passes per batch: the target's features, then the draft's own (one draft step ahead)."""


def target_features(target, draft, seqs: torch.Tensor) -> torch.Tensor:
    """[B, T, F] of the target's hidden states that ``draft`` reads (its tap), for [B, T]
    sequences, fp32, no grad, in batches the token budget allows."""
    tap = draft.target_tap(target)
    out = []
    n = max(1, TOKENS_PER_BATCH.get(seqs.device.type, 4096) // seqs.shape[1])
    try:
        with torch.no_grad(), attn_implementation(
                target, "sdpa" if getattr(target, "_supports_sdpa", False) else "eager"):
            for i in range(0, len(seqs), n):
                part = seqs[i:i + n]
                target(input_ids=part, use_cache=False)
                out.append(tap.take().view(*part.shape, -1).float())
    finally:
        tap.remove()
    return torch.cat(out)


def _shift(f: torch.Tensor) -> torch.Tensor:
    """Row p reads row p - 1 (zeros at 0)."""
    return torch.cat([torch.zeros_like(f[:, :1]), f[:, :-1]], dim=1)


def _block_batch(draft, seqs: torch.Tensor, f: torch.Tensor, start: int, at: int | None,
                 gen: torch.Generator) -> Batch:
    """A DFlash batch: the root at L (random in the continuation, or ``at``), mask tokens after
    it; features = the context's aux hidden states plus a context-row column; masks by layer
    type (the block sees the context and itself, a sliding type only its window)."""
    B = draft.config.block_size
    L = at if at is not None else int(torch.randint(start, seqs.shape[1] - B + 1, (1,),
                                                     generator=gen))
    ids = seqs[:, :L + B].clone()
    ids[:, L + 1:] = draft.mask_token_id
    labels = torch.full_like(ids, -100)
    labels[:, L:L + B - 1] = seqs[:, L + 1:L + B]
    ctx = torch.zeros_like(ids, dtype=f.dtype)[..., None]
    ctx[:, :L] = 1.0
    feats = torch.cat([f[:, :L + B], ctx], dim=-1)
    types = set(draft.config.layer_types)
    return Batch(ids, labels, _masks(types, L + B, (L, L + B), draft.config.sliding_window,
                                     ids.shape[0], ids.device), features=feats)


def _passes(draft, b: Batch, unroll: int) -> list:
    """Each pass's `DraftOut`: the target's features, then the draft's own."""
    pos = torch.arange(b.ids.shape[1], device=b.ids.device).expand_as(b.ids)
    feats = _shift(draft.fuse(b.features))
    out = []
    for _ in range(unroll):
        o = draft(b.ids, pos, feats.to(next(draft.parameters()).dtype))
        out.append(o)
        feats = _shift(o.hidden)
    return out


def _block_loss(draft, b: Batch) -> torch.Tensor:
    """DFlash: one pass over the context rows (features' last column 1: their ctx) and the
    block rows (0), cross-entropy on the block rows' predictions."""
    rows = b.features[..., -1:]
    feats = draft.fuse(b.features[..., :-1]) * rows
    pos = torch.arange(b.ids.shape[1], device=b.ids.device).expand_as(b.ids)
    lg = draft(b.ids, pos, feats, attention_mask=b.masks).logits.float()
    return torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), b.labels.reshape(-1),
                                             ignore_index=-100)


def _loss(draft, b: Batch) -> torch.Tensor:
    """Cross-entropy on the labels, per pass; an EAGLE head also regresses the target's next
    feature (EAGLE's own loss: smooth L1 + 0.1 × the classification loss), which its outputs
    feed through the target's head."""
    total = []
    for o in _passes(draft, b, UNROLL):
        lg = o.logits.float()
        ce = torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]),
                                               b.labels.reshape(-1), ignore_index=-100)
        if isinstance(draft, EagleDraft):
            keep = (b.labels != -100)[..., None]
            reg = torch.nn.functional.smooth_l1_loss(o.hidden.float() * keep,
                                                     b.features.float() * keep)
            ce = reg + 0.1 * ce
        total.append(ce)
    return sum(total) / len(total)


def distill_features(target, draft, *, family: str, window: int, seed: int, fields: dict,
                     progress: TextIO | None = None):
    """Train ``draft`` (fp32, in place) on ``target``'s continuations, or load the cached one;
    returns (the draft, `Trained`). fields: the cache key (target weights, draft config, seed).
    A DFlash drafter learns blocks: the root at a random L, then mask tokens, over the
    context's features (rows < L); block row i learns the target's token at L + i + 1."""
    device = next(draft.parameters()).device
    recipe = recipe_for(draft, device)
    fields = {**fields, "recipe": asdict(recipe), "unroll": UNROLL,
              "prompts": data_key(window),
              "objective": "ce+feature" if isinstance(draft, EagleDraft) else
              "block" if isinstance(draft, DFlashDraft) else "ce",
              "tokens_per_batch": TOKENS_PER_BATCH.get(device.type)}
    path = cache_dir("drafts", fields)
    hit = load_cached(path, fields)
    if hit is not None:
        say_cached(progress, f"draft {family}", path, hit)
        loaded = load_feature_draft(path, target, device)
        return loaded, Trained(**{**hit, "what": f"draft {family}", "seconds": 0.0,
                                  "cached": True, "path": str(path)})
    t0, c0 = time.perf_counter(), time.process_time()
    if progress is not None:
        print(f"distilling the {family} draft ({recipe.steps} steps) on the target's "
              "hidden states and greedy continuations", file=progress, flush=True)
    say_training(progress, "drafts", f"draft {family}", path, fields, recipe)
    groups, held = _data(target, target.config.vocab_size, window, seed, device,
                         fields.get("target"))
    follows = target_follows(groups, window, progress)
    feats = [target_features(target, draft, g) for g in groups]
    hfeat = target_features(target, draft, held)
    frozen = [draft.embed_tokens.weight]  # sglang serves EAGLE, MTP, DFlash with the target's head
    if isinstance(draft, MtpDraft):
        frozen.append(draft.inner.lm_head.weight)
    elif isinstance(draft, (EagleDraft, DFlashDraft)):
        frozen.append(draft.lm_head.weight)
    for p in frozen:
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)

    block = isinstance(draft, DFlashDraft)

    def make(seqs: torch.Tensor, f: torch.Tensor, start: int, at: int | None = None) -> Batch:
        if block:
            return _block_batch(draft, seqs, f, start, at, gen)
        labels = seqs[:, 1:].clone()
        labels[:, :start - 1] = -100  # the random prompt cannot be predicted
        return Batch(seqs[:, :-1], labels, features=f[:, :-1])

    losses = PromptLosses(_block_loss if block else _loss, groups)

    def batch(step: int) -> Batch:
        i = losses.group = step % len(groups)
        seqs, f = groups[i], feats[i]
        n = batch_size(recipe, seqs.shape[1], device)
        rows = torch.randint(0, seqs.shape[0], (n,), generator=gen).to(device)
        return make(seqs[rows], f[rows], seqs.shape[1] - NEW_TOKENS)

    _, loss, steps = train(draft, batch, recipe, label=f"{family} draft",
                           progress=progress, loss=losses, ready=losses.below(recipe.stop_each))
    start = held.shape[1] - NEW_TOKENS
    b = make(held, hfeat, start, start + NEW_TOKENS // 2 - draft.config.block_size // 2
             if block else None)
    with torch.no_grad():
        if block:
            rows = b.features[..., -1:]
            pos = torch.arange(b.ids.shape[1], device=device).expand_as(b.ids)
            first = draft(b.ids, pos, draft.fuse(b.features[..., :-1]) * rows,
                          attention_mask=b.masks).logits
        else:
            first = _passes(draft, b, 1)[0].logits
    keep = b.labels != -100
    agree = float((first.argmax(-1)[keep] == b.labels[keep]).float().mean())
    seconds = time.perf_counter() - t0
    trained = Trained(f"draft {family}", steps, seconds, seconds, loss, agree, False,
                      str(path), asdict(recipe), cpu_s=time.process_time() - c0,
                      loss_by_prompt=losses.say(f"{family} draft", progress),
                      target_follows=follows)
    save_cached(draft, path, fields, trained,
                save=lambda d: save_feature_draft(draft, d, target.config))
    return draft, trained
