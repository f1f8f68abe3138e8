"""Every GPU adapter with a CPU fake of its kernel library (`flashinfer_fake`, `fa4_fake`), run
against the oracle through the same modes, tree strategies, sinks and soft-cap; a new adapter
with a fake joins by one entry in `FAKES`."""
from __future__ import annotations

import sys

import pytest
import torch

import fa4_fake
from flashinfer_fake import module as fake_flashinfer
from test_backends_vs_oracle import (GEMMA4_SIX_LAYERS, MODES, TRITON_INTERPRETED_HEADS,
                                     assert_close, run_mode)
from test_flashinfer_host import adapter_world, set_policy

# backend → (module name its adapter imports, the fake module, Gemma 4 overrides it serves:
# flash-attn-4 takes head_dim ≤ 256, so its full layers shrink to 128, still two geometries;
# both in the first 6 layers, and FlashInfer's at a quarter of the heads, GQA kept: its 17-64-row
# passes at head_dim 512 run the Triton tile, interpreted here; test_flashinfer_host.py runs
# that tile at half of Gemma 4's heads, two KV heads in the full group)
FAKES = {
    "flashinfer": ("flashinfer", fake_flashinfer, ["model.sliding_window=8", *GEMMA4_SIX_LAYERS,
                                                   *TRITON_INTERPRETED_HEADS]),
    "flash_attn": ("flash_attn.cute.interface", fa4_fake.module,
                   ["model.sliding_window=8", *GEMMA4_SIX_LAYERS, "model.full.head_dim=128",
                    "model.swa.head_dim=64"]),
}


@pytest.fixture(params=sorted(FAKES))
def backend(request, monkeypatch) -> str:
    module, fake, _ = FAKES[request.param]
    monkeypatch.setitem(sys.modules, module, fake())
    fa4_fake.calls.clear()
    return request.param


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("page", [1, 16])
def test_gemma4_every_mode(backend: str, mode: str, page: int) -> None:
    world, cfg = adapter_world("gemma4", page, [*FAKES[backend][2], "model.num_layers=6"],
                               backend=backend)  # layers 0 and 5: SSSSSF, not 60 layers of pools
    assert cfg.model.swa != cfg.model.full
    assert_close(run_mode(world, mode, [0, 5], 8))


@pytest.mark.parametrize("tree_mask", ["custom_mask", "cascade"])
@pytest.mark.parametrize("mode", ["verify_tree_2", "verify_tree_4", "draft_decode", "dflash_block"])
def test_trees_both_strategies(backend: str, mode: str, tree_mask: str) -> None:
    world, _ = adapter_world("tiny", 1, ["model.sliding_window=6"], tree_mask=tree_mask,
                             backend=backend)
    checks = run_mode(world, mode, [0, 2], 6)
    if mode != "dflash_block":  # a DFlash block is no tree: one pass under either strategy
        assert (world.backend.plan.group(0).cascade is not None) == (tree_mask == "cascade")
    assert_close(checks)


@pytest.mark.parametrize("tree_mask", ["custom_mask", "cascade"])
@pytest.mark.parametrize("mode", ["decode", "verify_chain", "verify_tree_2"])
def test_sinks_and_softcap(backend: str, mode: str, tree_mask: str) -> None:
    world, _ = adapter_world("tiny", 16, ["model.attention_sinks=true", "model.logit_softcap=2.0",
                                          "model.sliding_window=5", "model.num_attention_heads=16"],
                             tree_mask=tree_mask, seed=3, backend=backend)
    assert_close(run_mode(world, mode, [0, 2], 5))


def test_run_without_plan_is_refused(backend: str) -> None:
    world, _ = adapter_world("tiny", 1, backend=backend)
    world.open(0)
    world.forward("extend", [world.req(0, 0, 4)], [0])
    t = world.backend.plan.group(0).tables
    world.backend.adapter._passes.clear()
    k, v, _ = world.pool.get_kv(0)
    q = torch.zeros(4, 2 * k.shape[1], k.shape[2])
    with pytest.raises(RuntimeError, match=f"{backend} adapter: these tables were not planned"):
        world.backend.adapter.run(t, q, k, v, window=16, scale=1.0)


@pytest.mark.parametrize("mode", ["decode", "verify_tree_2", "dflash_block"])
def test_flashinfer_reads_fp8_kv_with_each_layers_scales(mode: str, monkeypatch) -> None:
    """fp8 pools (per-layer scales from the harness) through the FlashInfer adapter: its wrappers
    are planned with the e4m3 KV dtype and bf16 queries, and each run gets its layer's scales.
    Verify is FlashInfer's here (``library``): our tile's fp8 reads have their own tests
    (tests/kernels/test_fp8_kv.py; Triton's CPU interpreter computes bf16 wrongly)."""
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer())
    world, cfg = adapter_world("gpt_oss_20b", 1, ["model.sliding_window=8"],
                               kv_dtype="fp8_e4m3")
    set_policy(world, "gpt_oss_20b", "backend.kernels.swa.verify=library",
               "backend.kernels.full.verify=library")
    k_scales = {world.pool.kv_scales(layer)[0] for layer in range(cfg.model.num_layers)}
    assert len(k_scales) > 1  # per layer: a kernel that used one layer's for all would miss
    assert_close(run_mode(world, mode, [0, 1, 2], 8), tol=2e-2)
