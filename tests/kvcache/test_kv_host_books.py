"""The books live on the host: after every step of a random serving sequence (open, extend,
decode, draft and reject, window eviction, finish, stray allocs and frees, fault switches) the
host mirrors equal the device tensors entry for entry (`ReqToToken.host` ≡ ``table``,
`SWAAllocator.full_to_swa_host` ≡ ``full_to_swa``), and the host-only leak accounting agrees with
an independent count from the device tensors. A bad extend length names the request and value."""
from __future__ import annotations

import random

import pytest
import torch

from swafactory.errors import CapacityError
from swafactory.kvcache.allocator import SWAAllocator, TokenAllocator
from swafactory.kvcache.pool import KVPool, ReqToToken
from swafactory.kvcache.requests import RequestSlots

WINDOW = 5


def _world(P: int, split: bool, dtype: torch.dtype) -> RequestSlots:
    full, swa = 24 * max(P, 2), 12 * max(P, 2)
    alloc = (SWAAllocator(full, swa, P, check_mode=True) if split
             else TokenAllocator(full, P, check_mode=True))
    for size, pid, space in ((full, "target.full", "full"), (swa, "target.swa", "swa")):
        if space == "full" or split:  # check mode: clear on alloc, poison on free, from the host
            alloc.attach(KVPool(size, P, 1, 1, 2, torch.float32, pool_id=pid, space=space,
                                check_mode=True))
    return RequestSlots(alloc, ReqToToken(4, 40, dtype=dtype))


def _assert_mirrored(slots: RequestSlots) -> None:
    r2t = slots.req_to_token
    assert r2t.host.dtype == r2t.table.dtype
    assert torch.equal(r2t.host, r2t.table), "ReqToToken.host differs from the device table"
    alloc = slots.allocator
    if isinstance(alloc, SWAAllocator):
        assert torch.equal(alloc.full_to_swa_host, alloc.full_to_swa), \
            "full_to_swa_host differs from the device mapping"
    # the host-only slots of each request are what the device table holds for it
    for rid, s in slots.reqs.items():
        assert torch.equal(slots.slots(rid).tensor, r2t.table[s.row, :s.kv_len].long())


def _device_free_and_mapped(alloc: SWAAllocator) -> int:
    """`free_and_mapped` recomputed from the device mapping and `owned_pages` (an oracle that
    shares nothing with the host count but the owned flags' public view)."""
    P, table = alloc.page_size, alloc.full_to_swa
    full_owned = torch.zeros(table.numel(), dtype=torch.bool)
    for p in alloc.full.owned_pages().tolist():
        full_owned[p * P:(p + 1) * P] = True
    stale = int(((table != 0) & ~full_owned).sum())
    swa_owned = set(alloc.swa.owned_pages().tolist())
    targets = {int(t) for t in table[table > 0].tolist() if int(t) // P not in swa_owned}
    return stale + len(targets)


def _step(slots: RequestSlots, rng: random.Random, rid_next: list[int]) -> None:
    P, alloc = slots.page_size, slots.allocator
    split = isinstance(alloc, SWAAllocator)
    live = sorted(slots.reqs)
    op = rng.choice(["open", "extend", "decode", "draft", "evict", "finish", "stray"])
    try:
        if op == "open" or not live:
            if slots.req_to_token.available_size():
                rid, rid_next[0] = rid_next[0], rid_next[0] + 1
                slots.open(rid)
                slots.extend(rid, rng.randint(0, 2 * P + 3))
            return
        rid = rng.choice(live)
        s = slots.reqs[rid]
        room = slots.req_to_token.max_context - s.kv_len
        if op == "extend" and room:
            slots.extend(rid, rng.randint(0, min(room, 2 * P + 1)))
        elif op == "decode":
            slots.decode([r for r in live if slots.reqs[r].kv_len < slots.req_to_token.max_context])
        elif op == "draft" and room:
            d = rng.randint(1, min(room, 5))
            old = s.kv_len
            slots.extend(rid, d)
            leak = split and rng.random() < 0.15
            slots.truncate(rid, max(old + rng.randint(0, d), s.swa_evicted),
                           leak_rejected_draft_slots=leak)
        elif op == "evict" and split:
            stale = rng.random() < 0.2  # the stale-mapping fault: entries zeroed, not pages
            slots.evict_out_of_window(rid, rng.randint(0, s.kv_len), WINDOW,
                                      rng.choice([1, P]), paged_free_stale_mapping=stale)
        elif op == "finish":
            slots.finish(rid)
        elif op == "stray":  # behind the requests' back: an alloc, then its free
            pages = alloc.alloc_pages(rng.randint(0, 2))
            if pages is not None:
                alloc.free_pages(pages)
    except CapacityError:
        pass
    except ValueError as exc:  # the fault switches' double frees are refused by the books
        assert "not allocated" in str(exc) or "twice" in str(exc), exc


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("P", [1, 4])
@pytest.mark.parametrize("seed", range(4))
def test_host_mirrors_equal_the_device_tensors_after_every_step(
        seed: int, P: int, split: bool, dtype: torch.dtype) -> None:
    rng = random.Random(seed * 101 + P)
    slots = _world(P, split, dtype)
    slots.allocator.shuffle(torch.Generator().manual_seed(seed))
    rid_next = [0]
    for _ in range(120):
        _step(slots, rng, rid_next)
        _assert_mirrored(slots)
        if isinstance(slots.allocator, SWAAllocator):
            assert slots.allocator.free_and_mapped() == _device_free_and_mapped(slots.allocator)
    for rid in sorted(slots.reqs):
        slots.finish(rid)
        _assert_mirrored(slots)
    assert not bool(slots.req_to_token.table.any()) and not bool(slots.req_to_token.host.any())


def test_the_books_never_read_the_device_tables() -> None:
    """Scribbling over the device tables changes nothing the books decide: every decision comes
    from the host mirrors (which the device tables only ever receive)."""
    P = 2
    a, b = _world(P, True, torch.int64), _world(P, True, torch.int64)
    for slots in (a, b):
        slots.open("x")
        slots.extend("x", 7)
    b.req_to_token.table.fill_(3)
    b.allocator.full_to_swa.fill_(5)
    seen = []
    for slots in (a, b):
        new = slots.extend("x", 3).tensor.tolist()
        evicted = slots.evict_out_of_window("x", 10, WINDOW)
        freed = slots.truncate("x", 8)
        seen.append((new, evicted, freed, slots.reqs["x"].swa_evicted, slots.leaks(),
                     slots.allocator.available_size()))
    assert seen[0] == seen[1] and seen[0][1] > 0 and seen[0][2] > 0
    assert torch.equal(a.req_to_token.host, b.req_to_token.host)
    assert torch.equal(a.allocator.full_to_swa_host, b.allocator.full_to_swa_host)


@pytest.mark.parametrize("bad", [-4, -1, 2.5, "3", True, None])
def test_a_bad_extend_length_names_the_request_and_the_value(bad: object) -> None:
    slots = _world(4, True, torch.int64)
    slots.open("r1")
    slots.extend("r1", 5)
    with pytest.raises(ValueError) as err:
        slots.extend("r1", bad)  # type: ignore[arg-type]
    msg = str(err.value)
    assert "'r1'" in msg and repr(bad) in msg and ">= 0" in msg, msg
    assert slots.reqs["r1"].kv_len == 5 and slots.leaks()["target.full"] == 0
    with pytest.raises(ValueError, match="one length each"):
        slots.extend_batch(["r1"], [1, 2])


def test_alloc_extend_returns_slots_on_the_allocator_device_and_host_twin_agrees() -> None:
    a, b = SWAAllocator(64, 32, 4), SWAAllocator(64, 32, 4)
    last = torch.tensor([0, 0], dtype=torch.int64)
    got = a.alloc_extend(last, [5, 3])
    want = b.alloc_extend_host(last, [5, 3])
    assert got.device == a.device and torch.equal(got, want)
    assert got.tolist()[:5] == list(range(got[0].item(), got[0].item() + 4)) + [got[4].item()]
    more = a.alloc_extend(torch.tensor([int(got[4]), int(got[7])]), [2, 1])
    assert more.tolist() == [int(got[4]) + 1, int(got[4]) + 2, int(got[7]) + 1]
