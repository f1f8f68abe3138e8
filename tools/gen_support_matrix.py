"""Regenerate docs/support_matrix.md from the registry: `python tools/gen_support_matrix.py`."""
from pathlib import Path

from swafactory.registry.matrix import MATRIX_PATH, render_support_matrix

if __name__ == "__main__":
    path = Path(__file__).resolve().parents[1] / MATRIX_PATH
    path.write_text(render_support_matrix() + "\n")
    print(f"wrote {path}")
