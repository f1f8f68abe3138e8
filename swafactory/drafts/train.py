"""Training the generator's models with their own HF model code: a recipe, one loop with
progress lines, and an on-disk cache keyed by everything the weights depend on.

Used twice: a ``run.target_weights=pretrained`` target learns the built-in language
(`drafts.language`), and a ``spec.draft_weights=distilled`` draft learns the target's greedy
continuations (`drafts.distill`). Both train in fp32 with eager attention (swafactory's backend
serves; it does not train), then are cast to the run's dtype.

The cache is ``$SWAFACTORY_CACHE_DIR`` (default ``~/.cache/swafactory``) / ``<kind>/<key>``: a
directory written by ``save_pretrained`` (so ``spec.draft_weights=<that directory>`` loads a
cached draft) plus ``swafactory.json`` with the key's fields and the training record.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

import torch

from swafactory.engine.runner import attn_implementation

__all__ = ["Recipe", "Batch", "Trained", "TOKENS_PER_BATCH", "batch_size", "lm_loss",
           "cache_root", "cache_dir", "load_cached", "save_cached", "load_weights", "train",
           "REFERENCE_CPU_S", "estimate", "say_cached", "say_training"]


@dataclass(frozen=True)
class Recipe:
    """How a model is trained: AdamW at ``lr`` (linear decay to a tenth over the last half),
    gradients clipped to norm 1, ``steps`` batches of ``batch`` sequences; with ``stop_loss``,
    it stops early once the mean loss of the last 10 steps is below it. ``autocast="bf16"``
    runs the forward under bf16 autocast (weights, gradients and optimizer state stay fp32): a
    probe's option for long sequences, where fp32 attention is the cost."""

    steps: int
    lr: float
    batch: int
    stop_loss: float | None = None
    autocast: str | None = None
    stop_each: float | None = None
    """With ``stop_loss``: a draft also needs each prompt length's last losses below this
    (`distill.PromptLosses.below`)."""


@dataclass(frozen=True)
class Batch:
    """One training batch. ids, labels: [B, T] int64 (label -100: no loss there). masks:
    attention masks by layer type, each [B, 1, T, T] fp32 (0 attends, -inf does not); None:
    the model's own causal masks."""

    ids: torch.Tensor
    labels: torch.Tensor
    masks: dict[str, torch.Tensor] | None = None
    features: torch.Tensor | None = None
    """[B, T, F] fp32: the target's hidden states at each position (a feature draft's)."""


@dataclass(frozen=True)
class Trained:
    """What report.json says about a trained model."""

    what: str
    """``target`` or ``draft <family>``."""
    steps: int
    seconds: float
    """Training time (0 when loaded from the cache; ``trained_s`` keeps the first run's)."""
    trained_s: float
    final_loss: float
    heldout_top1: float | None
    """Top-1 agreement on held-out data: with the target (a draft), the language (a target)."""
    cached: bool
    path: str
    recipe: dict
    cpu_s: float | None = None
    """The process's CPU seconds over ``trained_s`` (on a CPU: the work itself, which other
    processes beside it do not stretch; a GPU's time is not in it)."""
    loss_by_prompt: dict | None = None
    """A draft's: each distillation prompt length's mean loss over its last steps; a length the
    draft cannot learn stays near chance (ln vocab)."""
    target_follows: float | None = None
    """A draft's: the lowest share, over the prompt lengths, of the target's continuation tokens
    that repeat the one a lag back (the language's rule; a draft learns what the target does)."""

    def as_dict(self) -> dict:
        return asdict(self)


def cache_root() -> Path:
    """Where trained models are kept (``$SWAFACTORY_CACHE_DIR`` or ``~/.cache/swafactory``)."""
    return Path(os.environ.get("SWAFACTORY_CACHE_DIR", Path.home() / ".cache" / "swafactory"))


def cache_dir(kind: str, fields: dict) -> Path:
    """The cache directory of ``kind`` (``targets`` or ``drafts``) for these key fields."""
    text = json.dumps(fields, sort_keys=True, default=str)
    return cache_root() / kind / hashlib.sha256(text.encode()).hexdigest()[:16]


def load_cached(path: Path, fields: dict) -> dict | None:
    """The training record cached at ``path`` for exactly these fields, or None."""
    try:
        meta = json.loads((path / "swafactory.json").read_text())
    except (OSError, ValueError):
        return None  # not trained yet, or a damaged entry: train again
    same = json.loads(json.dumps(fields, sort_keys=True, default=str))
    if meta.get("fields") != same or not (path / "model.safetensors").exists():
        return None
    return meta["trained"]


def save_cached(model, path: Path, fields: dict, trained: Trained,
                save: Callable[[Path], None] | None = None) -> None:
    """Write ``model`` (``save_pretrained``, or ``save(directory)``) and its record to ``path``:
    into a fresh directory beside it, renamed into place, so a reader (another test worker,
    another run) never sees a half-written entry. When ``path`` appeared meanwhile, the first
    writer's entry stays."""
    import shutil
    import tempfile

    from transformers.utils import logging as tf_logging

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
    tf_logging.disable_progress_bar()  # the run prints its own progress
    try:
        if save is None:
            model.save_pretrained(tmp)
        else:
            save(tmp)
    finally:
        tf_logging.enable_progress_bar()
    meta = {"fields": json.loads(json.dumps(fields, sort_keys=True, default=str)),
            "trained": trained.as_dict()}
    (tmp / "swafactory.json").write_text(json.dumps(meta, indent=1))
    try:
        tmp.rename(path)
    except OSError:  # already there (a concurrent writer, or a damaged entry): keep it
        if load_cached(path, fields) is None:
            shutil.rmtree(path, ignore_errors=True)
            tmp.rename(path)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


SHAPE = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
         "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "sliding_window")
"""The config fields that set a training step's cost: a cached model with the same ones, on the
same device kind, is "similar" (`estimate`)."""

REFERENCE_CPU_S = {"target": (42.1, 149), "draft eagle": (39.5, 200), "draft eagle3": (29.8, 200),
                   "draft nextn": (23.8, 200), "draft standalone": (32.2, 200),
                   "draft dflash": (63.5, 240)}
"""Seconds and steps each `model=tiny` training took on the 2-core CPU machine (the cache's
records of the test runs; the target stopped early once its loss converged): the estimate when
the cache holds nothing similar."""


def _shape(fields: dict) -> dict:
    configs = [v for k in ("config", "draft") if isinstance(v := fields.get(k), dict)]
    return {k: c[k] for c in configs for k in SHAPE if k in c}


def estimate(kind: str, what: str, fields: dict, recipe: Recipe) -> tuple[float, str] | None:
    """(seconds, where the figure comes from) for training ``what`` (``target``, ``draft
    <family>``) under ``recipe``: a similar cached model's seconds per step (`SHAPE`, the same
    device), else `REFERENCE_CPU_S` on a CPU; None when neither applies. With ``stop_loss``, the
    steps the earlier training ran (it stops once converged), else the recipe's."""
    want, device = _shape(fields), fields.get("device")
    for meta_file in sorted((cache_root() / kind).glob("*/swafactory.json")):
        try:
            meta = json.loads(meta_file.read_text())
            t, f = meta["trained"], meta["fields"]
            if (t["what"], f.get("device"), _shape(f)) != (what, device, want) or not t["steps"]:
                continue
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a damaged or older entry tells nothing
        steps = min(t["steps"], recipe.steps) if recipe.stop_loss else recipe.steps
        return (t["trained_s"] / t["steps"] * steps, f"as a similar cached {what} took "
                f"{t['trained_s']:.0f} s for {t['steps']} steps ({meta_file.parent})")
    ref = REFERENCE_CPU_S.get(what)
    if ref is None or not str(device).startswith("cpu"):
        return None
    secs, ref_steps = ref
    steps = min(ref_steps, recipe.steps) if recipe.stop_loss else recipe.steps
    return (secs / ref_steps * steps, f"if it is as small as model=tiny's, whose {what} took "
            f"{secs:.0f} s for {ref_steps} steps on a 2-core CPU (more for a larger model)")


def say_cached(progress: TextIO | None, what: str, path: Path, hit: dict) -> None:
    """Tell ``progress`` that ``what`` comes from the cache at ``path``, not from training."""
    if progress is not None:
        print(f"{what}: reusing the cached weights at {path} (trained once in "
              f"{hit['trained_s']:.0f} s, {hit['steps']} steps)", file=progress, flush=True)


def say_training(progress: TextIO | None, kind: str, what: str, path: Path, fields: dict,
                 recipe: Recipe) -> None:
    """Tell ``progress``, before training, how long it should take and where it is cached."""
    if progress is None:
        return
    est, device = estimate(kind, what, fields, recipe), fields.get("device", "this device")
    when = f"about {est[0]:.0f} s on {device}, {est[1]}" if est else \
        f"no estimate on {device} (the cache holds no similar model)"
    most = f"at most {recipe.steps} steps" + (", fewer once the loss converges"
                                               if recipe.stop_loss else "")
    print(f"  {what}: not in the cache; {when}; {most}; caching it at {path} (a second run "
          "reuses it)", file=progress, flush=True)


def load_weights(model, path: Path) -> None:
    """Load the safetensors weights saved at ``path`` into ``model`` (same architecture)."""
    from safetensors.torch import load_file

    state = load_file(str(path / "model.safetensors"), device=str(next(model.parameters()).device))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight")}  # tied heads are not saved
    if set(missing) - tied or unexpected:
        raise ValueError(f"{path}: weights do not match the model (missing {sorted(missing)[:4]}, "
                         f"unexpected {sorted(unexpected)[:4]})")


TOKENS_PER_BATCH = {"cpu": 4096, "cuda": 32768}
"""At most this many tokens in one batch on each device kind: a long lag (Gemma 4's window is
512) makes long sequences, and the recipe's batch of them would not fit."""


def batch_size(recipe: Recipe, seq_len: int, device: torch.device | str) -> int:
    """The recipe's batch, cut to `TOKENS_PER_BATCH` tokens of ``seq_len`` on ``device``."""
    kind = torch.device(device).type
    return max(1, min(recipe.batch, TOKENS_PER_BATCH.get(kind, 4096) // seq_len))


def lm_loss(model, b: Batch) -> torch.Tensor:
    """A causal LM's cross-entropy on ``b``'s labels (the default training loss)."""
    out = model(input_ids=b.ids, attention_mask=b.masks, use_cache=False)
    logits = out.logits.float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             b.labels.reshape(-1), ignore_index=-100)


def _snapshot(model) -> dict:
    """A copy of ``model``'s weights (small: run=generate's models are a few MB)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(model, batches: Callable[[int], Batch], recipe: Recipe, *, label: str,
          progress: TextIO | None = None,
          loss: Callable[[object, Batch], torch.Tensor] | None = None,
          ready: Callable[[], bool] | None = None) -> tuple[float, float, int]:
    """Train ``model`` (fp32, in place) on ``batches(step)``; returns (seconds, final loss: the
    mean of the last tenth of the steps run, steps run). Prints ``label`` with the step, loss and
    time ten times to ``progress``. loss: (model, batch) → scalar (default: a causal LM's
    cross-entropy on the labels). ready: with ``recipe.stop_loss``, a further condition for the
    early stop (a draft's: every prompt length learnt, not only the mean)."""
    # the same model code that serves, with transformers' SDPA attention where the model has it
    # (eager keeps every score: O(T^2) memory per head); eager otherwise (GPT-OSS's sinks)
    with attn_implementation(model, "sdpa" if getattr(model, "_supports_sdpa", False)
                             else "eager"):
        return _train(model, batches, recipe, label, progress, loss or lm_loss, ready)


ROLLBACKS = 3
"""A training that diverges (a non-finite loss, or one past 10× the recent mean + 1) goes back to its last
good weights with half the learning rate, at most this many times, then fails: AdamW at 1e-2
took an EAGLE head on GPT-OSS's geometry from loss 0.8 to NaN within 75 steps on an H100."""


def _train(model, batches, recipe: Recipe, label: str, progress, loss_fn, ready=None
           ) -> tuple[float, float, int]:
    model.train()
    lr = recipe.lr
    half = recipe.steps // 2

    def optimizer(lr: float, start: int):  # the schedule goes on from step ``start``
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 if i + start < half else
                                                      max(0.1, 1.0 - 0.9 * (i + start - half)
                                                          / max(1, half)))

    opt, sched = optimizer(lr, 0)
    t0, losses = time.perf_counter(), []
    every = max(1, min(recipe.steps // 10, 25))
    good = _snapshot(model)
    rollbacks = step = 0
    device_type = next(model.parameters()).device.type
    for step in range(recipe.steps):
        with torch.autocast(device_type, dtype=torch.bfloat16,
                            enabled=recipe.autocast == "bf16"):
            loss = loss_fn(model, batches(step))
        value = float(loss.detach())
        recent = losses[-25:]
        if not math.isfinite(value) or (len(recent) == 25 and value > 10 * sum(recent) / 25 + 1):
            if rollbacks == ROLLBACKS:
                raise RuntimeError(f"{label}: training diverged {ROLLBACKS + 1} times (loss "
                                   f"{value:.3g} at step {step + 1}, learning rate {lr:.2g}): "
                                   "lower the recipe's learning rate")
            rollbacks, lr = rollbacks + 1, lr / 2
            model.load_state_dict(good)
            opt, sched = optimizer(lr, step)
            if progress is not None:
                print(f"  {label}: loss {value:.3g} at step {step + 1}: back to the last good "
                      f"weights, learning rate {lr:.2g}", file=progress, flush=True)
            continue
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(value)
        if step % 25 == 24:  # good weights to return to (the recent losses were all in line)
            good = _snapshot(model)
        done = recipe.stop_loss is not None and step >= 20 and \
            sum(losses[-10:]) / 10 < recipe.stop_loss and (ready is None or ready())
        if progress is not None and (step % every == 0 or step == recipe.steps - 1 or done):
            print(f"  {label}: step {step + 1}/{recipe.steps}, loss {value:.3f}, "
                  f"{time.perf_counter() - t0:.1f} s" + (" (converged)" if done else ""),
                  file=progress, flush=True)
        if done:
            break
    model.eval()
    tail = losses[-max(1, len(losses) // 10):] or [math.nan]
    return time.perf_counter() - t0, sum(tail) / len(tail), step + 1
