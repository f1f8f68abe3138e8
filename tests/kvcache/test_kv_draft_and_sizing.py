"""Draft pools (own, FROZEN_KV view, DFlash split) and sizing from a memory budget."""
from __future__ import annotations

import pytest
import torch

import swafactory
from swafactory.errors import SpaceError
from swafactory.kvcache.draft import build_draft_pool, own_draft_pool, split_draft_pool
from swafactory.errors import CapacityError
from swafactory.kvcache.locs import Locs, translate
from swafactory.kvcache.sizing import build_pools, pool_sizing, size_from_budget
from swafactory.resolve.layout import frozen_draft_binding


def _cfg(*overrides: str):
    # sglang's default ratio, stated explicitly (the shipped workloads size the SWA pool `auto`)
    return swafactory.compose(["model=tiny", "backend=torch", "workload.swa_full_tokens_ratio=0.8",
                               *overrides])


def test_own_draft_pool_covers_the_target_full_space_and_under_sizing_needs_a_switch():
    cfg = _cfg("spec=eagle3")
    target, alloc = build_pools(cfg, 64, 32)
    draft = build_draft_pool(cfg, target, alloc)
    assert draft is not None and not draft.is_split and draft.full.size == 64
    assert draft.full.indexed_by == "target.full"  # addressed by the target's full slots
    slots = Locs("full", "target.full", alloc.alloc(3))
    draft.write(0, slots, torch.ones(3, 2, 32), torch.ones(3, 2, 32))  # no translation needed
    with pytest.raises(CapacityError, match="headroom 0.5 < 1 under-sizes"):
        build_draft_pool(cfg, target, alloc, headroom=0.5)
    small = own_draft_pool(64, 1, 1, 2, 32, torch.float32, headroom=0.5, unsafe_undersized=True)
    assert small.full.size == 32  # fault injection (`no_draft_headroom`) can still build one
    with pytest.raises(CapacityError, match="holds 32 slots .* hands out 64"):
        alloc.attach(small.full)  # and the allocator still names the problem
    injected = build_draft_pool(cfg, target, alloc, headroom=0.5, unsafe_undersized=True)
    assert injected is not None and injected.full.size == 32


def test_frozen_kv_view_reads_bound_target_layers_and_refuses_writes():
    cfg = _cfg("spec=frozen_kv_mtp")  # 2 draft layers → target layers 4 (sliding), 5 (full)
    target, alloc = build_pools(cfg, 32, 16)
    view = build_draft_pool(cfg, target, alloc, binding=frozen_draft_binding(cfg))
    with pytest.raises(ValueError, match="binding"):  # the layout's choice, passed in by the caller
        build_draft_pool(cfg, target, alloc)
    assert frozen_draft_binding(cfg) == (4, 5)
    assert view is not None and view.read_only and view.mapping is target.mapping
    assert view.layers_mapping == {0: target.layers_mapping[4], 1: target.layers_mapping[5]}
    full = Locs("full", "target.full", alloc.alloc(2))
    swa = translate(full, alloc, target)
    target.write(4, swa, torch.full((2, 4, 16), 7.0), torch.full((2, 4, 16), 8.0))
    k, v = view.read(0, translate(full, alloc, view))
    assert (k == 7.0).all() and (v == 8.0).all()
    assert view.get_kv(1)[0] is target.get_kv(5)[0]
    with pytest.raises(SpaceError, match="read-only view"):
        view.write(0, swa, torch.zeros(2, 4, 16), torch.zeros(2, 4, 16))


def test_dflash_split_draft_shares_the_mapping_and_needs_the_target_swa_capacity():
    cfg = _cfg("spec=dflash", "spec.draft_pool_split=true")  # 5 draft layers ← target 1..5
    target, alloc = build_pools(cfg, 32, 16)
    draft = build_draft_pool(cfg, target, alloc)
    assert draft is not None and draft.is_split and draft.mapping is alloc.mapping
    assert (draft.full.num_layers, draft.swa.num_layers) == (2, 3)
    assert draft.swa.size >= target.swa.size and draft.swa.indexed_by == "target.swa"
    full = Locs("full", "target.full", alloc.alloc(3))
    draft.write(0, translate(full, alloc, draft), torch.ones(3, 4, 16), torch.ones(3, 4, 16))
    with pytest.raises(CapacityError, match="headroom 0.5 < 1"):
        split_draft_pool(target, ["sliding_attention"], torch.float32, headroom=0.5)
    small = split_draft_pool(target, ["sliding_attention"], torch.float32, headroom=0.5,
                             unsafe_undersized=True)
    assert small.swa.size == 8 and small.mapping is alloc.mapping  # under-sized on request only
    with pytest.raises(CapacityError, match="SWA sub-pool holds 8 slots .* up to 16"):
        small.register_mapping(alloc.mapping)


def test_plan_sizing_keeps_the_swa_need_of_a_decoding_request():
    cfg = swafactory.compose(["model=gemma4", "spec=eagle3", "backend=torch"])
    s = pool_sizing(cfg)
    swa = next(g for g in s.groups if g.kind == "swa")
    # W + tree nodes (1 + 4·3) + eviction interval 1 + page 1 + 1, plus one page
    assert swa.tokens_per_request == 1024 + 13 + 1 + 1 + 1 + 1
    assert s.context_len == 8192 and s.saving > 1


def test_budget_sizing_follows_the_configurator_formula():
    cfg = _cfg("spec=none", "workload.max_running_requests=2")
    # tiny: full 2 layers × 2·2·32·4 B, swa 4 layers × 2·4·16·4 B; r = 0.8
    cell = 2 * 512 + 0.8 * 4 * 512
    got = size_from_budget(cfg, 1_000_000)
    assert got.full_tokens == int(1_000_000 / cell) and got.swa_tokens == int(got.full_tokens * 0.8)
    assert got.bytes_used <= 1_000_000 and not got.full_is_virtual
    paged = size_from_budget(cfg, 1_000_000, page_size=16)
    assert paged.full_tokens % 16 == 0 and paged.swa_tokens % 16 == 0
    with_draft = size_from_budget(_cfg("spec=eagle", "workload.max_running_requests=2"), 1_000_000)
    assert with_draft.full_tokens < got.full_tokens  # the draft's own pool is budgeted


def test_budget_too_small_for_the_window_raises():
    cfg = _cfg("spec=eagle3", "workload.max_running_requests=8")
    need = 8 * (16 + 13 + 1 + 1 + 1 + 1)  # 8 × (W + tree nodes + interval + page + 1, + page)
    with pytest.raises(CapacityError, match=f"need {need}"):
        size_from_budget(cfg, 100_000)
    with pytest.raises(CapacityError, match="need"):
        size_from_budget(cfg, 10**9, ratio=0.0001)


@pytest.mark.parametrize("model", ["mistral_7b", "gemma3_4b"])
def test_budget_sizing_of_all_swa_and_unsplit_models(model):
    cfg = swafactory.compose([f"model={model}", "spec=none", "backend=torch",
                              "workload.max_running_requests=1", "workload.context_len=8192"])
    got = size_from_budget(cfg, 8 * 2**30)
    if model == "mistral_7b":  # virtual full space: every running context, no buffers
        # virtual full space: every running context and the decode token past it, no buffers
        assert got.full_is_virtual and got.full_tokens == 8192 + 1 and got.swa_tokens > 4096
    else:
        assert not got.full_is_virtual and got.swa_tokens == 0
    assert got.bytes_used <= 8 * 2**30
