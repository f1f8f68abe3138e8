"""Typed index spaces at the pool boundary, check-mode poisoning, and layer → sub-pool routing."""
from __future__ import annotations

import pytest
import torch

import swafactory
from swafactory.errors import CapacityError, SpaceError
from swafactory.kvcache.locs import Locs, translate
from swafactory.kvcache.pool import ReqToToken, layers_mapping_for
from swafactory.kvcache.requests import RequestSlots
from swafactory.kvcache.sizing import build_pools


@pytest.fixture(scope="module")
def tiny():
    return swafactory.compose(["model=tiny", "spec=eagle3", "backend=torch"])


def _kv(n: int, pool, layer: int, value: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    sub = pool.sub_pool(layer)
    t = torch.full((n, sub.num_kv_heads, sub.head_dim), value)
    return t, t.clone()


def test_layers_mapping_routes_sliding_layers_to_the_swa_sub_pool(tiny):
    # tiny: layer_pattern SSF × 2 → sliding 0,1,3,4; full 2,5
    assert layers_mapping_for(tiny.model) == {0: ("swa", 0), 1: ("swa", 1), 2: ("full", 0),
                                              3: ("swa", 2), 4: ("swa", 3), 5: ("full", 1)}
    pool, _ = build_pools(tiny, 32, 16)
    swa_k, _, swa = pool.get_kv(3)
    full_k, _, full = pool.get_kv(5)
    # Per-sub-pool geometry (Gemma-4-like): 4 × 16 for sliding layers, 2 × 32 for full ones.
    assert (swa.pool_id, tuple(swa_k.shape)) == ("target.swa", (17, 4, 16))
    assert (full.pool_id, tuple(full_k.shape)) == ("target.full", (33, 2, 32))


@pytest.mark.parametrize("model, subs", [("gemma3_4b", ["target.full"]),
                                         ("mistral_7b", ["target.swa"]),
                                         ("gpt_oss_20b", ["target.full", "target.swa"])])
def test_unsplit_and_all_swa_models_get_one_sub_pool(model, subs):
    cfg = swafactory.compose([f"model={model}", "spec=none", "backend=torch"])
    pool, alloc = build_pools(cfg, 4, 4)
    assert [p.pool_id for p in pool.sub_pools] == subs
    assert {sub for sub, _ in pool.layers_mapping.values()} == {s.split(".")[1] for s in subs}
    assert (alloc.mapping is not None) == pool.is_split


def test_writing_an_swa_layer_with_full_space_locations_raises(tiny):
    pool, alloc = build_pools(tiny, 32, 16)
    full_locs = Locs("full", "target.full", alloc.alloc(3))
    k, v = _kv(3, pool, 0)
    with pytest.raises(SpaceError, match=r"layer 0 .*expected swa-space slots of 'target.swa', "
                                         r"got full-space locations of 'target.full'"):
        pool.write(0, full_locs, k, v)
    pool.write(0, translate(full_locs, alloc, pool), k, v)  # the translated ones are accepted
    swa_locs = translate(full_locs, alloc, pool)
    kf, vf = _kv(3, pool, 2)
    with pytest.raises(SpaceError, match="layer 2 .*expected full-space"):
        pool.write(2, swa_locs, kf, vf)
    with pytest.raises(SpaceError, match="layer 0 .*page ids"):
        pool.read(0, swa_locs.pages(4))


def test_swa_locs_cannot_be_built_by_hand_and_pages_cannot_be_translated(tiny):
    with pytest.raises(SpaceError, match="produced only by swafactory.kvcache.translate"):
        Locs("swa", "target.swa", torch.tensor([1, 2]))
    pool, alloc = build_pools(tiny, 32, 16)
    slots = Locs("full", "target.full", alloc.alloc(4))
    with pytest.raises(SpaceError, match="translate the slots first"):
        translate(slots.pages(2), alloc, pool)
    with pytest.raises(SpaceError, match="full-space"):
        translate(translate(slots, alloc, pool), alloc, pool)
    with pytest.raises(SpaceError, match="'draft.full' cannot be translated"):
        translate(Locs("full", "draft.full", slots.tensor), alloc, pool)


def test_check_mode_reading_a_freed_swa_slot_yields_nan(tiny):
    pool, alloc = build_pools(tiny, 32, 16, check_mode=True)
    slots = RequestSlots(alloc, ReqToToken(2, 32))
    slots.open("r")
    full = slots.extend("r", 8)
    swa = translate(full, alloc, pool)
    pool.write(0, swa, *_kv(8, pool, 0, 3.0))
    k, _ = pool.read(0, swa)
    assert not k.isnan().any()
    evicted = slots.evict_out_of_window("r", seq_len=8, window=4)  # positions 0..4 are dead
    assert evicted == 5
    k, v = pool.read(0, swa)  # the stale SWA slots, read as if never evicted
    assert k[:5].isnan().all() and v[:5].isnan().all()
    assert (k[5:] == 3.0).all()
    # And a fresh translation of the evicted positions lands on the poisoned dummy slot.
    again = translate(full, alloc, pool)
    assert again.tensor[:5].tolist() == [0] * 5
    assert pool.read(0, again)[0][:5].isnan().all()


def test_check_mode_keeps_the_dummy_slot_poisoned_after_padded_writes(tiny):
    pool, alloc = build_pools(tiny, 32, 16, check_mode=True)
    slots = Locs("full", "target.full", torch.tensor([0, *alloc.alloc(1).tolist()]))  # 0 = pad
    pool.write(2, slots, *_kv(2, pool, 2, 5.0))
    k, _ = pool.read(2, slots)
    assert k[0].isnan().all() and (k[1] == 5.0).all()


def test_paged_allocation_keeps_the_in_page_offset_in_both_spaces():
    cfg = swafactory.compose(["model=tiny", "spec=none", "backend=torch", "backend.page_size=16"])
    pool, alloc = build_pools(cfg, 80, 64)
    slots = RequestSlots(alloc, ReqToToken(2, 64))
    slots.open("a")
    slots.open("b")
    a = slots.extend("a", 5)
    b = slots.extend("b", 20)
    a2 = slots.extend("a", 13)  # continues a's first page, then a new page
    for locs in (a, b, a2):
        swa = translate(locs, alloc, pool)
        assert bool((swa.tensor % 16 == locs.tensor % 16).all()) and bool((swa.tensor > 0).all())
    assert a2.tensor[:11].tolist() == list(range(a.tensor[-1].item() + 1, a.tensor[-1].item() + 12))
    assert alloc.full.used_size() == 16 * 4 and alloc.swa.used_size() == 16 * 4


def test_allocation_refuses_when_either_sub_pool_is_short(tiny):
    pool, alloc = build_pools(tiny, 32, 8)
    slots = RequestSlots(alloc, ReqToToken(2, 64))
    slots.open("r")
    with pytest.raises(CapacityError, match=r"pool 'target.swa' is short: request 'r' asked for "
                       r"9 new slots; 'target.full' has 32, 'target.swa' has 8 free"):
        slots.extend("r", 9)  # the SWA pool holds 8
    assert alloc.full.used_size() == 0 and slots.reqs["r"].kv_len == 0
    assert slots.extend("r", 8) is not None
    assert alloc.available_size() == 0


def test_double_free_is_refused(tiny):
    _, alloc = build_pools(tiny, 32, 16)
    s = alloc.alloc(2)
    alloc.free(s)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free(s)


def test_check_mode_bounds_are_checked_once_per_location_tensor_and_again_after_a_change(tiny):
    """Every layer of a group writes the same planned locations, so the bounds check runs once
    for them (a sync on a GPU); a graph's buffer updated in place is checked again."""
    pool, alloc = build_pools(tiny, 32, 16, check_mode=True)
    t = torch.tensor([0, *alloc.alloc(2).tolist()])
    slots = Locs("full", "target.full", t)
    pool.write(2, slots, *_kv(3, pool, 2, 1.0))
    pool.write(2, slots, *_kv(3, pool, 2, 2.0))  # the same tensor, unchanged: accepted
    t[1] = 10_000  # in place, as a CUDA graph's planned buffer is refilled
    with pytest.raises(CapacityError, match="locations outside 'target.full'.*max 10000"):
        pool.write(2, slots, *_kv(3, pool, 2, 3.0))
    with pytest.raises(CapacityError, match="locations outside"):
        pool.write(2, Locs("full", "target.full", torch.tensor([-1, 1])), *_kv(2, pool, 2, 3.0))


def test_check_mode_bounds_come_back_as_a_device_check(tiny):
    """`HybridSWAPool.check` raises the typed space now (metadata) and hands the bounds back as
    a `guards.DeviceCheck` (min and max reduced on the device), for the backend to read where
    reading is free: at once on CPU, at ``raise_pending`` on CUDA."""
    pool, alloc = build_pools(tiny, 32, 16, check_mode=True)
    ok = Locs("full", "target.full", torch.tensor([0, *alloc.alloc(2).tolist()]))
    check = pool.check(2, ok)
    assert check is not None and not check.deferred and check.error() is None
    assert pool.check(2, ok) is None  # the same tensor, unchanged: checked once
    bad = Locs("full", "target.full", torch.tensor([3, -2, pool.full.rows]))
    err = pool.check(2, bad).error()
    assert isinstance(err, CapacityError)
    assert f"min -2, max {pool.full.rows}" in str(err) and "'target.full'" in str(err)
    with pytest.raises(SpaceError, match="expected full-space slots of 'target.full'"):
        pool.check(2, Locs("full", "draft.full", torch.tensor([1])))
    plain, _ = build_pools(tiny, 32, 16)
    assert plain.check(2, bad) is None  # bounds only in check mode
