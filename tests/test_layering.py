"""Imports point down: storage never imports kernels or the harness, and the sharding, the spec
table and the kernels never import the drivers that use them. Every import counts, those inside
functions too (a lazy import is still an arrow)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "swafactory"
DRIVERS = {"harness", "engine", "cli", "__main__"}
FORBIDDEN = {
    "kvcache": DRIVERS | {"kernels", "backend", "integrations", "metadata", "graphs"},
    "metadata": DRIVERS | {"kernels", "backend", "integrations"},
    "kernels": DRIVERS | {"backend", "integrations", "kvcache"},
    "parallel": DRIVERS | {"kernels", "backend"},
    "speculative": DRIVERS | {"kernels", "backend", "integrations"},
    "integrations": DRIVERS | {"kernels", "kvcache"},
}


def _imports(path: Path) -> set[str]:
    """The swafactory sub-packages (or top modules) ``path`` imports, anywhere in the file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module and
                 node.level == 0 else
                 [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        out |= {n.split(".")[1] for n in names if n.startswith("swafactory.")}
    return out


def _modules(part: str) -> list[Path]:
    p = ROOT / part
    return sorted(p.rglob("*.py")) if p.is_dir() else [p.with_suffix(".py")]


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_imports_point_down(part: str) -> None:
    bad = {f"{m.relative_to(ROOT.parent)} imports swafactory.{x}"
           for m in _modules(part) for x in _imports(m) & FORBIDDEN[part]}
    assert not bad, sorted(bad)


def test_the_rule_sees_a_lazy_import(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from swafactory.kernels.triton import x\n")
    assert _imports(f) == {"kernels"}
