"""Shared fixtures. GPU tests carry `@pytest.mark.gpu` and skip with a reason where no GPU is."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from cli_process import run_cli

REPO = Path(__file__).resolve().parents[1]

# triton fixes interpreter vs compiled mode when it is first imported: decide once per session,
# before any test imports it (CPU machines interpret; `TRITON_INTERPRET=0 pytest -m gpu` on GPUs)
if "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "0" if torch.cuda.is_available() else "1"


def _interpreter_patches_builtins_by_name() -> None:
    """Triton's interpreter re-patches `triton.language` at every launch and at every call of a
    jitted helper inside a kernel: each time `inspect.getmembers` over the language modules, a
    quarter of an interpreted test's time. The builtins of a module are the same names every
    time, so list them once per module and patch by name: the same attributes, in the same
    order, get the same wrappers (tests/kernels/test_interpreter_patch.py checks it)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import inspect

        from triton.runtime import interpreter as ti
    except ImportError:
        return
    original = getattr(ti, "_patch_builtin", None)
    if original is None or not hasattr(ti, "_patch_attr") or not hasattr(ti, "tl"):
        return  # another triton: leave it as it is
    names: dict[int, tuple[object, list[str]]] = {}

    def patch_builtin(pkg, builder, scope):
        held = names.get(id(pkg))
        if held is None or held[0] is not pkg:
            held = names[id(pkg)] = (pkg, [n for n, m in inspect.getmembers(pkg)
                                           if ti.tl.core.is_builtin(m)])
        for name in held[1]:
            member = getattr(pkg, name, None)
            if ti.tl.core.is_builtin(member):
                ti._patch_attr(pkg, name, member, builder, scope)

    patch_builtin.original = original
    ti._patch_builtin = patch_builtin


_interpreter_patches_builtins_by_name()


def _compose_once_per_overrides() -> None:
    """Hydra takes about 60 ms to compose a config, and the suite composes about a thousand, a
    third of them repeats. A composition is a function of the search path, the version base, the
    config name and the overrides (the shipped YAML does not change while the suite runs): keep
    each result and hand out deep copies, so no test sees another's. Errors are not kept."""
    import copy

    import hydra
    from hydra import version
    from hydra.core.global_hydra import GlobalHydra

    real = hydra.compose
    done: dict = {}

    def compose(config_name=None, overrides=None, return_hydra_config=False, strict=None):
        gh = GlobalHydra.instance()
        if strict is not None or not gh.is_initialized():
            return real(config_name=config_name, overrides=overrides,
                        return_hydra_config=return_hydra_config, strict=strict)
        key = (tuple((s.provider, s.path) for s in gh.config_loader().get_sources()),
               str(version.getbase()), config_name, tuple(overrides or ()), return_hydra_config)
        if key not in done:
            done[key] = real(config_name=config_name, overrides=list(overrides or ()),
                             return_hydra_config=return_hydra_config)
        return copy.deepcopy(done[key])

    compose.original = real
    hydra.compose = compose


_compose_once_per_overrides()

# trained targets and drafts (run.target_weights=pretrained, spec.draft_weights=distilled) are
# cached by what their weights depend on: one cache for the suite, so each trains once per clone
os.environ.setdefault("SWAFACTORY_CACHE_DIR", str(REPO / "build" / "test-cache"))
# run=generate checks its attention rows against the fp32 oracle in every test (run.oracle's
# default reads it; a user's default is off)
os.environ.setdefault("SWAFACTORY_ORACLE", "true")
# a quarter of the passes after the first of each runner x mode x eager/replay (always checked):
# every pass kind is still checked in every test, at a quarter of the oracle's cost; the tests of
# the watch itself and the GPU suite check every pass (run.oracle_rate=1.0)
os.environ.setdefault("SWAFACTORY_ORACLE_RATE", "0.25")

# under pytest-xdist each worker is one process: one thread each keeps the cores from thrashing
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    # and so do the CLI runs the tests start (`python -m swafactory`, Hydra sweeps): torch
    # reads this when it starts there (a tensor-parallel rank still sets its own count)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):  # noqa: ANN001 - pytest hook
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible (CPU machine / CI)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cli(tmp_path):
    """Run `python -m swafactory …` in a temp dir; returns the CompletedProcess."""

    def run(*overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
        return run_cli([*overrides, f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path, timeout=120,
                       env={**os.environ, "COLUMNS": "160", **(env or {})})

    return run
