"""``Recipe.autocast="bf16"`` runs a training's forward under bf16 autocast while its weights stay
fp32 and it still learns; the default runs it in fp32 (the recipes that serve the records)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from swafactory.drafts.train import Batch, Recipe, train


class Affine(torch.nn.Module):
    """A linear map fitted to y = 2x + 1; records the dtype its forward computed in."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.seen: set[torch.dtype] = set()
        self.config = SimpleNamespace(_attn_implementation="eager")  # as an HF model has

    def set_attn_implementation(self, name: str) -> None:
        self.config._attn_implementation = name


X = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))


def _loss(model: Affine, batch: Batch) -> torch.Tensor:
    y = model.lin(X)
    model.seen.add(y.dtype)
    return ((y.float() - (2 * X + 1)) ** 2).mean()


def _batches(step: int) -> Batch:
    return Batch(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long))


@pytest.mark.parametrize("autocast, computed", [(None, torch.float32), ("bf16", torch.bfloat16)])
def test_autocast_changes_the_forward_not_the_weights(autocast, computed) -> None:
    torch.manual_seed(0)
    model = Affine()
    first = float(_loss(model, _batches(0)).detach())
    model.seen.clear()
    _, final, _ = train(model, _batches, Recipe(steps=200, lr=0.05, batch=1, autocast=autocast),
                        label="affine", loss=_loss)
    assert model.seen == {computed}
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert final < 0.05 * first, (first, final)
