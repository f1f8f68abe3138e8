"""The full→SWA translator: the Triton kernel (interpreted on CPU) against the torch path."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from swafactory.errors import SpaceError
from swafactory.kvcache.allocator import SWAAllocator
from swafactory.kvcache.locs import Locs, gather_torch, translate
from swafactory.kvcache.pool import HybridSWAPool, KVPool

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed (pip install swafactory[triton])")


@pytest.fixture
def interpret(monkeypatch):
    """CPU tensors run the kernel only under the Triton interpreter."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert os.environ["TRITON_INTERPRET"] == "1"


def _mapped(P: int, seed: int) -> tuple[HybridSWAPool, SWAAllocator, torch.Tensor]:
    """A pool whose mapping is a random page permutation, partly evicted (0 entries)."""
    g = torch.Generator().manual_seed(seed)
    size_full, size_swa = 64 * P, 48 * P
    alloc = SWAAllocator(size_full, size_swa, P)
    swa = KVPool(size_swa, P, 1, 1, 4, torch.float32, pool_id="target.swa", space="swa")
    pool = HybridSWAPool(None, swa, {0: ("swa", 0)})
    pool.register_mapping(alloc.mapping)
    for sub, n in ((alloc.full, 64), (alloc.swa, 48)):  # free in random order → permuted lists
        every = sub.alloc_pages(n)
        sub.free_pages(every[torch.randperm(n, generator=g)])
    pages = alloc.alloc_pages(40)
    alloc.free_swa_pages(pages[torch.randperm(40, generator=g)[:10]])  # evict some
    slots = torch.randint(0, size_full + P, (7, 33), generator=g)  # a [bs, max_len] table
    return pool, alloc, slots


@needs_triton
@pytest.mark.parametrize("P", [1, 16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_triton_kernel_matches_torch_on_random_permutations(interpret, P, seed):
    pool, alloc, slots = _mapped(P, seed)
    locs = Locs("full", "target.full", slots)
    ref = translate(locs, alloc, pool, impl="torch")
    got = translate(locs, alloc, pool, impl="triton")
    assert got.space == ref.space == "swa" and got.tensor.dtype == torch.int64
    assert torch.equal(got.tensor, ref.tensor)
    assert bool((ref.tensor > 0).any()) and bool((ref.tensor == 0).any())  # both cases exercised


@needs_triton
def test_triton_kernel_maps_ids_outside_the_mapping_to_the_dummy(interpret):
    pool, alloc, _ = _mapped(1, 3)
    bad = Locs("full", "target.full", torch.tensor([-5, -1, 10**6, 3], dtype=torch.int32))
    got = translate(bad, alloc, pool, impl="triton")
    ref = translate(bad, alloc, pool, impl="torch")
    assert torch.equal(got.tensor, ref.tensor)
    assert got.tensor[:3].tolist() == [0, 0, 0]


def test_page_table_translates_slots_before_dividing():
    """mapping[slot] // P, never mapping[slot // P]: the two disagree on a permuted mapping."""
    P = 4
    pool, alloc, _ = _mapped(P, 4)
    owned = alloc.full.owned_pages()
    starts = Locs("full", "target.full", owned * P)  # first slot of each full page
    pages = translate(starts, alloc, pool).pages(P)
    assert pages.space == "swa" and pages.page_size == P
    want = alloc.full_to_swa[owned * P] // P
    assert torch.equal(pages.tensor, want)
    wrong = gather_torch(owned, alloc.full_to_swa, 1, torch.int64)  # dividing first
    assert not torch.equal(pages.tensor, wrong)
    with pytest.raises(SpaceError, match="slot ids, not page ids"):
        translate(starts.pages(P), alloc, pool)  # the wrong order is refused, not computed


def test_unknown_impl_is_refused():
    pool, alloc, slots = _mapped(1, 5)
    with pytest.raises(ValueError, match="impl must be"):
        translate(Locs("full", "target.full", slots), alloc, pool, impl="cuda")  # type: ignore


def test_values_of_a_fused_gather_are_checked_and_wrapped():
    """translate(values=...) is how the planner's fused kernel hands over its gather: the spaces
    are checked as for any translation, the shape must match, and nothing is gathered again."""
    pool, alloc, slots = _mapped(1, 4)
    locs = Locs("full", "target.full", slots)
    ref = translate(locs, alloc, pool, impl="torch")
    got = translate(locs, alloc, pool, values=ref.tensor.clone())
    assert got.space == "swa" and torch.equal(got.tensor, ref.tensor)
    with pytest.raises(ValueError, match=r"values of shape \[7, 32\].*shape \[7, 33\]"):
        translate(locs, alloc, pool, values=ref.tensor[:, :32])
    with pytest.raises(SpaceError):  # the checks still run: SWA locations are not translated
        translate(got, alloc, pool, values=ref.tensor)
