"""A Triton kernel's later launches through its compiled handle, skipping the JIT's dispatch.

``kernel[grid](*args)`` binds every argument, builds a specialization key string, looks it up,
checks the kernel's globals and then launches: on the GPU host that is 20–40 µs of Python per
launch, several times the launch itself. A planner that launches one kernel per forward pays it
on every step. `launch` pays it once per *specialization* (what Triton compiles separately for:
each pointer's dtype and 16-byte alignment, each integer's 32/64-bit width, and, unless the
kernel marks it ``do_not_specialize``, whether an integer is 1 or a multiple of 16) and then
calls the compiled kernel (`CompiledKernel[grid](*args)`, Triton's own launcher) directly.

Only kernels whose integer arguments are all ``do_not_specialize`` may use it: the key here
does not model value specialization, so such a kernel's keys would collide. Anything that is
not a plain ``JITFunction`` (the interpreter's, a test's stub) is launched the ordinary way.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["launch"]

_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1


def _spec(a: Any) -> Any:
    """What Triton specializes a non-constexpr argument on (given ``do_not_specialize`` ints)."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, bool) or a is None:
        return a
    if isinstance(a, int):
        return _I32_MIN <= a <= _I32_MAX
    return type(a)


def launch(kernel: Any, grid: tuple[int, ...], args: tuple, constexprs: tuple = (),
           device: int = 0) -> None:
    """``kernel[grid](*args, *constexprs)``, through the compiled handle after the first launch
    of each specialization.

    args: the kernel's runtime arguments in its signature's order; constexprs: the values of
    the ``tl.constexpr`` parameters that follow them (in order; they are part of the key).
    device: the CUDA device index the tensors live on (compiled handles are per device).
    """
    cache = getattr(kernel, "_swafactory_compiled", None)
    if cache is False:  # this Triton's compiled handle refused our arguments once: JIT only
        kernel[grid](*args, *constexprs)
        return
    if cache is None:
        try:
            from triton.runtime.jit import JITFunction
        except ImportError:  # pragma: no cover - callers only launch where Triton imports
            JITFunction = ()  # noqa: N806
        if not isinstance(kernel, JITFunction):  # the interpreter's kernel, a stub
            kernel[grid](*args, *constexprs)
            return
        cache = kernel._swafactory_compiled = {}
    key = (device, constexprs, *map(_spec, args))
    compiled = cache.get(key)
    if compiled is None:
        compiled = kernel[grid](*args, *constexprs)  # compiles (once) and launches
        if compiled is not None and hasattr(compiled, "__getitem__"):
            cache[key] = compiled
        return
    try:  # the compiled runner reads grid[0..2]: a 1-D or 2-D grid is padded with ones
        compiled[grid if len(grid) == 3 else (*grid, 1, 1)[:3]](*args, *constexprs)
    except TypeError:  # a Triton whose launcher takes other arguments (it parses them before
        kernel._swafactory_compiled = False  # launching): the ordinary dispatch from now on
        kernel[grid](*args, *constexprs)
