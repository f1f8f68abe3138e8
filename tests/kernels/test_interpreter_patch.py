"""The suite's interpreter shim (tests/conftest.py) patches what Triton's own code patches: the
same attributes of the same language modules, in the same order, and nothing left behind."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("triton")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter only")
def test_the_shim_patches_the_builtins_triton_patches() -> None:
    from triton.runtime import interpreter as ti

    shim = ti._patch_builtin
    assert hasattr(shim, "original"), "the conftest shim is not installed"
    tl = ti.tl
    for pkg in (tl, tl.tensor, tl.math, tl.core.tensor_descriptor_base):
        before = {n: getattr(pkg, n) for n in dir(pkg)}
        changes = []
        for patch in (shim.original, shim, shim):  # the shim twice: its list, then its cache
            scope = ti._LangPatchScope()
            patch(pkg, ti.interpreter_builder, scope)
            changes.append([(obj, name) for obj, name, _ in scope._changes])
            scope.restore()
        assert changes[0], pkg  # each module has builtins to patch
        assert changes[1] == changes[0] and changes[2] == changes[0], pkg
        assert {n: getattr(pkg, n) for n in dir(pkg)} == before  # all restored


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter only")
def test_inside_a_patched_scope_nothing_is_patched_again() -> None:
    """A jitted helper called inside a kernel patches again over patched modules: its wrappers
    are no builtins, so neither version changes anything there."""
    from triton.runtime import interpreter as ti

    shim, tl = ti._patch_builtin, ti.tl
    outer = ti._LangPatchScope()
    shim(tl, ti.interpreter_builder, outer)
    try:
        for patch in (shim.original, shim):
            inner = ti._LangPatchScope()
            patch(tl, ti.interpreter_builder, inner)
            assert inner._changes == []
    finally:
        outer.restore()
