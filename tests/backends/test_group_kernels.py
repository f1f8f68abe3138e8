"""A kernel per layer group (`backend.groups`): each group's layers run its own kernel, against
the shared planner's tables, and equal the oracle in every mode; each group is validated against
its own kernel, and a refusal names the group and the field that chose the kernel."""
from __future__ import annotations

import sys

import pytest

import fa4_fake
import swafactory
from flashinfer_fake import module as fake_flashinfer
from swafactory import ConfigError
from swafactory.backend import AttentionBackend, TargetView, model_windows
from swafactory.registry import H200
from swafactory.registry.select import validate
from swafactory.registry.table import backend_module
from test_backends_vs_oracle import MODES, assert_close, run_mode
from swafactory.harness.world import World

# Gemma 4's real split: flash-attn-4 reads the head_dim-256 SWA layers, not the 512 full ones
GEMMA = ["model=gemma4", "model.sliding_window=8", "model.num_attention_heads=8",
         "model.swa.num_kv_heads=2", "model.full.num_kv_heads=1"]


class Spy:
    """An adapter that records the window of every pass it runs (None: a full group)."""

    def __init__(self, inner) -> None:
        self.inner, self.windows = inner, set()
        self.capabilities = inner.capabilities
        if hasattr(inner, "plan"):
            self.plan = inner.plan

    def run(self, tables, q, k_buf, v_buf, *, window, **kw):
        self.windows.add(window)
        return self.inner.run(tables, q, k_buf, v_buf, window=window, **kw)

    def merge(self, *a, **kw):
        return self.inner.merge(*a, **kw)


def group_world(swa: str, full: str, page: int = 1, extra=()):
    base = [*GEMMA, "backend=torch", f"backend.page_size={page}", "backend.kv_dtype=float32",
            "spec=none", *extra]
    size = 64 * max(16, page) * 4  # the world is built on torch (the registry refuses the
    world = World(swafactory.compose(base), size_full=size, size_swa=size // 2, seed=1)  # fakes)
    cfg = swafactory.compose([*base, f"backend.groups.swa={swa}", f"backend.groups.full={full}"])
    spies = {n: Spy(backend_module(n).Adapter()) for n in (swa, full)}
    world.backend = AttentionBackend(cfg, spies[swa], TargetView(world.pool), model_windows(cfg),
                                     adapters=spies)
    return world, cfg, spies


@pytest.fixture
def fakes(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer())
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", fa4_fake.module())


@pytest.mark.parametrize("mode", MODES)
def test_flash_attn_on_swa_and_flashinfer_on_full_equal_the_oracle(fakes, mode: str) -> None:
    world, cfg, spies = group_world("flash_attn", "flashinfer")
    assert cfg.model.swa.head_dim == 256 and cfg.model.full.head_dim == 512
    assert_close(run_mode(world, mode, [0, 5], 8))
    # each kernel ran only its own group's layers (SWA: window 8; full: None)
    assert spies["flash_attn"].windows == {8} and spies["flashinfer"].windows == {None}


def test_the_planner_gives_each_kernel_only_its_groups(fakes) -> None:
    world, _, spies = group_world("flash_attn", "flashinfer", page=16)
    run_mode(world, "verify_tree_4", [0, 5], 8)
    fi = spies["flashinfer"].inner._passes
    fa = spies["flash_attn"].inner._passes
    plan = world.backend.plan
    assert {id(g.tables) for g in plan.groups.values() if g.window is None} == set(fi)
    assert {id(g.tables) for g in plan.groups.values() if g.window is not None} == set(fa)


def test_a_group_kernel_is_validated_against_its_own_group_only() -> None:
    fa = ["backend=flash_attn", "model=gemma4", "spec=none"]
    # flash-attn-4 alone cannot read Gemma 4's D = 512 full layers; the suggestion moves only them
    err = pytest.raises(ConfigError, validate, swafactory.compose(fa), H200).value
    assert err.suggestion == "backend.groups.full=flashinfer", err.suggestion
    assert swafactory.check(swafactory.compose([*fa, "backend.groups.full=flashinfer"]), H200) == []
    # the other way round the refusal names the group, the field that chose the kernel, the fix
    wrong = swafactory.compose(["backend=flashinfer", "model=gemma4", "spec=none",
                                "backend.groups.full=flash_attn"])
    reasons = swafactory.check(wrong, H200)
    assert [(r.rule, r.field) for r in reasons] == [("head_dims", "model.full.head_dim")]
    assert reasons[0].message.startswith("backend.groups.full=flash_attn: the 10 full layers of "
                                         "gemma4 have head_dim 512")
    # a kernel the device cannot run (trtllm_mha: SM100, no adapter) names the group's field,
    # and unsetting it is the fix
    trt = swafactory.check(swafactory.compose(["backend=flashinfer", "model=gemma4", "spec=none",
                                               "backend.groups.swa=trtllm_mha"]), H200)
    assert {"adapter", "device"} <= {r.rule for r in trt}
    assert all(r.message.startswith("backend.groups.swa=trtllm_mha: ") for r in trt)
    named = [r for r in trt if r.rule in ("adapter", "device")]
    assert all(r.field == "backend.groups.swa" and r.fix == "backend.groups.swa=null"
               for r in named)


def test_fp8_gemma4_on_flashinfer_moves_only_the_512_layers() -> None:
    fp8 = ["backend=flashinfer", "backend.kv_dtype=fp8_e4m3", "model=gemma4", "spec=none"]
    err = pytest.raises(ConfigError, validate, swafactory.compose(fp8), H200).value
    assert err.suggestion == "backend.groups.full=triton", err.suggestion
    ok = swafactory.compose([*fp8, "backend.groups.full=triton"])
    assert swafactory.check(ok, H200) == []
    # the plan table says which kernel serves which group
    from swafactory.resolve.layout import describe
    rows = {r.group: r.backend for r in describe(ok, H200).rows}
    assert rows == {"swa": "flashinfer", "full": "triton"}


def test_an_unknown_group_kernel_names_the_field() -> None:
    from swafactory.errors import ConfigError as CE
    with pytest.raises(CE) as info:
        swafactory.compose(["backend.groups.full=nope"])
    assert "backend.groups.full" in str(info.value) and "nope" in str(info.value)


def routed_world(extra):
    """Gemma 4's split on FlashInfer (the fake) with passes handed to our Triton kernels by
    ``backend.kernels`` (``extra``), each adapter spied."""
    base = [*GEMMA, "backend=torch", "backend.kv_dtype=float32", "spec=none"]
    world = World(swafactory.compose(base), size_full=256, size_swa=128, seed=1)
    cfg = swafactory.compose([*GEMMA, "backend=flashinfer", "backend.kv_dtype=float32",
                              "spec=none", *extra])
    spies = {n: PassSpy(backend_module(n).Adapter()) for n in ("flashinfer", "triton")}
    world.backend = AttentionBackend(cfg, spies["flashinfer"], TargetView(world.pool),
                                     model_windows(cfg), adapters=spies)
    for spy in spies.values():
        spy.backend = world.backend
    return world, cfg, spies


class PassSpy(Spy):
    """A `Spy` that records (the planned forward's mode, window) of every pass it runs."""

    backend = None

    def run(self, tables, q, k_buf, v_buf, *, window, **kw):
        self.windows.add((self.backend.plan.mode, window))
        return self.inner.run(tables, q, k_buf, v_buf, window=window, **kw)


@pytest.mark.parametrize("mode", ["decode", "draft_decode", "extend", "verify_chain"])
def test_a_pass_handed_to_our_kernels_runs_on_the_triton_adapter_beside_flashinfer(
        fakes, mode: str) -> None:
    """``backend.kernels.swa.decode=triton`` and ``full.extend=triton`` under flashinfer: those
    passes run on the triton family's adapter, every other on FlashInfer's, all equal to the
    oracle (what `backend=auto` picks when our decode is faster and FlashInfer prefills
    faster)."""
    extra = ["backend.kernels.swa.decode=triton", "backend.kernels.full.extend=triton"]
    world, cfg, spies = routed_world(extra)
    served = swafactory.compose([*GEMMA, "backend=flashinfer", "spec=none", *extra])
    assert swafactory.check(served, H200) == []  # the same geometry in bf16, as served
    assert_close(run_mode(world, mode, [0, 5], 8))
    ran = {n: {} for n in spies}  # adapter → mode → windows it ran
    for n, spy in spies.items():
        for m, w in spy.windows:
            ran[n].setdefault(m, set()).add(w)
    for m, ws in ran["triton"].items():  # ours: the SWA layers' decode, the full extend
        assert ws == ({8} if m.endswith("decode") else {None} if m == "extend" else "?"), (m, ws)
    for m, ws in ran["flashinfer"].items():  # FlashInfer: the rest, never a routed pass
        assert ws == ({None} if m.endswith("decode") else {8} if m == "extend"
                      else {8, None}), (m, ws)
    last = world.backend.plan.mode  # the mode under test ran where its choice says
    assert last in ran["triton"] or (last, mode) == ("target_verify", "verify_chain"), last


def test_a_pass_handed_to_triton_is_checked_as_triton_and_named_by_its_field() -> None:
    """A routed pass meets the triton family's rules: on a CPU without the Triton interpreter
    the reason names ``backend.kernels.<group>.<pass>`` and resets it; with the interpreter the
    same config passes."""
    from swafactory.registry.device import DeviceInfo

    cfg = swafactory.compose(["backend=torch", "model=tiny", "spec=none",
                              "backend.kernels.swa.decode=triton"])
    reasons = swafactory.check(cfg, DeviceInfo("cpu", packages=frozenset({"triton"})))
    named = [r for r in reasons if r.field == "backend.kernels.swa.decode"]
    assert named and all(r.fix == "backend.kernels.swa.decode=auto" for r in named), reasons
    assert "runs on the triton family's kernels" in named[0].message
    interp = DeviceInfo("cpu", packages=frozenset({"triton"}), triton_interpret=True)
    assert swafactory.check(cfg.model_copy(update={"backend": cfg.backend.model_copy(
        update={"kv_dtype": "float32"})}), interp) == []
