"""The flash_attn adapter on machines without flash-attn-4: its whole plumbing against the oracle
through `fa4_fake` (FA4's index-space causal window, page table, [Hq, total_q] LSE on CPU).

The fake aligns causality and the window bottom-right in the key *list*, as FA4 does, so a pass
sent down the natural path whose positions are not consecutive (a trimmed list with a tree, a
DFlash block) fails here as it would on the GPU; it also raises b9's head_dim-256 paged error.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

import fa4_fake
from test_backends_vs_oracle import MODES, assert_close, run_mode
from test_flashinfer_host import adapter_world


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", fa4_fake.module())
    fa4_fake.calls.clear()


def world(model, page, extra=(), **kw):
    return adapter_world(model, page, extra, backend="flash_attn", **kw)


def test_module_imports_without_flash_attn() -> None:
    code = ("import sys; sys.modules['flash_attn'] = None; "
            "from swafactory.kernels.flash_attn import Adapter, CAPABILITIES; Adapter(); "
            "print(CAPABILITIES.name)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "flash_attn", out.stderr


# gemma4's geometry with the full layers at 128 (FA4 serves ≤ 256; the point is two geometries)
GEMMA_SMALL = ["model.sliding_window=8", "model.full.head_dim=128", "model.swa.head_dim=64"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("page", [1, 16])
def test_every_mode_through_the_fake(fake, mode: str, page: int) -> None:
    w, cfg = world("gemma4", page, GEMMA_SMALL)
    assert cfg.model.swa != cfg.model.full
    assert_close(run_mode(w, mode, [0, 5], 8))


def test_natural_and_expanded_passes_are_chosen_by_structure(fake) -> None:
    w, _ = world("tiny", 1, ["model.sliding_window=6"])
    run_mode(w, "decode", [0], 6)
    assert {c["causal"] for c in fa4_fake.calls} == {True}  # extend + decode: natural
    assert (5, 0) in {c["window_size"] for c in fa4_fake.calls}  # W - 1 on the SWA layer
    fa4_fake.calls.clear()
    w, _ = world("tiny", 1, ["model.sliding_window=6"])
    run_mode(w, "verify_tree_2", [0], 6)
    assert {c["causal"] for c in fa4_fake.calls} == {True, False}  # extend natural, tree expanded


@pytest.mark.parametrize("tree_mask", ["custom_mask", "cascade"])
@pytest.mark.parametrize("mode", ["verify_tree_2", "verify_tree_4", "draft_decode", "dflash_block"])
def test_trees_both_strategies_through_the_fake(fake, mode: str, tree_mask: str) -> None:
    w, _ = world("tiny", 1, ["model.sliding_window=6"], tree_mask=tree_mask)
    checks = run_mode(w, mode, [0, 2], 6)
    assert_close(checks)


@pytest.mark.parametrize("tree_mask", ["custom_mask", "cascade"])
@pytest.mark.parametrize("mode", ["decode", "verify_chain", "verify_tree_2"])
def test_sinks_and_softcap_through_the_fake(fake, mode: str, tree_mask: str) -> None:
    w, _ = world("tiny", 16, ["model.attention_sinks=true", "model.logit_softcap=2.0",
                              "model.sliding_window=5", "model.num_attention_heads=16"],
                 tree_mask=tree_mask, seed=3)
    assert_close(run_mode(w, mode, [0, 2], 5))


def test_head_dim_256_runs_without_a_page_table(fake) -> None:
    """b9's paged loader fails at head_dim 256 (the fake raises as the library does): the adapter
    gathers those layers' keys instead, and stays exact."""
    w, _ = world("gemma3_4b", 1, ["model.sliding_window=7", "model.num_layers=4"])
    assert_close(run_mode(w, "verify_tree_2", [0, 1], 7))
    assert fa4_fake.calls and not any(c["paged"] for c in fa4_fake.calls)


def test_run_without_plan_is_refused(fake) -> None:
    w, _ = world("tiny", 1)
    w.open(0)
    w.forward("extend", [w.req(0, 0, 4)], [0])
    t = w.backend.plan.groups["swa"].tables
    w.backend.adapter._passes.clear()
    k, v, _ = w.pool.get_kv(0)
    with pytest.raises(RuntimeError, match="not planned"):
        w.backend.adapter.run(t, k[:4].repeat(1, 2, 1), k, v, window=16, scale=1.0)
