"""Imports point down: every module of ``swafactory/`` gets a layer, and no import (one inside a
function included: a lazy import is still an arrow) reaches a higher layer than its importer's.

The order is read from the code and DESIGN.md's data flow, lowest first. Where it differs from
the first sketch (config → kvcache → metadata/registry/resolve → kernels → backend → graphs →
serving → payloads → cli/outputs): the graph buffers sit *below* the backend (the backend owns a
`GraphState` and checks a `GraphContract`), and the output writers (report files, progress lines,
the inert verdict) are leaves the payloads import, so they sit below the payloads.

A module's layer: its exact dotted name if listed, else its file name if that is listed in
`BY_NAME` (modules moving between rooms keep their idea's layer wherever they land), else the
longest listed package prefix. Imports of a package's ``__init__`` from its own modules, and
its re-exports of them, are the package's own business and not checked.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "swafactory"

# Lowest first; a module may import its own layer and those listed before it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("errors", "guards")),                    # exceptions, invariant checks: leaves
    ("config", ("config", "parallel")),                # the schema and the sharding it implies
    ("kvcache", ("kvcache",)),                          # storage: pools, allocator, slots
    ("planning", ("metadata", "registry", "resolve")),  # plans, capability checks, KV source
    ("kernels", ("kernels",)),                          # adapters: read plans, never build them
    ("graphs", ("graphs",)),                            # CUDA-graph buffers, sizing, replay
    ("layout", ()),                                     # the plan summary (`BY_NAME`)
    ("backend", ("backend",)),                          # one AttentionBackend from the parts
    ("serving", ("serving",)),                          # the serving core: scheduler, spec step
    ("outputs", ("outputs",)),                          # what a run writes (`BY_NAME`)
    ("payloads", ("harness", "engine", "drafts", "models")),  # the oracle job, the generator
    ("front", ("swafactory", "api", "cli")),            # the public facade and the CLI
    ("main", ("__main__",)),                            # the only place mapping exit codes
]

# Modules by file name wherever they live (each name is unique under swafactory/): leaves that
# lower layers use, and modules whose room is not their layer.
BY_NAME: dict[str, str] = {
    "errors": "base", "guards": "base", "fault_counts": "base", "window": "base",
    "triton_launch": "base",  # the Triton launcher the metadata's key kernel uses too
    "layout": "layout", "runner_windows": "layout",
    "scheduler": "serving", "speculative": "serving",
    "inert": "outputs", "progress_lines": "outputs", "report_files": "outputs",
    "job_log": "outputs",
}

# Layers an importer's layer may not reach even though they are below it: the adapters read
# plans and buffers, never the pools' logic; the serving core reaches kernels through the backend.
NEVER: dict[str, set[str]] = {"kernels": {"kvcache"}, "serving": {"kernels"}}

# (importer, imported) arrows that point up on purpose, each with its reason. Keep it tiny.
ALLOWED: dict[tuple[str, str], str] = {}

RANK = {name: i for i, (name, _) in enumerate(LAYERS)}
_BY_PREFIX = {("swafactory" if p == "swafactory" else f"swafactory.{p}"): name
              for name, prefixes in LAYERS for p in prefixes}


def layer_of(module: str) -> str:
    """The layer of a dotted module name under swafactory (see the module docstring)."""
    if module in _BY_PREFIX:
        return _BY_PREFIX[module]
    last = module.rsplit(".", 1)[-1]
    if last in BY_NAME:
        return BY_NAME[last]
    parts = module.split(".")
    for n in range(len(parts) - 1, 1, -1):  # a root module is listed itself, never "swafactory"
        if (p := ".".join(parts[:n])) in _BY_PREFIX:
            return _BY_PREFIX[p]
    raise KeyError(f"{module} has no layer: add its package or file name to tests/test_layering.py")


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name → file, for every module of the package at ``root``."""
    return {".".join(f.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): f
            for f in sorted(root.rglob("*.py"))}


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that module ``name`` (at ``path``) imports, anywhere in the file:
    ``from a.b import c`` counts ``a.b.c`` when that is a module, else ``a.b``; relative imports
    are resolved against ``name``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in known else base)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m in known and m != name}


def _own_package(importer: str, imported: str) -> bool:
    """A package's ``__init__`` and its own modules (re-exports, package-level names)."""
    return imported.startswith(importer + ".") or importer.startswith(imported + ".")


def upward_imports(root: Path = ROOT) -> list[str]:
    """Every import from a lower layer to a higher one (or into a layer `NEVER` bars), as
    readable lines naming both modules and both layers."""
    files = module_files(root)
    bad = []
    for name, path in files.items():
        mine = layer_of(name)
        for dep in sorted(imports(name, path, set(files))):
            theirs = layer_of(dep)
            if (RANK[theirs] > RANK[mine] and not _own_package(name, dep)
                    and (name, dep) not in ALLOWED):
                bad.append(f"{name} ({mine}) imports {dep} ({theirs})")
            elif theirs in NEVER.get(mine, ()):
                bad.append(f"{name} ({mine}) imports {dep} ({theirs}: a layer {mine} skips)")
    return bad


def test_every_module_has_a_layer() -> None:
    missing = []
    for name in module_files():
        try:
            layer_of(name)
        except KeyError as e:
            missing.append(str(e))
    assert not missing, missing


def test_imports_point_down() -> None:
    bad = upward_imports()
    assert not bad, "imports from a lower layer to a higher one:\n" + "\n".join(bad)


def test_a_leaf_in_a_higher_room_pulls_nothing_in() -> None:
    """A module placed by its file name (`BY_NAME`) below its package's layer is imported from
    lower layers; importing it runs its package's ``__init__``, which must therefore import no
    swafactory module (else the lower layer depends on the room after all)."""
    files = module_files()
    bad = []
    for name in files:
        package = name.rpartition(".")[0]
        if package in files and package != "swafactory" and RANK[layer_of(name)] < RANK[
                layer_of(package)] and (pulled := imports(package, files[package], set(files))):
            bad.append(f"{package}/__init__ imports {sorted(pulled)}, reached through {name}")
    assert not bad, bad


def test_the_layers_cover_the_allowlist() -> None:
    files = module_files()
    for (a, b), why in ALLOWED.items():
        assert a in files and b in files and why, (a, b)


def test_the_rule_sees_a_lazy_and_a_relative_import(tmp_path: Path) -> None:
    pkg = tmp_path / "swafactory"
    (pkg / "kvcache").mkdir(parents=True)
    (pkg / "kernels").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "kernels" / "__init__.py").write_text("")
    (pkg / "kernels" / "x.py").write_text("")
    (pkg / "kvcache" / "__init__.py").write_text("")
    (pkg / "kvcache" / "pool.py").write_text("def f():\n    from swafactory.kernels import x\n")
    (pkg / "kvcache" / "draft.py").write_text("from ..kernels import x\nfrom . import pool\n")
    assert upward_imports(pkg) == [
        "swafactory.kvcache.draft (kvcache) imports swafactory.kernels.x (kernels)",
        "swafactory.kvcache.pool (kvcache) imports swafactory.kernels.x (kernels)"]


def test_a_moved_module_keeps_its_layer() -> None:
    assert layer_of("swafactory.fault_counts") == layer_of("swafactory.outputs.fault_counts")
    assert layer_of("swafactory.resolve.layout") == "layout"
    assert layer_of("swafactory.resolve.source") == layer_of("swafactory.resolve") == "planning"
    assert layer_of("swafactory.serving.generator") == "serving"
    assert layer_of("swafactory.registry.tuning") == "planning"
    assert layer_of("swafactory.backend.timing") == "backend"
    assert layer_of("swafactory.graphs.state") == "graphs"
    with pytest.raises(KeyError, match="no layer"):  # a new root module must be placed
        layer_of("swafactory.somewhere")


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
