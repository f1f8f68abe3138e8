"""Imports point down: storage never imports kernels or the harness, and the sharding, the spec
table, the serving core and the kernels never import the drivers that use them. Every import counts, those inside
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
    # the serving core and its parts: the payloads (harness, engine) plug in, never imported
    "scheduler": DRIVERS | {"kernels", "integrations"},
    "serving": DRIVERS | {"kernels", "integrations"},
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


BENCH = ROOT.parent / "bench"


def bench_graph(dirs: list[Path]) -> dict[str, set[str]]:
    """Module → the modules of ``dirs`` it imports, anywhere in the file (the benches run as
    scripts, so ``bench/`` and ``bench/probes/`` are import roots: a module is its file's stem)."""
    files = {f.stem: f for d in dirs for f in sorted(d.glob("*.py"))}
    graph = {}
    for name, f in files.items():
        out = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                out.add(node.module.split(".")[0])
            elif isinstance(node, ast.Import):
                out |= {a.name.split(".")[0] for a in node.names}
        graph[name] = {m for m in out if m in files and m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` as [a, b, ..., a], or [] when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (c := visit(n)):
                return c
        state[m] = 2
        path.pop()
        return []

    for m in sorted(graph):
        if m not in state and (c := visit(m)):
            return c
    return []


def test_bench_modules_have_no_import_cycle() -> None:
    """The benches share their set-up through bench/common.py and never import each other in a
    circle (bench_factory, bench_fp8 and bench_pages once did)."""
    graph = bench_graph([BENCH, BENCH / "probes"])
    assert {"common", "bench_factory", "bench_fp8", "bench_pages"} <= set(graph)
    assert find_cycle(graph) == [], " -> ".join(find_cycle(graph))


def test_the_bench_rule_sees_a_cycle(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from c import x\n")
    (tmp_path / "c.py").write_text("import a.sub\n")
    assert find_cycle(bench_graph([tmp_path])) == ["a", "b", "c", "a"]
    (tmp_path / "c.py").write_text("import os\n")
    assert find_cycle(bench_graph([tmp_path])) == []
