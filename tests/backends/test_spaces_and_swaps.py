"""The bug classes the shared parts make impossible: untranslated spec tables, stale reads through a
wrong window, and pool state cached across a FROZEN_KV draft's pool swap."""
from __future__ import annotations

import pytest
import torch

import swafactory
from swafactory.backend import TargetView, build_backend, model_windows
from swafactory.errors import SpaceError
from swafactory.guards import MissingSlotError
from swafactory.harness.world import World, oracle_for
from swafactory.kvcache.draft import frozen_draft_view
from swafactory.resolve.layout import frozen_draft_binding
from swafactory.metadata import ForwardBatch, plan
from swafactory.resolve.source import resolve_kv_source


def gemma4_world(extra=(), **kw) -> World:
    cfg = swafactory.compose(["model=gemma4", "backend=torch", "spec=eagle3",
                              "model.sliding_window=8", *extra])
    return World(cfg, size_full=1024, size_swa=512, **kw)


def _tree_step(w: World, lens: list[int], parents: tuple[int, ...]) -> tuple[ForwardBatch, list]:
    """Committed histories of ``lens`` (K/V written, out-of-window SWA slots evicted), then one
    EAGLE3 tree's nodes allocated after each: the batch of its verify forward."""
    W = w.cfg.model.sliding_window
    for rid, n in enumerate(lens):
        w.open(rid)
    w.forward("extend", [w.req(rid, 0, n) for rid, n in enumerate(lens)], [0, 5])
    reqs = []
    for rid, n in enumerate(lens):
        w.slots.evict_out_of_window(rid, n, W)
        assert w.slots.extend(rid, len(parents)) is not None
        reqs.append(w.req(rid, n, len(parents), parents=parents))
    return ForwardBatch.of("target_verify", reqs, w.slots.req_to_token.table, w.alloc.full_id), reqs


@pytest.mark.parametrize("page", [1, 4])
def test_spec_tree_tables_are_translated_before_any_split_or_reorder(page: int) -> None:
    """The planner, on the path every adapter takes: a tree forward's SWA tables (one pass, and
    the cascade's prefix and expand passes) and its write locations are SWA-space slots, equal to
    the allocator's mapping of each request's full slots, translated per slot before the lists are
    trimmed, concatenated or split; the full group keeps full slots."""
    w = gemma4_world([f"backend.page_size={page}", "backend.tree_mask=cascade"])
    W = w.cfg.model.sliding_window
    parents = (-1, -1, 0, 1, 2)  # topk 2: the FA3 + EAGLE3 case (sglang #24402)
    lens = [3 * W + 1, W + 2, 2 * W - 1]
    batch, reqs = _tree_step(w, lens, parents)
    source = resolve_kv_source(TargetView(w.pool), "auto")
    fp = plan(batch, w.pool.layers_mapping, model_windows(w.cfg), source, cascade=True)
    table, f2s = w.slots.req_to_token.table, w.alloc.full_to_swa
    rows = [(table[r.row, max(0, r.prefix_len - W + 1):r.prefix_len].long(),
             table[r.row, r.prefix_len:r.prefix_len + r.nodes].long()) for r in reqs]
    swa, full = fp.group(0), fp.group(5)
    assert (swa.key, full.key) == (f"swa/w{W}", "full")
    for locs in (swa.tables.kv_indices, swa.write_locs, *(t.kv_indices for t in swa.cascade)):
        assert (locs.space, locs.pool_id) == ("swa", "target.swa") and w.pool.swa.accepts(locs)
    want = torch.cat([f2s[torch.cat([p, n])] for p, n in rows])
    assert torch.equal(swa.tables.kv_indices.tensor, want) and bool((want > 0).all())  # all live
    pre, exp = swa.cascade
    assert torch.equal(pre.kv_indices.tensor, torch.cat([f2s[p] for p, _ in rows]))
    assert torch.equal(exp.kv_indices.tensor, torch.cat([f2s[n] for _, n in rows]))
    assert torch.equal(swa.write_locs.tensor, torch.cat([f2s[n] for _, n in rows]))
    assert full.tables.kv_indices.space == "full" and torch.equal(
        full.tables.kv_indices.tensor, torch.cat([table[r.row, :r.prefix_len + r.nodes].long()
                                                  for r in reqs]))


def test_untranslated_spec_tables_are_refused_by_the_swa_layer() -> None:
    """The fault that reproduces sglang #24402 (tree tables read in full space; sglang's pool
    translated its own writes, so the write locations stay SWA-space): the SWA layer and the SWA
    buffers refuse the read tables, and a translated plan runs."""
    w = gemma4_world(["faults=skip_spec_translation"])
    batch, reqs = _tree_step(w, [2 * w.cfg.model.sliding_window + 3], (-1, -1, 0, 1))
    bad = w.backend.init_forward_metadata(batch).group(0)
    assert bad.tables.kv_indices.space == "full" and not w.pool.swa.accepts(bad.tables.kv_indices)
    q = torch.randn(batch.total_q, w.cfg.model.num_attention_heads, 256)
    with pytest.raises(SpaceError, match="full-space locations"):
        w.backend.forward(q, None, None, 0, save_kv=False)
    assert bad.write_locs.space == "swa" and w.pool.swa.accepts(bad.write_locs)
    with pytest.raises(SpaceError, match="translate full slots"):
        w.pool.read(0, bad.tables.kv_indices)
    w.backend = build_backend(gemma4_world().cfg, pools=w.pool)  # the same pools, translated
    checks = w.forward("target_verify", reqs, [0, 5])
    assert [c.group for c in checks] == ["swa/w8", "full"] and max(c.error() for c in checks) < 1e-5


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
    w.backend = build_backend(w.cfg, pools=w.pool, windows=wrong, guards=False)  # a key too many
    bad = w.forward("decode", [w.req("a", 3 * W + 2, 1)], [0])
    assert torch.isnan(bad[0].out).all() and bad[0].error() == float("inf")
    # guarded (the default): the SWA hole is named at planning, before any kernel runs
    w.backend = build_backend(w.cfg, pools=w.pool, windows=wrong)
    with pytest.raises(MissingSlotError, match=f"reads position {2 * W + 2} .* in SWA space"):
        w.forward("decode", [w.req("a", 3 * W + 2, 1)], [0])


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
        assert plan.group(0).tables.kv_indices.pool_id == "target.swa"
        assert plan.group(0).write_locs is None
        q = torch.randn(1, cfg.model.num_attention_heads, 256)
        out = draft.forward(q, None, None, 0, save_kv=False)
        ref = oracle_for(w.specs[binding[0]], r, w.hist["r"], q, None)
        assert torch.allclose(out, ref, rtol=1e-4, atol=1e-4), "the draft read a stale pool"
    with pytest.raises(SpaceError, match="writes no KV"):
        draft.forward(q, q[:, :16], q[:, :16], 0)
