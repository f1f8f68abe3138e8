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

from swafactory.engine.distill import NEW_TOKENS, _data
from swafactory.engine.drafters import EagleDraft, MtpDraft
from swafactory.engine.formats import load_feature_draft, save_feature_draft
from swafactory.engine.runner import attn_implementation
from swafactory.engine.train import (TOKENS_PER_BATCH, Batch, Recipe, Trained, batch_size,
                                     cache_dir, load_cached, save_cached, train)

__all__ = ["FEATURE_DISTILL", "UNROLL", "distill_features", "target_features"]

FEATURE_DISTILL = Recipe(steps=200, lr=1e-2, batch=16)
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
    returns (the draft, `Trained`). fields: the cache key (target weights, draft config, seed)."""
    device = next(draft.parameters()).device
    fields = {**fields, "recipe": asdict(FEATURE_DISTILL), "unroll": UNROLL,
              "objective": "ce+feature" if isinstance(draft, EagleDraft) else "ce",
              "tokens_per_batch": TOKENS_PER_BATCH.get(device.type)}
    path = cache_dir("drafts", fields)
    hit = load_cached(path, fields)
    if hit is not None:
        loaded = load_feature_draft(path, target, device)
        return loaded, Trained(**{**hit, "what": f"draft {family}", "seconds": 0.0,
                                  "cached": True, "path": str(path)})
    t0 = time.perf_counter()
    if progress is not None:
        print(f"distilling the {family} draft ({FEATURE_DISTILL.steps} steps) on the target's "
              "hidden states and greedy continuations", file=progress, flush=True)
    groups, held = _data(target, target.config.vocab_size, window, seed, device)
    feats = [target_features(target, draft, g) for g in groups]
    hfeat = target_features(target, draft, held)
    frozen = [draft.embed_tokens.weight]  # sglang serves EAGLE and MTP with the target's head
    if isinstance(draft, MtpDraft):
        frozen.append(draft.inner.lm_head.weight)
    elif isinstance(draft, EagleDraft):
        frozen.append(draft.lm_head.weight)
    for p in frozen:
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)

    def make(seqs: torch.Tensor, f: torch.Tensor, start: int) -> Batch:
        labels = seqs[:, 1:].clone()
        labels[:, :start - 1] = -100  # the random prompt cannot be predicted
        return Batch(seqs[:, :-1], labels, features=f[:, :-1])

    def batch(step: int) -> Batch:
        i = step % len(groups)
        seqs, f = groups[i], feats[i]
        n = batch_size(FEATURE_DISTILL, seqs.shape[1], device)
        rows = torch.randint(0, seqs.shape[0], (n,), generator=gen).to(device)
        return make(seqs[rows], f[rows], seqs.shape[1] - NEW_TOKENS)

    _, loss, steps = train(draft, batch, FEATURE_DISTILL, label=f"{family} draft",
                           progress=progress, loss=_loss)
    b = make(held, hfeat, held.shape[1] - NEW_TOKENS)
    with torch.no_grad():
        first = _passes(draft, b, 1)[0].logits
    keep = b.labels != -100
    agree = float((first.argmax(-1)[keep] == b.labels[keep]).float().mean())
    seconds = time.perf_counter() - t0
    trained = Trained(f"draft {family}", steps, seconds, seconds, loss, agree, False,
                      str(path), asdict(FEATURE_DISTILL))
    save_cached(draft, path, fields, trained,
                save=lambda d: save_feature_draft(draft, d, target.config))
    return draft, trained
