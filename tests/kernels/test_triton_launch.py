"""`swafactory.kernels.triton_launch.launch`: the JIT's dispatch once per specialization, then the
compiled handle; anything that is not a JITFunction is launched the ordinary way."""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from swafactory.kernels.triton_launch import launch  # noqa: E402


def _kernel_and_log(monkeypatch):
    """A real JITFunction whose JIT dispatch is recorded instead of compiled: each dispatch
    returns a fresh 'compiled kernel' whose launches are recorded too."""
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    def body(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        pass

    k = JITFunction(body, do_not_specialize=["n"])  # not the interpreter's, whatever the env

    log: list[tuple] = []

    class Compiled:
        def __init__(self, i: int) -> None:
            self.i = i

        def __getitem__(self, grid):  # Triton's compiled runner reads grid[0], [1] and [2]
            return lambda *args: log.append(("compiled", self.i, (grid[0], grid[1], grid[2]),
                                             args))

    def run(*args, grid, warmup, **kw):
        log.append(("jit", grid, args))
        return Compiled(sum(e[0] == "jit" for e in log))

    monkeypatch.setattr(k, "run", run)
    return k, log


def test_second_launch_of_a_specialization_skips_the_jit(monkeypatch) -> None:
    k, log = _kernel_and_log(monkeypatch)
    x, y = torch.zeros(64, dtype=torch.int64), torch.zeros(64, dtype=torch.int32)
    launch(k, (2, 1, 1), (x, y, 5), (128,))
    launch(k, (3, 1, 1), (x, y, 7), (128,))  # other values, same specialization
    assert [e[0] for e in log] == ["jit", "compiled"]
    assert log[1] == ("compiled", 1, (3, 1, 1), (x, y, 7, 128))  # constexprs follow, in order
    launch(k, (4,), (x, y, 7), (128,))  # a 1-D grid (the sink epilogue's) is padded
    assert log[2] == ("compiled", 1, (4, 1, 1), (x, y, 7, 128))


@pytest.mark.parametrize("change", ["dtype", "alignment", "int64", "constexpr", "device"])
def test_a_new_specialization_goes_through_the_jit(monkeypatch, change: str) -> None:
    """What Triton compiles separately for gets its own dispatch: a pointer's dtype or 16-byte
    alignment, an integer past int32, a constexpr's value, the device."""
    k, log = _kernel_and_log(monkeypatch)
    x, y = torch.zeros(64, dtype=torch.int64), torch.zeros(64, dtype=torch.int32)
    launch(k, (1, 1, 1), (x, y, 5), (128,))
    args, cx, dev = (x, y, 5), (128,), 0
    if change == "dtype":
        args = (x, y.long(), 5)
    elif change == "alignment":
        args = (x[1:], y, 5)  # 8 bytes past an aligned start
    elif change == "int64":
        args = (x, y, 2**31)
    elif change == "constexpr":
        cx = (256,)
    else:
        dev = 1
    launch(k, (1, 1, 1), args, cx, dev)
    assert [e[0] for e in log] == ["jit", "jit"]
    launch(k, (1, 1, 1), args, cx, dev)
    assert [e[0] for e in log] == ["jit", "jit", "compiled"] and log[-1][1] == 2


def test_a_non_jit_kernel_is_launched_the_ordinary_way() -> None:
    calls = []

    class Stub:
        def __getitem__(self, grid):
            return lambda *args: calls.append((grid, args))

    launch(Stub(), (4,), (1, 2), (8,))
    launch(Stub(), (4,), (1, 2), (8,))
    assert calls == [((4,), (1, 2, 8))] * 2


def test_a_launcher_that_refuses_the_arguments_turns_the_fast_path_off(monkeypatch) -> None:
    """A Triton whose compiled launcher parses other arguments raises TypeError before
    launching: that launch and every later one go through the JIT."""
    k, log = _kernel_and_log(monkeypatch)

    class Refuses:
        def __getitem__(self, grid):
            def runner(*args):
                raise TypeError("function takes exactly 12 arguments")
            return runner

    monkeypatch.setattr(k, "run", lambda *a, grid, warmup, **kw: log.append("jit") or Refuses())
    x = torch.zeros(64, dtype=torch.int64)
    for _ in range(3):
        launch(k, (1,), (x, x, 5), (128,))
    assert log == ["jit"] * 3  # the first, the refused one's retry, then JIT only
