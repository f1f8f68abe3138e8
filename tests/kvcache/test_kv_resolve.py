"""The KV-source resolver, row by row (sglang-swa-facts §F), plus pinned policies and pool swaps."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from swafactory.kvcache.allocator import SWAAllocator
from swafactory.kvcache.draft import frozen_draft_view, own_draft_pool
from swafactory.kvcache.locs import Locs
from swafactory.kvcache.pool import HybridSWAPool, KVPool
from swafactory.resolve.source import resolve_kv_source


def _target() -> tuple[HybridSWAPool, SWAAllocator]:
    full = KVPool(16, 1, 1, 2, 8, torch.float32, pool_id="target.full")
    swa = KVPool(8, 1, 2, 2, 8, torch.float32, pool_id="target.swa", space="swa")
    pool = HybridSWAPool(full, swa, {0: ("swa", 0), 1: ("swa", 1), 2: ("full", 0)})
    alloc = SWAAllocator(16, 8, 1)
    pool.register_mapping(alloc.mapping)
    return pool, alloc


def _unsplit(name: str = "plain") -> HybridSWAPool:
    pool = KVPool(16, 1, 2, 2, 8, torch.float32, pool_id=f"{name}.full")
    return HybridSWAPool(pool, None, {0: ("full", 0), 1: ("full", 1)}, name=name)


@dataclass
class View:
    active_pool: object
    allocator_pool: object
    role: str
    spec_algorithm: str


@pytest.fixture
def target():
    return _target()[0]


def test_row1_active_split_pool_is_returned(target):
    src = resolve_kv_source(View(target, _unsplit(), "target", "none"))
    assert src is not None and src.pool is target and src.mapping is target.mapping


def test_row2_unsplit_active_with_split_allocator_pool_gives_allocator_pool(target):
    src = resolve_kv_source(View(_unsplit(), target, "target", "none"))
    assert src is not None and src.pool is target


def test_row3_nothing_split_gives_none():
    assert resolve_kv_source(View(_unsplit("a"), _unsplit("b"), "target", "none")) is None


def test_row4_eagle_draft_with_own_pool_gives_none(target):
    draft = own_draft_pool(16, 1, 1, 2, 8, torch.float32)
    assert resolve_kv_source(View(draft, target, "draft_own_pool", "eagle")) is None


def test_row5_frozen_kv_draft_gives_target_pool_via_allocator(target):
    dummy = _unsplit("frozen_dummy")  # sglang's 64-token dummy own pool
    src = resolve_kv_source(View(dummy, target, "draft_reads_target", "frozen_kv_mtp"))
    assert src is not None and src.pool is target and "FROZEN_KV" in src.rule


def test_row6_target_runner_ignores_spec_algorithm(target):
    src = resolve_kv_source(View(_unsplit(), target, "target", "eagle"))
    assert src is not None and src.pool is target


def test_frozen_kv_follows_a_pool_swapped_between_calls(target):
    """Nothing is cached: the second call sees the swapped-in view, not the first answer."""
    view = View(_unsplit("frozen_dummy"), target, "draft_reads_target", "frozen_kv_mtp")
    first = resolve_kv_source(view)
    frozen = frozen_draft_view(target, [2, 1])
    view.active_pool = frozen  # the worker swaps the target view in for this call
    second = resolve_kv_source(view)
    assert first is not None and first.pool is target
    assert second is not None and second.pool is frozen and second.rule == "active pool is split"
    view.active_pool = _unsplit("frozen_dummy")
    view.allocator_pool = _unsplit("unsplit_target")  # and a target that is not split at all
    assert resolve_kv_source(view) is None


def test_pinned_allocator_policy_on_own_pool_draft_answers_the_target(target):
    """What sglang #25103/#27737 did: the registry refuses it; the policy just answers."""
    draft = own_draft_pool(16, 1, 1, 2, 8, torch.float32)
    view = View(draft, target, "draft_own_pool", "dflash")
    assert resolve_kv_source(view, "auto") is None
    wrong = resolve_kv_source(view, "allocator")
    assert wrong is not None and wrong.pool is target


def test_pinned_active_pool_policy_ignores_the_allocator(target):
    assert resolve_kv_source(View(_unsplit(), target, "target", "none"), "active_pool") is None
    src = resolve_kv_source(View(target, _unsplit(), "draft_reads_target", "frozen_kv_mtp"),
                            "active_pool")
    assert src is not None and src.pool is target


def test_source_translates_into_its_pool(target):
    alloc_view = View(_unsplit(), target, "target", "none")
    src = resolve_kv_source(alloc_view)
    assert src is not None
    full = Locs("full", "target.full", torch.tensor([0, 3]))
    out = src.translate(full)
    assert out.space == "swa" and out.pool_id == "target.swa"
    assert out.tensor.tolist() == [0, 0]  # nothing allocated yet: absent → dummy


def test_inconsistent_role_and_unknown_policy_are_refused(target):
    with pytest.raises(ValueError, match="only frozen_kv_mtp"):
        resolve_kv_source(View(target, target, "draft_reads_target", "eagle"))
    with pytest.raises(ValueError, match="only frozen_kv_mtp"):
        resolve_kv_source(View(target, target, "draft_own_pool", "frozen_kv_mtp"))
    with pytest.raises(ValueError, match="unknown resolver policy"):
        resolve_kv_source(View(target, target, "target", "none"),
                          "cached")  # type: ignore[arg-type]
