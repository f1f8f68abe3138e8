"""The bug classes the shared parts make impossible: untranslated spec tables, stale reads through a
wrong window, and pool state cached across a FROZEN_KV draft's pool swap."""
from __future__ import annotations

import importlib.util

import pytest
import torch

import swafactory
from swafactory.backend import build_backend, model_windows
from swafactory.errors import SpaceError
from swafactory.harness.world import World, oracle_for
from swafactory.kvcache.draft import frozen_draft_view
from swafactory.kvcache.locs import translate
from swafactory.layout import frozen_draft_binding
from swafactory.metadata import ForwardBatch, prepare_spec_page_table

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed (pip install swafactory[triton])")


def gemma4_world(extra=(), **kw) -> World:
    cfg = swafactory.compose(["model=gemma4", "backend=torch", "spec=eagle3",
                              "model.sliding_window=8", *extra])
    return World(cfg, size_full=1024, size_swa=512, **kw)


def test_untranslated_table_for_an_swa_group_raises_the_space_error() -> None:
    w = gemma4_world()
    w.open("a")
    w.forward("extend", [w.req("a", 0, 20)], [0])
    full = w.slots.slots("a")                       # full-space slots, as req_to_token holds them
    branches = torch.zeros(4, 3, dtype=torch.int64)
    exp_full = type(full)("full", full.pool_id, branches)
    with pytest.raises(SpaceError, match="translate the full slots"):
        prepare_spec_page_table(full[None], torch.tensor([20]), exp_full, 4, w.pool.swa)
    with pytest.raises(SpaceError, match="translate full slots"):
        w.pool.read(0, full)                        # the SWA layer's buffers refuse them too
    swa = translate(full, w.alloc, w.pool.swa)
    swa_exp = translate(exp_full, w.alloc, w.pool.swa)
    rows = prepare_spec_page_table(swa[None], torch.tensor([20]), swa_exp, 4, w.pool.swa)
    assert rows.space == "swa" and rows.tensor.shape == (4, 23)
    assert torch.equal(rows.tensor[2, :20], swa.tensor)


@needs_triton
@pytest.mark.parametrize("page", [1, 16])
def test_spec_page_table_triton_matches_torch(monkeypatch, page: int) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    w = gemma4_world([f"backend.page_size={page}"])
    g = torch.Generator().manual_seed(page)
    lens = [5, 33, 17]
    for i, n in enumerate(lens):
        w.open(i)
        w.slots.extend(i, n)
    width = max(lens)
    table = torch.zeros(3, width, dtype=torch.int64)
    for i, n in enumerate(lens):
        table[i, :n] = w.slots.slots(i).tensor
    full = type(w.slots.slots(0))("full", w.alloc.full_id, table)
    prefix = translate(full, w.alloc, w.pool.swa)
    exp = translate(full[:, :4].__class__("full", w.alloc.full_id,
                                          torch.randint(1, 64, (6, 4), generator=g)), w.alloc, w.pool.swa)
    lens_t = torch.tensor(lens)
    a = prepare_spec_page_table(prefix, lens_t, exp, 2, w.pool.swa, impl="torch").tensor
    b = prepare_spec_page_table(prefix, lens_t, exp, 2, w.pool.swa, impl="triton").tensor
    assert torch.equal(a, b)
    assert torch.equal(a[3, lens[1]:lens[1] + 4], exp.tensor[3]) and int(a[0, lens[0] + 4:].abs().sum()) == 0


def test_wrong_window_reads_an_evicted_slot_as_nan_and_fails_the_oracle() -> None:
    w = gemma4_world(check_mode=True)
    W = w.cfg.model.sliding_window
    w.open("a")
    w.forward("extend", [w.req("a", 0, 3 * W + 1)], [0])
    assert w.slots.evict_out_of_window("a", 3 * W + 1, W) > 0
    good = w.forward("decode", [w.req("a", 3 * W + 1, 1)], [0])
    assert good[0].error() < 1e-5
    assert w.slots.evict_out_of_window("a", 3 * W + 2, W) == 1  # position 3W+2-W = 2W+2 dies
    wrong = {layer: (W + 1 if win else None) for layer, win in model_windows(w.cfg).items()}
    w.backend = build_backend(w.cfg, pools=w.pool, windows=wrong)  # one key too many
    bad = w.forward("decode", [w.req("a", 3 * W + 2, 1)], [0])
    assert torch.isnan(bad[0].out).all() and bad[0].error() == float("inf")


class SwappingDraftView:
    """A FROZEN_KV draft runner whose active pool the engine swaps between forwards."""

    role, spec_algorithm = "draft_reads_target", "frozen_kv_mtp"

    def __init__(self, target) -> None:
        self.active_pool = self.allocator_pool = target


def test_frozen_kv_draft_follows_a_pool_swap_between_forwards() -> None:
    cfg = swafactory.compose(["model=gemma4", "backend=torch", "spec=frozen_kv_mtp",
                              "model.sliding_window=8"])
    one, two = World(cfg, size_full=512, size_swa=256, seed=1), World(cfg, size_full=512,
                                                                       size_swa=256, seed=2)
    binding = frozen_draft_binding(cfg)            # draft 0 → layer 58 (swa), 1 → 59 (full)
    for w in (one, two):
        w.open("r")
        w.forward("extend", [w.req("r", 0, 21)], list(binding))
    view = SwappingDraftView(frozen_draft_view(one.pool, binding))
    windows = {j: model_windows(cfg)[t] for j, t in enumerate(binding)}
    draft = build_backend(cfg, view=view, windows=windows)
    for w in (one, two):
        view.active_pool = frozen_draft_view(w.pool, binding)   # the engine's swap
        view.allocator_pool = w.pool
        # the draft's query re-reads the last committed token's position: all of its keys were
        # written by the target, and the frozen draft writes none
        r = w.req("r", 20, 1)
        batch = ForwardBatch.of("draft_decode", [r], w.slots.req_to_token.table, w.alloc.full_id)
        plan = draft.init_forward_metadata(batch)
        assert plan.groups["swa"].tables.kv_indices.pool_id == "target.swa"
        assert plan.groups["swa"].write_locs is None
        q = torch.randn(1, cfg.model.num_attention_heads, 256)
        out = draft.forward(q, None, None, 0, save_kv=False)
        ref = oracle_for(w.specs[binding[0]], r, w.hist["r"], q, None)
        assert torch.allclose(out, ref, rtol=1e-4, atol=1e-4), "the draft read a stale pool"
    with pytest.raises(SpaceError, match="writes no KV"):
        draft.forward(q, q[:, :16], q[:, :16], 0)
