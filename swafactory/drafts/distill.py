"""A draft's weights other than the target's own: ``random``, ``distilled``, or a saved draft.

Such a draft has ``spec.draft_num_layers`` layers of the target's architecture, full attention in
its own pool (DFlash with ``draft_pool_split``: the target's last layer types), the target's
full-attention geometry, and its own embedding and LM head. It starts from the target's layers
of that geometry (``random``: the architecture's own initialisation).

``distilled`` trains it, with the same HF model code that serves it, on the target's greedy
continuations of random prompts (`language.greedy`: transformers' generate, no swafactory):

* a chain or tree draft (eagle, eagle3, nextn, standalone) as a causal LM on the continuation
  tokens, as it drafts: each step's input is the token drafted before;
* a DFlash draft on blocks: the root at position L, then mask tokens, which see the context
  causally and each other in full; row i learns the target's token at L + i + 1.

The result is cached (`train.cache_dir`) by the target's weights' key, the draft's
architecture, the objective (chain or block: eagle, eagle3, nextn and standalone drafts of one
architecture learn the same thing), the seed and the recipe, so a second run loads it; its
directory is a ``save_pretrained`` one, so ``spec.draft_weights=<that directory>`` loads it too.
"""
from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import TextIO

import torch

from swafactory.drafts.language import greedy, lag_copy_agreement, lag_for, longest_prompt
from swafactory.models.hf import attention_modules, draft_from_layers, require_transformers
from swafactory.drafts.train import (TOKENS_PER_BATCH, Batch, Recipe, Trained, batch_size,
                                     cache_dir, lm_loss, load_cached, load_weights, save_cached,
                                     say_cached, say_training, train)
from swafactory.errors import ConfigError, Reason

__all__ = ["DISTILL", "MASK_TOKEN", "prompt_over", "data_key", "make_draft", "load_draft",
           "check_draft", "distill", "weights_key", "PromptLosses", "target_follows"]

MASK_TOKEN = 0
"""The token id of a DFlash block's not-yet-drafted positions (the generator's too)."""

DISTILL = Recipe(steps=200, lr=1e-2, batch=16, stop_loss=0.15, stop_each=0.3)
"""The standalone draft's recipe (a small model of the target's own kind), stopping as the feature
drafts do (`distill_features.FEATURE_DISTILL`): at `model=tiny` on the CPU machine at step 122 of
200 (worst prompt length 0.22, held-out top-1 0.999, accept 4.5)."""
GROUPS, PROMPTS_PER_GROUP, NEW_TOKENS = 16, 64, 48
"""Distillation data: GROUPS groups of prompts, each of the window plus `prompt_over` random
tokens (one length per group), with the target's greedy continuations of NEW_TOKENS tokens.
Fresh prompts matter: on 300 sequences a draft learns them by heart instead of the target's
rule."""


def prompt_over(window: int) -> tuple[int, int]:
    """The range of a distillation prompt's tokens past the window: 8 to the language's lag (at
    least 64). A continuation token copies the one a lag back, and the target's hidden state
    there has two regimes: before position lag (nothing to copy yet) and after. A drafter that
    reads those rows has to have seen both. Distilled on prompts of at most window + 64 tokens,
    a DFlash drafter at GPT-OSS's window (128, lag 136) fell from 0.9 to 0.0 top-1 on prompts
    past 200 tokens, half of run=generate's, and accepted 1.35 of 8; on prompts up to the lag
    past the window, 8.00 (`model=tiny` at that window on the CPU). `language.longest_prompt`
    is that bound (the target's heads reach it too under `language.WIDE_HEADS`)."""
    return 8, longest_prompt(window) - window


def data_key(window: int) -> dict:
    """The distillation data's description, for a draft's cache key."""
    return {"groups": GROUPS, "prompts_per_group": PROMPTS_PER_GROUP, "new_tokens": NEW_TOKENS,
            "prompt_over": list(prompt_over(window))}


def weights_key(model) -> str:
    """A digest of ``model``'s weights: what a distilled draft learnt from."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def make_draft(target, sources: Sequence[int], types: Sequence[str], window: int | None,
               weights: str, seed: int) -> torch.nn.Module:
    """The draft (fp32, eager): target layers ``sources`` as ``types`` (`draft_from_layers`), or
    for ``weights="random"`` the same architecture freshly initialised under ``seed``."""
    draft = draft_from_layers(target, sources, types, window).float()
    if weights == "random":
        tf = require_transformers()
        torch.manual_seed(seed)
        fresh = tf.AutoModelForCausalLM.from_config(draft.config, attn_implementation="eager",
                                                    dtype=torch.float32)
        draft.load_state_dict(fresh.state_dict())
    return draft


def load_draft(path: str, device: str) -> torch.nn.Module:
    """A saved draft (``save_pretrained`` directory), fp32, eager; ConfigError when unreadable."""
    tf = require_transformers()
    try:
        return tf.AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=torch.float32,
            attn_implementation="eager").to(device).eval()
    except (OSError, ValueError) as exc:
        raise ConfigError([Reason("spec", "spec.draft_weights", f"cannot load a draft from "
                                  f"{path!r}: {exc}", "spec.draft_weights=<a directory written "
                                  "by a distilled run or save_pretrained>", rule="draft weights")]
                          ) from None


def check_draft(draft, target, want_types: Sequence[str], pool_geo, path: str) -> None:
    """Refuse a loaded draft that the draft pool cannot serve with this target, every reason at
    once: another architecture or vocabulary, a layer whose KV geometry is not the pool's
    (``pool_geo``: a `Geometry`), or layer types the pool's layout does not have."""
    reasons = []

    def no(msg: str, fix: str) -> None:
        reasons.append(Reason("spec", "spec.draft_weights", f"{path}: {msg}", fix,
                              rule="draft weights"))

    dt, tt = draft.config.model_type, target.config.model_type
    if dt != tt:
        no(f"the draft is a {dt} model, the target a {tt}", f"save a {tt} draft")
    if draft.config.vocab_size != target.config.vocab_size:
        no(f"vocabulary {draft.config.vocab_size}, the target's {target.config.vocab_size}",
           f"a draft with vocab_size={target.config.vocab_size}")
    for i, attn in enumerate(attention_modules(draft)):
        heads = attn.k_proj.out_features // attn.head_dim
        if (heads, attn.head_dim) != (pool_geo.num_kv_heads, pool_geo.head_dim):
            no(f"layer {i} has {heads} KV heads of dim {attn.head_dim}; the draft pool holds "
               f"{pool_geo.num_kv_heads} of dim {pool_geo.head_dim}",
               "a draft with the target's full-attention KV geometry")
    types = list(getattr(draft.config, "layer_types", None) or [])
    if types and types != list(want_types):
        no(f"layer types {types}; the draft pool's layout is {list(want_types)}",
           "full-attention layers (or, with draft_pool_split, the target's last layer types)")
    if reasons:
        raise ConfigError(reasons, headline="swafactory cannot serve this draft:")


def _masks(types: set[str], T: int, block: tuple[int, int] | None, window: int | None,
           B: int, device) -> dict[str, torch.Tensor]:
    """[B, 1, T, T] fp32 masks by layer type: causal, the ``block`` rows [lo, hi) also seeing
    each other; a sliding type also keeps only keys within ``window`` (current token included)."""
    q = torch.arange(T, device=device)[:, None]
    k = torch.arange(T, device=device)[None, :]
    ok = k <= q
    if block is not None:
        lo, hi = block
        ok = ok | ((q >= lo) & (q < hi) & (k >= lo) & (k < hi))
    out = {}
    for t in types:
        allowed = ok & (q - k < window) if t == "sliding_attention" and window else ok
        m = torch.zeros(T, T, device=device).masked_fill(~allowed, torch.finfo(torch.float32).min)
        out[t] = m.expand(B, 1, T, T)
    return out


_DATA: dict[tuple, tuple[list[torch.Tensor], torch.Tensor]] = {}
"""`_data`'s last results in this process, by the target's weights, window, seed and device:
a process that distils several drafts of one target (a sweep, the test suite) makes the
continuations once (9 s of each 37 s DFlash distillation at the tiny geometry on the CPU)."""


def _data(target, vocab: int, window: int, seed: int, device, target_key: str | None = None
          ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Training groups ([PROMPTS_PER_GROUP, P + NEW_TOKENS] each, one per prompt length) and a
    held-out group: random prompts (ids ≥ 1) and the target's greedy continuations. Callers
    read them (a batch clones what it changes). target_key: `weights_key(target)`, if known."""
    key = (target_key or weights_key(target), vocab, window, seed, str(device))
    got = _DATA.get(key)
    if got is not None:
        return got
    gen = torch.Generator().manual_seed(seed)
    lo, hi = prompt_over(window)
    groups = []
    for _ in range(GROUPS + 1):
        over = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        prompts = torch.randint(1, vocab, (PROMPTS_PER_GROUP, window + over), generator=gen)
        groups.append(greedy(target, prompts.to(device), NEW_TOKENS))
    if len(_DATA) >= 2:  # a sweep's other targets: keep the newest two
        _DATA.pop(next(iter(_DATA)))
    got = _DATA[key] = (groups[:-1], groups[-1][:32])
    return got


class PromptLosses:
    """A training loss that keeps each prompt length's losses: ``group`` is set by the batch
    function to the batch's group before the loss is taken."""

    LAST = 2
    """Steps of each length that its figure averages: where training left it (16 groups in
    turn, so the last 32 steps; a longer mean reaches back to chance after an early stop)."""

    def __init__(self, loss, groups: Sequence[torch.Tensor]) -> None:
        self.loss, self.group, self.seen = loss, 0, {}
        self.lengths = [g.shape[1] - NEW_TOKENS for g in groups]

    def __call__(self, model, b):
        value = self.loss(model, b)
        self.seen.setdefault(self.group, []).append(value.detach())  # read once, at the end
        return value

    def below(self, bound: float | None) -> Callable[[], bool] | None:
        """A `train` stop condition: every group's last `LAST` losses are below ``bound`` (a mean
        loss under the recipe's stop_loss can hide a prompt length still near chance); None:
        none."""
        if bound is None:
            return None

        def ready() -> bool:
            return len(self.seen) == len(self.lengths) and all(
                len(v) >= self.LAST and max(float(x) for x in v[-self.LAST:]) < bound
                for v in self.seen.values())
        return ready

    def summary(self) -> dict[int, float]:
        """{prompt length: mean loss of its groups' last `LAST` steps each}."""
        by_length: dict[int, list[torch.Tensor]] = {}
        for g, vals in sorted(self.seen.items()):
            by_length.setdefault(self.lengths[g], []).extend(vals[-self.LAST:])
        out = {}
        for length, vals in sorted(by_length.items()):
            last = torch.stack(vals).float()
            out[length] = round(float(last[torch.isfinite(last)].mean()), 4)
        return out

    def say(self, label: str, progress: TextIO | None) -> dict[int, float]:
        got = self.summary()
        if progress is not None and got:
            worst = max(got, key=got.get)
            print(f"  {label}: loss by prompt length from {min(got)} to {max(got)} tokens: "
                  f"{min(got.values()):.3f} to {got[worst]:.3f} (at {worst})",
                  file=progress, flush=True)
        return got


def target_follows(groups: Sequence[torch.Tensor], window: int,
                   progress: TextIO | None = None) -> float:
    """The lowest share, over the groups (each [N, P + NEW_TOKENS] int64), of the target's
    continuation tokens that repeat the one a lag back; printed with its prompt length."""
    shares = {g.shape[1] - NEW_TOKENS: lag_copy_agreement(g, g.shape[1] - NEW_TOKENS,
                                                         lag_for(window)) for g in groups}
    low = min(shares, key=shares.get)
    if progress is not None:
        print(f"  the target's continuations follow the lag-{lag_for(window)} rule at "
              f"{shares[low]:.3f} of positions or more (lowest at prompt length {low})",
              file=progress, flush=True)
    return shares[low]


def distill(target, draft, *, family: str, block: int, window: int, seed: int, fields: dict,
            progress: TextIO | None = None) -> Trained:
    """Train ``draft`` (fp32, in place) on ``target``'s greedy continuations, or load the cached
    result for ``fields`` (the key: the target's weights, the draft's config, family, seed)."""
    fields = {**fields, "recipe": asdict(DISTILL), "prompts": data_key(window),
              "tokens_per_batch": TOKENS_PER_BATCH.get(next(draft.parameters()).device.type)}
    path = cache_dir("drafts", fields)
    hit = load_cached(path, fields)
    if hit is not None:
        say_cached(progress, f"draft {family}", path, hit)
        load_weights(draft, path)
        return Trained(**{**hit, "what": f"draft {family}", "seconds": 0.0, "cached": True,
                          "path": str(path)})
    vocab, device = target.config.vocab_size, next(draft.parameters()).device
    t0, c0 = time.perf_counter(), time.process_time()
    if progress is not None:
        print(f"distilling the {family} draft ({DISTILL.steps} steps): the target's greedy "
              "continuations of random prompts", file=progress, flush=True)
    say_training(progress, "drafts", f"draft {family}", path, fields, DISTILL)
    groups, held = _data(target, vocab, window, seed, device, fields.get("target"))
    follows = target_follows(groups, window, progress)
    types = set(getattr(draft.config, "layer_types", None) or ["full_attention"])
    gen = torch.Generator().manual_seed(seed)

    def make(seqs: torch.Tensor, start: int, at: int | None) -> Batch:
        if family != "dflash":
            labels = seqs[:, 1:].clone()
            labels[:, :start - 1] = -100  # the random prompt cannot be predicted
            return Batch(seqs[:, :-1], labels)
        L = at if at is not None else int(torch.randint(start, seqs.shape[1] - block + 1, (1,),
                                                         generator=gen))
        ids = seqs[:, :L + block].clone()
        ids[:, L + 1:] = MASK_TOKEN
        labels = torch.full_like(ids, -100)
        labels[:, L:L + block - 1] = seqs[:, L + 1:L + block]
        return Batch(ids, labels, _masks(types, L + block, (L, L + block), window,
                                         ids.shape[0], device))

    losses = PromptLosses(lm_loss, groups)

    def batch(step: int) -> Batch:
        losses.group = step % len(groups)
        seqs = groups[losses.group]
        n = batch_size(DISTILL, seqs.shape[1], device)
        rows = torch.randint(0, seqs.shape[0], (n,), generator=gen).to(device)
        return make(seqs[rows], seqs.shape[1] - NEW_TOKENS, None)

    _, loss, steps = train(draft, batch, DISTILL, label=f"{family} draft", progress=progress,
                           loss=losses, ready=losses.below(DISTILL.stop_each))
    start = held.shape[1] - NEW_TOKENS
    with torch.no_grad():
        b = make(held, start, start + (NEW_TOKENS - block) // 2)
        out = draft(input_ids=b.ids, attention_mask=b.masks, use_cache=False).logits
    keep = b.labels != -100
    agree = float((out.argmax(-1)[keep] == b.labels[keep]).float().mean())
    seconds = time.perf_counter() - t0  # the continuations, the training and the held-out test
    trained = Trained(f"draft {family}", steps, seconds, seconds, loss, agree, False,
                      str(path), asdict(DISTILL), cpu_s=time.process_time() - c0,
                      loss_by_prompt=losses.say(f"{family} draft", progress),
                      target_follows=follows)
    save_cached(draft, path, fields, trained)
    return trained

