"""A training that diverges goes back to its last good weights with half the learning rate, and
fails by name when it keeps diverging: a NaN never reaches the cache (an EAGLE head on GPT-OSS's
geometry went from loss 0.8 to NaN at AdamW 1e-2 on an H100)."""
from __future__ import annotations

import io
import math
from types import SimpleNamespace

import pytest
import torch

from swafactory.drafts.train import ROLLBACKS, Batch, Recipe, train


class Line(torch.nn.Module):
    """y = w · x: the loss is (w - 3)²; ``poison`` steps return a spike or NaN instead."""

    def __init__(self, poison: dict[int, float]) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.poison, self.step = poison, 0
        self.config = SimpleNamespace(_attn_implementation="eager")  # as an HF model has

    def set_attn_implementation(self, name: str) -> None:
        self.config._attn_implementation = name


def _loss(model: Line, batch: Batch) -> torch.Tensor:
    loss = (model.w - 3.0) ** 2
    bad = model.poison.get(model.step)
    model.step += 1
    return loss * 0 + bad if bad is not None else loss


def _batches(step: int) -> Batch:
    return Batch(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long))


def test_a_spike_and_a_nan_go_back_to_good_weights() -> None:
    model, out = Line({60: 1e4, 90: math.nan}), io.StringIO()
    _, final, steps = train(model, _batches, Recipe(steps=300, lr=0.05, batch=1), label="line",
                            progress=out, loss=_loss)
    assert out.getvalue().count("back to the last good weights") == 2, out.getvalue()
    assert "learning rate 0.025" in out.getvalue() and "learning rate 0.013" in out.getvalue()
    w = float(model.w.detach())
    assert math.isfinite(w) and abs(w - 3.0) < 0.1, w
    assert steps == 300 and final < 0.01


def test_a_training_that_keeps_diverging_fails_by_name() -> None:
    model = Line({i: math.nan for i in range(30, 300)})
    with pytest.raises(RuntimeError, match=rf"line: training diverged {ROLLBACKS + 1} times"):
        train(model, _batches, Recipe(steps=300, lr=0.05, batch=1), label="line", loss=_loss)
    assert math.isfinite(float(model.w.detach()))
