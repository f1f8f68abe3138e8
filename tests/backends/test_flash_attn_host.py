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
import torch

import fa4_fake
from swafactory.kernels import flash_attn
from test_backends_vs_oracle import MODES, assert_close, run_mode
from test_flashinfer_host import adapter_world

TILE = flash_attn.SHORT_PASS_TILE
GPT_OSS = ["model.sliding_window=20", "model.num_layers=2"]  # group 8, D 64, sinks


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", fa4_fake.module())
    fa4_fake.calls.clear()


@pytest.fixture
def sm90(fake, monkeypatch):
    """The fake on an SM90 device, as the H200 is: `pass_tile` may give a tile."""
    monkeypatch.setattr(flash_attn, "_arch", lambda device: 90)


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


def test_pass_tile_is_sm90_head_dim_64_and_at_most_64_packed_rows() -> None:
    assert flash_attn.pass_tile(8, 64, 90) == TILE == (64, 128)  # GPT-OSS decode, group 8
    assert flash_attn.pass_tile(64, 64, 90) == TILE  # 8 queries × group 8: one M block
    assert flash_attn.pass_tile(65, 64, 90) is None
    assert flash_attn.pass_tile(8, 128, 90) is None  # not measured: b9's default
    assert flash_attn.pass_tile(8, 64, 100) is None and flash_attn.pass_tile(8, 64, None) is None


@pytest.mark.parametrize("page", [1, 128])
def test_gpt_oss_decode_runs_the_64x128_tile(sm90, page: int, monkeypatch) -> None:
    """GPT-OSS decode (8 packed rows per KV head, D 64) calls `_flash_attn_fwd` with
    ``tile_mn=(64, 128)`` on both layer groups; the prompt's extend (≥ 19 × 8 rows) keeps the
    varlen call. The outputs equal the oracle's and, exactly, the varlen call's (no tile)."""
    w, _ = world("gpt_oss_20b", page, GPT_OSS)
    tiled = run_mode(w, "decode", [0, 1], 20)
    assert_close(tiled)
    runs = w.backend.adapter.runs
    assert set(runs) == {(page, TILE), (page, None)}, runs  # no run fell back to the default
    assert runs[page, TILE] == 2 * runs[page, None]  # two decode steps, one extend, per layer
    assert w.backend.adapter.tile_fallback is None
    fwd = [c for c in fa4_fake.calls if c["fn"] == "_flash_attn_fwd"]
    assert len(fwd) == runs[page, TILE] and {c["tile_mn"] for c in fwd} == {TILE}
    assert {c["window_size"] for c in fwd} == {(19, 0), (None, 0)}  # SWA and full layer
    monkeypatch.setattr(flash_attn, "_arch", lambda device: None)  # off SM90: no tile
    w, _ = world("gpt_oss_20b", page, GPT_OSS)
    default = run_mode(w, "decode", [0, 1], 20)
    assert set(w.backend.adapter.runs) == {(page, None)}
    assert all(torch.equal(a.out, b.out) for a, b in zip(tiled, default, strict=True))


@pytest.mark.parametrize("mode", MODES)
def test_gpt_oss_every_mode_on_sm90(sm90, mode: str) -> None:
    """Every mode equals the oracle with tiles on; natural passes of ≤ 64 packed rows (decode,
    4- and 7-query extends, chain verify) take the tile, the prompt's extend (> 64 rows) and the
    expanded passes (trees, DFlash blocks) keep the varlen call."""
    w, _ = world("gpt_oss_20b", 16, GPT_OSS)
    assert_close(run_mode(w, mode, [0, 1], 20))
    tiled = {"decode", "extend_prefix", "verify_chain", "draft_extend"}
    assert {t for _, t in w.backend.adapter.runs} == ({None, TILE} if mode in tiled else {None})
    assert {c["fn"] for c in fa4_fake.calls if c["tile_mn"] is None} == {"flash_attn_varlen_func"}


def test_a_library_without_flash_attn_fwd_runs_the_default_tile_and_says_why(sm90, monkeypatch):
    mod = fa4_fake.module()
    del mod._flash_attn_fwd
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", mod)
    w, _ = world("gpt_oss_20b", 128, GPT_OSS)
    with pytest.warns(RuntimeWarning, match="no _flash_attn_fwd"):
        assert_close(run_mode(w, "decode", [0, 1], 20))
    assert set(w.backend.adapter.runs) == {(128, None)}
    assert "tile_mn=(64, 128)" in w.backend.adapter.tile_fallback


def test_flash_attn_fwd_refuses_the_varlen_window_keyword() -> None:
    """b9's `_flash_attn_fwd` has no ``window_size``: the fake fails a call that passes one."""
    q = torch.zeros(1, 2, 8)
    with pytest.raises(TypeError, match="window_size"):
        fa4_fake._flash_attn_fwd(q, q, q, window_size=(None, 0))
