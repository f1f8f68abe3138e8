"""No import cycle among swafactory's modules: every import counts, those inside functions too
(a lazy import that breaks a cycle at load time still ties the two modules together)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "swafactory"


def module_graph(pkg: Path, prefix: str) -> dict[str, set[str]]:
    """Module name → the package's modules it imports (``from a.b import c`` counts ``a.b.c``
    when that is a module, else ``a.b``)."""
    files = {".".join(f.relative_to(pkg.parent).with_suffix("").parts).removesuffix(".__init__"): f
             for f in pkg.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, f in files.items():
        out = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    out.add(sub if sub in files else node.module)
            elif isinstance(node, ast.Import):
                out |= {a.name for a in node.names}
        graph[name] = {m for m in out if m in files and m != name and m.startswith(prefix)}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_in_swafactory() -> None:
    # a package's __init__ re-exporting its modules is not a cycle of ideas: leave it out
    graph = {k: {m for m in v if not PKG.joinpath(*m.split(".")[1:], "__init__.py").exists()}
             for k, v in module_graph(PKG, "swafactory").items()}
    assert cycles(graph) == []


def test_the_check_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
