"""docs/support_matrix.md is generated from the registry; this fails when it is stale."""
from __future__ import annotations

from pathlib import Path

from swafactory.registry.matrix import MATRIX_PATH, render_support_matrix

REPO = Path(__file__).resolve().parents[1]


def test_support_matrix_is_current() -> None:
    on_disk = (REPO / MATRIX_PATH).read_text()
    assert on_disk == render_support_matrix() + "\n", (
        "docs/support_matrix.md is stale: run `python tools/gen_support_matrix.py` and commit it")


def test_matrix_shows_refusals_and_passes() -> None:
    text = render_support_matrix()
    assert "❌ adapter" in text and "❌ head_dims" in text and "❌ device" in text and "✅ → torch" in text
