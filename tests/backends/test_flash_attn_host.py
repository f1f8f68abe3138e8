"""The flash_attn adapter on machines without flash-attn-4, through `fa4_fake` (FA4's index-space
causal window, page table, [Hq, total_q] LSE on CPU): what is its own here; every mode, tree
strategy, sinks and soft-cap against the oracle in `test_adapters_through_fakes.py`.

The fake aligns causality and the window bottom-right in the key *list*, as FA4 does, so a pass
sent down the natural path whose positions are not consecutive (a trimmed list with a tree, a
DFlash block) fails here as it would on the GPU; it also raises b9's head_dim-256 paged error.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

import fa4_fake
from test_backends_vs_oracle import assert_close, run_mode
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


def test_natural_and_expanded_passes_are_chosen_by_structure(fake) -> None:
    w, _ = world("tiny", 1, ["model.sliding_window=6"])
    run_mode(w, "decode", [0], 6)
    assert {c["causal"] for c in fa4_fake.calls} == {True}  # extend + decode: natural
    assert (5, 0) in {c["window_size"] for c in fa4_fake.calls}  # W - 1 on the SWA layer
    fa4_fake.calls.clear()
    w, _ = world("tiny", 1, ["model.sliding_window=6"])
    run_mode(w, "verify_tree_2", [0], 6)
    assert {c["causal"] for c in fa4_fake.calls} == {True, False}  # extend natural, tree expanded


@pytest.mark.parametrize("sinks", [False, True])
def test_no_lse_is_asked_where_nothing_needs_it(fake, sinks: bool) -> None:
    """A layer's forward wants only o: FA4 is asked for its LSE only when the sinks' epilogue
    needs it (a cascade's halves, merged by LSE, still ask), and the outputs stay exact."""
    w, _ = world("tiny", 1, ["model.sliding_window=6", f"model.attention_sinks={sinks}"])
    assert_close(run_mode(w, "decode", [0, 1], 6))
    assert {c["return_lse"] for c in fa4_fake.calls} == {sinks}
    fa4_fake.calls.clear()
    w, _ = world("tiny", 1, ["model.sliding_window=6", "backend.tree_mask=cascade"])
    assert_close(run_mode(w, "verify_tree_2", [0, 1], 6))
    assert True in {c["return_lse"] for c in fa4_fake.calls}


def test_head_dim_256_runs_without_a_page_table(fake) -> None:
    """b9's paged loader fails at head_dim 256 (the fake raises as the library does): the adapter
    gathers those layers' keys instead, and stays exact."""
    w, _ = world("gemma3_4b", 1, ["model.sliding_window=7", "model.num_layers=4"])
    assert_close(run_mode(w, "verify_tree_2", [0, 1], 7))
    assert fa4_fake.calls and not any(c["paged"] for c in fa4_fake.calls)


@pytest.mark.parametrize("page", [16, 128])
@pytest.mark.parametrize("mode", ["decode", "extend_prefix", "verify_chain", "verify_tree_4",
                                  "dflash_block"])
def test_natural_passes_read_the_pools_own_pages(fake, page: int, mode: str) -> None:
    """At page size P the natural passes (decode, extend, chain verify) hand FA4 the pool's own
    pages ([rows/P, P, Hkv, D] and page ids), never the page-size-1 view; only the expanded
    passes (trees, DFlash blocks: one key list per query) read page size 1. Windows start mid-page
    (W = 20) and every output equals the oracle."""
    w, _ = world("tiny", page, ["model.sliding_window=20"])
    assert_close(run_mode(w, mode, [0, 2], 20))
    natural = [c["page_size"] for c in fa4_fake.calls if c["causal"]]
    expanded = [c["page_size"] for c in fa4_fake.calls if not c["causal"]]
    assert natural and set(natural) == {page}, natural
    assert set(expanded) <= {1}
    assert bool(expanded) == (mode in ("verify_tree_4", "dflash_block"))
