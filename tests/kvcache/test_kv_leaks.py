"""Leak accounting on the shared parts: a clean cycle reports zeros at every step, one leaked slot
or row is counted in the right pool, a slot freed on one side of the mapping is free-and-mapped,
and `extend_batch` raises a CapacityError that names the pool, the ask and what was free."""
from __future__ import annotations

import pytest
import torch

from swafactory.errors import CapacityError
from swafactory.kvcache.allocator import SWAAllocator, TokenAllocator
from swafactory.kvcache.pool import ReqToToken
from swafactory.kvcache.requests import RequestSlots

WINDOW = 4


def _slots(P: int, split: bool = True) -> RequestSlots:
    alloc = (SWAAllocator(32 * P, 16 * P, P) if split else TokenAllocator(32 * P, P))
    return RequestSlots(alloc, ReqToToken(3, 64))


def _zeros(slots: RequestSlots) -> dict[str, int]:
    keys = ["target.full", "target.swa"] if isinstance(slots.allocator, SWAAllocator) else \
        ["target.full"]
    return {**{k: 0 for k in keys}, "req_to_token": 0, "free_and_mapped": 0}


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("P", [1, 4])
def test_a_clean_cycle_reports_zeros_at_every_step(P: int, split: bool) -> None:
    slots = _slots(P, split)
    zeros = _zeros(slots)
    assert slots.leaks() == zeros
    for rid in "ab":
        slots.open(rid)
        slots.extend(rid, 6)
        assert slots.leaks() == zeros  # what the open requests hold is not a leak
    for _ in range(3):  # spec steps: 3 drafts, 1 or 2 accepted, the rest freed
        for rid, keep in (("a", 1), ("b", 2)):
            L = slots.reqs[rid].kv_len
            slots.extend(rid, 3)
            slots.truncate(rid, L + keep)
            if split:
                slots.evict_out_of_window(rid, L + keep, WINDOW)
            assert slots.leaks() == zeros
    slots.decode(["a", "b"])
    for rid in "ab":
        slots.finish(rid)
    assert slots.leaks() == zeros
    assert slots.allocator.available_size() == slots.allocator.size


@pytest.mark.parametrize("P", [1, 4])
def test_one_leaked_slot_is_counted_in_its_pool(P: int) -> None:
    full = TokenAllocator(8 * P, P)
    full.alloc_pages(1)  # taken and never freed
    assert full.leaked() == {"target.full": P}
    alloc = SWAAllocator(8 * P, 4 * P, P)
    alloc.alloc_pages(1)
    assert alloc.leaked() == {"target.full": P, "target.swa": P}
    assert alloc.free_and_mapped() == 0  # held on both sides, mapped: a leak, not a stale link


def test_a_leaked_row_and_a_slot_taken_behind_the_requests_back() -> None:
    slots = _slots(1)
    slots.open("a")
    slots.extend("a", 5)
    slots.allocator.alloc(1)  # no request holds it
    slots.req_to_token.alloc()  # a row no request holds
    assert slots.leaks() == {"target.full": 1, "target.swa": 1, "req_to_token": 1,
                             "free_and_mapped": 0}
    slots.finish("a")
    assert slots.leaks()["target.full"] == 1 and slots.leaks()["req_to_token"] == 1


def test_freeing_one_side_of_the_mapping_is_free_and_mapped() -> None:
    alloc = SWAAllocator(8, 4, 1)
    a, b = alloc.alloc(2).tolist()
    alloc.full.free_pages(torch.tensor([a]))  # free without free_swa: full free, still mapped
    assert alloc.free_and_mapped() == 1
    assert alloc.leaked(None) == {"target.full": 1, "target.swa": 2}
    swa_b = int(alloc.full_to_swa[b])
    alloc.swa.free_pages(torch.tensor([swa_b]))  # SWA freed, the full slot still maps to it
    assert alloc.free_and_mapped() == 2


@pytest.mark.parametrize("P", [1, 4])
def test_the_fault_switch_leaks_rejected_drafts_in_the_swa_pool_only(P: int) -> None:
    slots = _slots(P)
    slots.open("a")
    slots.extend("a", 2 * P)
    slots.extend("a", 2 * P)  # two pages of drafts, all rejected
    slots.truncate("a", 2 * P, leak_rejected_draft_slots=True)
    books = slots.leaks()
    assert books["target.full"] == 0 and books["target.swa"] == 2 * P
    assert books["free_and_mapped"] == 2 * P  # the freed full slots still map to their SWA slots
    slots.finish("a")
    assert slots.leaks()["target.swa"] == 2 * P
    assert slots.allocator.swa.available_size() == slots.allocator.swa.size - 2 * P


def test_extend_batch_raises_naming_the_pool_the_ask_and_what_was_free() -> None:
    slots = RequestSlots(SWAAllocator(64, 32, 4), ReqToToken(2, 64))
    slots.open("a")
    slots.open("b")
    slots.extend("a", 10)  # 3 pages
    with pytest.raises(CapacityError) as err:
        slots.extend_batch(["a", "b"], [6, 17])  # a: 2 in its page + 1 new page; b: 5 pages
    msg = str(err.value)
    assert "pool 'target.swa' is short" in msg and "requests ['a', 'b']" in msg
    assert "23 new positions, 6 new pages of 4 slots (24 slots)" in msg
    assert "'target.full' has 52, 'target.swa' has 20 free" in msg
    assert slots.reqs["a"].kv_len == 10 and slots.reqs["b"].kv_len == 0  # nothing changed
    assert slots.leaks() == _zeros(slots)


def test_an_unsplit_pool_names_its_one_space() -> None:
    slots = RequestSlots(TokenAllocator(4, 1), ReqToToken(1, 8))
    slots.open("r")
    slots.decode(["r"])
    with pytest.raises(CapacityError, match=r"pool 'target.full' is short: request 'r' asked for "
                       r"4 new slots; 'target.full' has 3 free"):
        slots.extend("r", 4)
