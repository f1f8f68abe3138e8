"""The torch backend against the oracle, over every forward mode, through real pools.

Pages come in random order, lengths are odd and straddle the window edges (W-1, W, W+1 keys),
SWA slots out of the window are evicted (and poisoned: check mode), and gemma4's SWA and full
sub-pools have different geometry.
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import swafactory
from swafactory.harness.world import World
from swafactory.registry.table import list_backends


def _runnable_here(name: str) -> bool:
    """Backends whose kernels run on this machine's tensors (the interpreter counts on CPU)."""
    from swafactory.registry.table import backend_module, get_capabilities

    if not hasattr(backend_module(name), "Adapter"):
        return False
    if "cpu" in get_capabilities(name).devices:
        return True
    if name == "triton":
        return importlib.util.find_spec("triton") is not None and (
            torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")
    return torch.cuda.is_available()  # GPU adapters are tested on the GPU host


def _why_not(name: str) -> str:
    from swafactory.registry.table import has_adapter

    if not has_adapter(name):
        return f"{name} has no adapter yet (the registry refuses it)"
    return f"{name} kernels need a CUDA GPU (triton: or TRITON_INTERPRET=1); this is a CPU run"


BACKENDS = [pytest.param(b, marks=[] if _runnable_here(b) else pytest.mark.skip(
    reason=_why_not(b))) for b in list_backends()]

MODES = ["extend", "extend_prefix", "decode", "verify_chain", "verify_tree_2", "verify_tree_4",
         "draft_decode", "draft_extend", "dflash_block"]


def tree(topk: int) -> tuple[int, ...]:
    """topk roots, one child each, then two grandchildren: depths 0, 1, 2."""
    return tuple([-1] * topk + list(range(topk)) + [topk, topk + 1])


def make_world(model: str, page: int, extra: list[str] = (), tree_mask="custom_mask", seed=0,
               backend: str = "torch"):
    cfg = swafactory.compose([f"model={model}", f"backend={backend}", f"backend.page_size={page}",
                              f"backend.tree_mask={tree_mask}", "spec=none",
                              "backend.kv_dtype=float32", "backend.cuda_graph=false", *extra])
    reasons = swafactory.check(cfg)
    if reasons:  # the registry refuses it here (e.g. flash_attn with gemma4's head_dim 512)
        pytest.skip("; ".join(r.message for r in reasons))
    size = 64 * max(16, page) * 4
    return World(cfg, size_full=size, size_swa=size // 2, seed=seed), cfg


def run_mode(world: World, mode: str, layers, W: int) -> list:
    lens = [W - 1, W, W + 1, 2 * W + 3]
    rids = list(range(len(lens)))
    checks = []
    for rid in rids:
        world.open(rid)
    checks += world.forward("extend", [world.req(r, 0, n) for r, n in zip(rids, lens)], layers)
    for r, n in zip(rids, lens):
        if world.cfg.model.hybrid_pool and world.cfg.model.swa_layers:
            world.slots.evict_out_of_window(r, n, W)
    req = world.req
    if mode == "extend":
        return checks
    if mode == "extend_prefix":
        reqs = [req(r, n, 7) for r, n in zip(rids, lens)]
        return checks + world.forward("extend", reqs, layers)
    if mode == "decode":
        out = world.forward("decode", [req(r, n, 1) for r, n in zip(rids, lens)], layers)
        out += world.forward("decode", [req(r, n + 1, 1) for r, n in zip(rids, lens)], layers)
        return checks + out
    if mode == "verify_chain":
        return checks + world.forward("target_verify", [req(r, n, 4) for r, n in zip(rids, lens)],
                                      layers)
    if mode.startswith("verify_tree"):
        p = tree(int(mode[-1]))
        return checks + world.forward("target_verify", [req(r, n, len(p), parents=p)
                                                        for r, n in zip(rids, lens)], layers)
    if mode == "draft_decode":
        p = tree(2)
        out = world.forward("draft_decode", [req(r, n, 2, parents=p[:2]) for r, n in zip(rids, lens)],
                            layers)
        out += world.forward("draft_decode", [req(r, n, 4, parents=p[:4], query_from=2)
                                              for r, n in zip(rids, lens)], layers)
        return checks + out
    if mode == "draft_extend":
        return checks + world.forward("draft_extend", [req(r, n, 3) for r, n in zip(rids, lens)],
                                      layers)
    if mode == "dflash_block":
        return checks + world.forward("target_verify", [req(r, n, 5, block=True)
                                                        for r, n in zip(rids, lens)], layers)
    raise AssertionError(mode)


def assert_close(checks, tol=2e-5) -> None:
    assert checks
    for c in checks:
        assert not torch.isnan(c.out).any(), f"NaN at layer {c.layer} ({c.group})"
        assert c.error() < tol, f"layer {c.layer} ({c.group}): rel err {c.error():.2e}"


INTERPRETED_PAGE1 = ("decode", "extend_prefix", "verify_tree_4", "dflash_block")
"""Modes the triton interpreter runs at page size 1 on a CPU; page 16 runs the others, so each
mode runs once under the interpreter (3-8 s each at TRITON_INTERPRETED_HEADS; the torch backend
runs every mode at both page sizes, and the GPU host runs triton in every mode at both)."""


def _interpreted(backend: str) -> bool:
    """triton's kernels run under the CPU interpreter here (one Python program at a time)."""
    return backend == "triton" and os.environ.get("TRITON_INTERPRET") == "1"


GEMMA4_SIX_LAYERS = ["model.num_layers=6"]
"""Gemma 4's geometry and layer pattern (SSSSSF) in its first 6 layers: the tests run layers 0
and 5, and the pools of the other 54 layers (GBs of NaN-poisoned rows) only cost allocation."""

TRITON_INTERPRETED_HEADS = ["model.num_attention_heads=8", "model.swa.num_kv_heads=4",
                            "model.full.num_kv_heads=1"]
"""A quarter of Gemma 4's heads for triton under the CPU interpreter, which runs one program per
(request, KV head, tile) in Python: head_dim 256 / 512 and GQA 2 / 8 stay, so every mode picks
the same tiles and splits as at 16 or 32 heads (extend_config, decode_config, extend_splits and
plan_splits log the same values in every mode at 8 and 16 heads), at about 60% of the time at 16.
The full group keeps one KV head here: the adapter's KV-head strides are held by the SWA group's
4 and by `model=tiny`'s full group, the head_dim-512 tile's by tests/kernels (16 heads, 2 KV
heads). The torch backend runs the full 32 heads here, the GPU host triton too."""


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("page", [1, 16])
def test_gemma4_geometry_every_mode(mode: str, page: int, backend: str) -> None:
    if _interpreted(backend) and (page == 1) != (mode in INTERPRETED_PAGE1):
        pytest.skip("triton under the CPU interpreter takes ~10 s a mode: page 1 runs "
                    f"{', '.join(INTERPRETED_PAGE1)} here, page 16 the other modes, every mode "
                    "at both on a GPU")
    world, cfg = make_world("gemma4", page, ["model.sliding_window=8", *GEMMA4_SIX_LAYERS,
                                             *(TRITON_INTERPRETED_HEADS if _interpreted(backend)
                                               else [])], backend=backend)
    assert cfg.model.swa != cfg.model.full
    assert_close(run_mode(world, mode, [0, 5], 8))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tree_mask", ["custom_mask", "cascade"])
@pytest.mark.parametrize("mode", ["verify_tree_2", "verify_tree_4", "draft_decode"])
def test_trees_through_both_strategies(mode: str, tree_mask: str, backend: str) -> None:
    world, _ = make_world("tiny", 1, ["model.sliding_window=6"], tree_mask=tree_mask,
                          backend=backend)
    checks = run_mode(world, mode, [0, 2], 6)
    plan = world.backend.plan
    assert (plan.group(0).cascade is not None) == (tree_mask == "cascade")
    assert_close(checks)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads", [4, 16, 32])  # GQA 1, 4, 8 on the SWA group (4 KV heads)
@pytest.mark.parametrize("sinks", [False, True])
def test_gqa_ratios_and_sinks(heads: int, sinks: bool, backend: str) -> None:
    world, _ = make_world("tiny", 16, [f"model.num_attention_heads={heads}",
                                      f"model.attention_sinks={str(sinks).lower()}",
                                      "model.sliding_window=5"], seed=heads, backend=backend)
    assert_close(run_mode(world, "verify_tree_2", [0, 2], 5))


SHIPPED_INTERPRETED_HEADS = {
    "gpt_oss_20b": ["model.num_attention_heads=16", "model.swa.num_kv_heads=2",
                    "model.full.num_kv_heads=2"],
    "mistral_7b": ["model.num_attention_heads=8", "model.swa.num_kv_heads=2"]}
"""A quarter of the heads for triton under the interpreter, as TRITON_INTERPRETED_HEADS: head_dim
and GQA (8, 4) stay, and so do the tiles and splits; gemma3_4b keeps its 8 heads."""


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model", ["gpt_oss_20b", "mistral_7b", "gemma3_4b"])
def test_shipped_models_decode_and_verify(model: str, backend: str) -> None:
    fewer = SHIPPED_INTERPRETED_HEADS.get(model, []) if _interpreted(backend) else []
    world, cfg = make_world(model, 1, ["model.sliding_window=7", "model.num_layers=4",
                                       "model.softmax_scale=0.1", *fewer], backend=backend)
    layers = [0, 1] if model != "mistral_7b" else [0]
    assert_close(run_mode(world, "verify_chain", layers, 7))


@pytest.mark.parametrize("model", ["gpt_oss_20b", "mistral_7b"])
def test_triton_decode_writes_the_steps_kv_in_its_kernel(model: str) -> None:
    """triton's decode kernel writes the step's K/V itself (`AttentionBackend.forward` hands
    them over): the second decode step reads the rows the first one's kernel wrote, from pools
    whose dummy page stays poisoned (check mode)."""
    if not _runnable_here("triton"):
        pytest.skip(_why_not("triton"))
    from swafactory.kernels.triton import decode

    fewer = SHIPPED_INTERPRETED_HEADS[model] if _interpreted("triton") else []
    world, _ = make_world(model, 1, ["model.sliding_window=7", "model.num_layers=4", *fewer],
                          backend="triton")
    layers = [0, 1] if model != "mistral_7b" else [0]
    before = decode.launches
    assert world.backend.adapter.fuses_writes
    assert_close(run_mode(world, "decode", layers, 7))
    assert decode.launches - before == 2 * len(layers)  # both steps, every layer
    for sub in world.pool.sub_pools:
        assert sub.check_mode and all(torch.isnan(b[:sub.page_size]).all() for b in sub.k_bufs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_softcap(backend: str) -> None:
    world, _ = make_world("tiny", 1, ["model.logit_softcap=2.0", "model.sliding_window=5"],
                          backend=backend)
    assert_close(run_mode(world, "decode", [0, 2], 5))
