"""The slot books never wait for the device: a whole serving round on CUDA (open, prefill extend,
decode steps, draft extend and reject, window eviction, finish, the leak accounting) runs under
``torch.cuda.set_sync_debug_mode("error")``, which raises on any synchronizing call (a read back,
a blocking copy), after one warm-up round. The round is queued behind a spin kernel of about a
second: the host must finish the whole round while that kernel still runs (a host that runs a
forward ahead is not stalled by its own allocation). Afterwards the host mirrors equal the device
tensors and a second, CPU-only copy of the same round agrees slot for slot."""
from __future__ import annotations

import pytest
import torch

from swafactory.kvcache.allocator import SWAAllocator
from swafactory.kvcache.pool import KVPool, ReqToToken
from swafactory.kvcache.requests import RequestSlots

BS, CTX, W = 8, 256, 24
SPIN_CYCLES = 3_000_000_000  # ~1.5 s at H200 clocks: far longer than one host round


def _world(P: int, check: bool, dtype: torch.dtype, device: str) -> RequestSlots:
    full, swa = BS * CTX, BS * 96
    alloc = SWAAllocator(full, swa, P, device, check_mode=check)
    if check:  # clear on alloc (pages > 1), poison on free: index_fill_ with rows sent over
        for size, pid, space in ((full, "target.full", "full"), (swa, "target.swa", "swa")):
            alloc.attach(KVPool(size, P, 2, 2, 8, torch.bfloat16, device, pool_id=pid,
                                space=space, check_mode=True))
    alloc.shuffle(torch.Generator().manual_seed(0))
    return RequestSlots(alloc, ReqToToken(BS, CTX, device, dtype=dtype))


def _round(slots: RequestSlots) -> list[list[int] | torch.Tensor | dict]:
    """One serving round; returns every allocation's slots (device tensors on CUDA: reading them
    here would be the sync under test) and the books' own numbers."""
    out: list = []
    rids = [f"r{i}" for i in range(BS)]
    for i, rid in enumerate(rids):
        slots.open(rid)
        out.append(slots.extend(rid, 37 + 5 * i).tensor)  # prefill, ragged lengths
    for step in range(12):
        out.append(slots.decode(rids).tensor)
        for rid in rids:
            s = slots.reqs[rid]
            out.append(slots.evict_out_of_window(rid, s.kv_len, W))
    for i, rid in enumerate(rids[:4]):  # drafts: 5 positions, i + 1 accepted
        old = slots.reqs[rid].kv_len
        out.append(slots.extend_batch([rid], [5]).tensor)
        out.append(slots.truncate(rid, old + i + 1))
    out.append(slots.extend_batch(rids[4:], [3, 0, 1, 2]).tensor)
    out.append(slots.slots(rids[0]).tensor.clone())  # a view of the table: finish zeroes it
    out.append(slots.leaks())
    out.append(slots.held_pages())
    for rid in rids:
        slots.finish(rid)
    out.append(slots.leaks())
    return out


def _host(x):
    if torch.is_tensor(x):
        return x.cpu().tolist()
    if isinstance(x, dict):
        return {k: _host(v) for k, v in x.items()}
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("check", [False, True])
@pytest.mark.parametrize("P", [1, 16])
def test_slot_books_make_no_host_sync(P: int, check: bool, dtype: torch.dtype) -> None:
    slots = _world(P, check, dtype, "cuda")
    spin = getattr(torch.cuda, "_sleep", None)
    # Warm-up behind a spin kernel too: the pinned staging blocks it leaves in the caching host
    # allocator are the ones the measured round reuses (each copy holds its block until done).
    if spin is not None:
        spin(SPIN_CYCLES)
    _round(slots)
    torch.cuda.synchronize()
    done = torch.cuda.Event()
    if spin is not None:
        spin(SPIN_CYCLES)
        done.record()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = _round(slots)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    if spin is not None:
        assert not done.query(), ("the host waited for the device during the round: the spin "
                                  "kernel queued before it had already finished (a sync that "
                                  "sync_debug_mode does not flag, e.g. a pinned host "
                                  "allocation or a pageable copy)")
    torch.cuda.synchronize()
    r2t, alloc = slots.req_to_token, slots.allocator
    assert torch.equal(r2t.host, r2t.table.cpu())
    assert torch.equal(alloc.full_to_swa_host, alloc.full_to_swa.cpu())
    assert not bool(r2t.table.any()) and not bool(alloc.full_to_swa.any())  # all finished
    # the same round on the CPU (same page orders) hands out the same slots
    cpu = _world(P, False, dtype, "cpu")
    _round(cpu)  # its warm-up twin: the same state as the CUDA books before the measured round
    want = _round(cpu)
    assert [_host(x) for x in got] == [_host(x) for x in want]
    zeros = {"target.full": 0, "target.swa": 0, "req_to_token": 0, "free_and_mapped": 0}
    assert got[-1] == zeros


@pytest.mark.gpu
def test_allocator_api_keeps_its_devices_on_cuda() -> None:
    """The public API still answers on the allocator's device: slots, pages, owned pages."""
    alloc = SWAAllocator(256, 128, 4, "cuda")
    slots = alloc.alloc_extend(torch.tensor([0, 0]), [5, 3])
    pages = alloc.alloc_pages(2)
    assert slots.is_cuda and pages.is_cuda and alloc.full.owned_pages().is_cuda
    assert alloc.full_to_swa.is_cuda and alloc.mapping.table is alloc.full_to_swa
    # 5 tokens take 2 pages of 4, 3 tokens 1, then 2 more: 5 pages in each space
    assert alloc.full.owned_pages().numel() == 5 and alloc.swa.owned_pages().numel() == 5
    alloc.free(slots)  # device slots from the caller: read back once, then host books
    alloc.free_pages(pages)
    assert alloc.available_size() == alloc.size and alloc.free_and_mapped() == 0
    assert torch.equal(alloc.full_to_swa_host, alloc.full_to_swa.cpu())
    assert not bool(alloc.full_to_swa.any())
