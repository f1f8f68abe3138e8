"""The public API imports: every name of ``swafactory.__all__``, and every ``swafactory.…`` name
docs/architecture.md shows a host engine (its library section's calls and imports), so a module
move that leaves a documented name behind fails here rather than in a user's engine."""
from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

import swafactory

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"

# The names the package exported when this test was written: a rename must keep them (or
# change this list on purpose).
KEPT = {"compose", "check", "validate", "plan_summary", "build_backend", "run", "SwaFactoryConfig",
        "ConfigError", "Reason", "SpaceError", "CapacityError", "SwaFactoryError", "DeviceInfo",
        "detect_device"}

_DOTTED = re.compile(r"\bswafactory(?:\.[A-Za-z_]\w*)+")
_FROM = re.compile(r"^\s*from (swafactory(?:\.\w+)*) import ([\w, ]+)", re.M)


def documented_names(text: str) -> set[str]:
    """Dotted ``swafactory.…`` names in ``text``: written out
    (``swafactory.resolve.source.RunnerView``, ``swafactory.check(cfg)``) or imported (``from swafactory.kvcache.factory import build_pools``
    gives ``swafactory.kvcache.factory.build_pools``). File paths (``swafactory/…``) are not names."""
    names = set(_DOTTED.findall(text))
    for module, listed in _FROM.findall(text):
        names |= {f"{module}.{n.strip()}" for n in listed.split(",") if n.strip()}
    return names


def resolve(dotted: str) -> object:
    """The object ``dotted`` names: its longest module prefix imported, the rest read as
    attributes. Raises what a user's import would (ModuleNotFoundError, AttributeError)."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        try:
            found = importlib.util.find_spec(prefix) is not None
        except ModuleNotFoundError:  # a parent that is a module, not a package
            found = False
        if found:
            obj = importlib.import_module(prefix)
            for attr in parts[n:]:
                obj = getattr(obj, attr)
            return obj
    raise ModuleNotFoundError(dotted)


DOCUMENTED = sorted(documented_names(DOC.read_text()))


def test_the_doc_lists_the_library_api() -> None:
    # the parser found the library section's names (an empty list would pass every test below)
    assert {"swafactory.compose", "swafactory.check", "swafactory.build_backend"} <= set(DOCUMENTED)


@pytest.mark.parametrize("dotted", DOCUMENTED)
def test_a_documented_name_imports(dotted: str) -> None:
    try:
        resolve(dotted)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"docs/architecture.md shows {dotted}, which does not import: {e!r}")


def test_documented_top_level_names_are_exported() -> None:
    top = {d.split(".")[1] for d in DOCUMENTED if d.count(".") == 1}
    # a top-level name the doc shows is either public or a sub-package (swafactory.kvcache…)
    missing = {n for n in top - set(swafactory.__all__)
               if importlib.util.find_spec(f"swafactory.{n}") is None}
    assert not missing, f"docs/architecture.md shows swafactory.{sorted(missing)}, not in __all__"


def test_the_public_names_are_kept() -> None:
    assert KEPT <= set(swafactory.__all__), sorted(KEPT - set(swafactory.__all__))


@pytest.mark.parametrize("name", sorted(swafactory.__all__))
def test_every_public_name_imports(name: str) -> None:
    # getattr: build_backend and run load on first use (they pull in torch)
    assert getattr(swafactory, name) is not None
    ns: dict = {}
    exec(f"from swafactory import {name}", ns)
    assert ns[name] is getattr(swafactory, name)


def test_the_parser_reads_calls_imports_and_skips_paths() -> None:
    text = ("x = swafactory.check(cfg)\n    from swafactory.kvcache.factory import build_pools, "
            "torch_dtype\nsee `swafactory/backend/` and `swafactory.resolve.source.RunnerView`.")
    assert documented_names(text) == {
        "swafactory.check", "swafactory.kvcache.factory", "swafactory.kvcache.factory.build_pools",
        "swafactory.kvcache.factory.torch_dtype", "swafactory.resolve.source.RunnerView"}
    with pytest.raises(AttributeError):
        resolve("swafactory.kvcache.factory.no_such_name")
