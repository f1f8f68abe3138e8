"""The third round's faults act on geometries nobody tuned them to: each is switched on over 20
seeded draws of model, layer pattern, window (never a power of two), page size and request
lengths, and must act on every one. The runs are too slow for 20 draws each, so the property is
checked over what each fault changes: the verify's plan (its tables and write slots, from the
shared planner), the slots SWA eviction frees, the scales a FROZEN_KV draft's reads take. The
draw's seed is in each test's id; its geometry is in the failure message."""
from __future__ import annotations

import random

import pytest
import torch

import swafactory
from swafactory.backend import faulty
from swafactory.errors import SpaceError
from swafactory.guards import GuardError
from swafactory.fault_counts import FAULT_COUNTS
from swafactory.harness.world import World
from swafactory.metadata.batch import ForwardBatch, ReqForward
from swafactory.window import visible

DRAWS = range(20)
PLAN_FAULTS = ["swa_metadata_missing_in_spec_modes", "window_gather_from_zero",
               "verify_rows_share_write_loc", "verify_as_decode"]


def draw(seed: int) -> tuple[list[str], dict]:
    """A geometry: overrides and what they mean (for the failure message)."""
    rnd = random.Random(seed)
    model = rnd.choice(["tiny", "gemma4", "gpt_oss_20b"])
    n = rnd.randint(3, 7)
    pattern = [rnd.choice("SF") for _ in range(n)]
    pattern[rnd.randrange(n)], pattern[rnd.randrange(n)] = "S", "F"
    if "S" not in pattern or "F" not in pattern:
        pattern[0], pattern[-1] = "S", "F"
    window = rnd.choice([w for w in range(9, 98) if w & (w - 1)])  # not a power of two
    page = rnd.choice([1, 1, 4, 16])
    lens = [window + rnd.randint(page + 2, 3 * window), window + rnd.randint(page + 2, 40)]
    geo = {"seed": seed, "model": model, "pattern": "".join(pattern), "window": window,
           "page": page, "lens": lens}
    return [f"model={model}", f"model.layer_pattern={''.join(pattern)}", f"model.num_layers={n}",
            f"model.sliding_window={window}", f"backend.page_size={page}"], geo


def _verify_batch(w: World, lens: list[int], nodes: int) -> ForwardBatch:
    """Committed histories of ``lens`` (out-of-window SWA slots evicted), then a chain of
    ``nodes`` verified after each: the batch of its target verify."""
    W = w.cfg.model.sliding_window
    for rid in range(len(lens)):
        w.open(rid)
        assert w.slots.extend(rid, lens[rid]) is not None
        w.slots.evict_out_of_window(rid, lens[rid], W)
    reqs = []
    for rid, n in enumerate(lens):
        assert w.slots.extend(rid, nodes) is not None
        reqs.append(w.req(rid, n, nodes))
    return ForwardBatch.of("target_verify", reqs, w.slots.req_to_token.table, w.alloc.full_id)


def _world(over: list[str], fault: str) -> World:
    cfg = swafactory.compose(["backend=torch", "spec=eagle", *over, f"faults={fault}"])
    return World(swafactory.validate(cfg), size_full=2048, size_swa=1024, check_mode=True)


def _reads_outside_window(g, W: int) -> bool:
    """Whether a group's tables let a query see a key its window excludes, or list a key that
    is not the one at the position they claim (read through the plan's own positions)."""
    t = g.tables
    q, k = t.q_pos.long(), t.kv_pos.long()
    qo, kv = t.qo_host.tolist(), t.kv_host.tolist()
    for b in range(len(qo) - 1):
        qb, kb = q[qo[b]:qo[b + 1]], k[kv[b]:kv[b + 1]]
        seen = (kb[None, :] <= qb[:, None]) if t.mask is None else None
        if seen is not None and bool((seen & ~visible(qb, kb, W)).any()):
            return True
    return False


@pytest.mark.parametrize("seed", DRAWS)
@pytest.mark.parametrize("fault", PLAN_FAULTS)
def test_each_plan_fault_acts_on_every_draw(fault: str, seed: int) -> None:
    over, geo = draw(seed)
    w = _world(over, fault)
    clean = _world(over, "none")
    spec = w.cfg.spec
    batch = _verify_batch(w, geo["lens"], spec.num_draft_tokens)
    cbatch = _verify_batch(clean, geo["lens"], spec.num_draft_tokens)
    FAULT_COUNTS.clear()
    try:
        bad = w.backend.init_forward_metadata(batch)
    except (SpaceError, GuardError):  # a guard refused the tables the fault changed
        bad = None
    acted = FAULT_COUNTS[fault]
    assert acted > 0, f"{fault} did not act on {geo}"
    good = clean.backend.init_forward_metadata(cbatch)
    if bad is None:
        return
    swa = [k for k, g in good.groups.items() if g.sub_pool == "swa"]
    assert swa, geo
    changed = False
    for k in swa:
        g0 = good.groups[k]
        g1 = bad.groups.get(k) or next(g for g in bad.groups.values() if g.sub_pool == "swa")
        same = (torch.equal(g0.tables.kv_indices.tensor.long(), g1.tables.kv_indices.tensor.long())
                and torch.equal(g0.tables.q_pos, g1.tables.q_pos)
                and (g0.tables.mask is None) == (g1.tables.mask is None)
                and g1.window == g0.window
                and torch.equal(g0.write_locs.tensor, g1.write_locs.tensor))
        changed |= not same or _reads_outside_window(g1, geo["window"])
    assert changed, f"{fault} acted but the verify's SWA tables are the clean ones on {geo}"


@pytest.mark.parametrize("seed", DRAWS)
def test_the_lookahead_fault_frees_a_key_the_next_verify_reads(seed: int) -> None:
    over, geo = draw(seed)
    cfg = swafactory.validate(swafactory.compose(["backend=torch", "spec=eagle", *over,
                                                  "faults=lookahead_not_retained"]))
    W, P = geo["window"], geo["page"]
    keep = faulty.retained_window_for(cfg)
    assert keep == W - P, geo
    w = World(cfg, size_full=2048, size_swa=1024)
    L = geo["lens"][0]
    w.open(0)
    assert w.slots.extend(0, L) is not None
    w.slots.evict_out_of_window(0, L, keep)
    need = max(0, L - W + 1)  # the oldest key the next verify's first query (at L) reads
    f2s = w.alloc.full_to_swa
    row = w.slots.req_to_token.table[w.slots.reqs[0].row]
    assert int(f2s[row[need]]) == 0, f"{geo}: position {need} kept, so the fault did not act"


@pytest.mark.parametrize("seed", DRAWS)
def test_the_frozen_fp8_fault_drops_the_scales_on_every_draw(seed: int) -> None:
    over, geo = draw(seed)
    cfg = swafactory.validate(swafactory.compose([
        "backend=torch", "spec=frozen_kv_mtp", "backend.kv_dtype=fp8_e4m3", *over,
        "faults=frozen_draft_fp8_unscaled"]))
    from swafactory.kvcache.shares import size_pools
    from swafactory.serving.parts import build_serving

    sv = build_serving(cfg, size_pools(cfg, 2, 256, chunk=64), "cpu", check_mode=False,
                       draft_layout="config")
    FAULT_COUNTS.clear()
    for j in range(cfg.spec.draft_num_layers):
        assert sv.draft._read_scales(j, (0.125, 0.0625)) == {}, geo
    assert FAULT_COUNTS["frozen_draft_fp8_unscaled"] == cfg.spec.draft_num_layers
    assert sv.target._read_scales(0, (0.125, 0.0625)), geo  # the target keeps its own


@pytest.mark.parametrize("seed", DRAWS)
def test_the_graph_draft_extend_fault_reads_full_slots_on_every_draw(seed: int) -> None:
    """Only a draft extend planned for a graph (a capture's or a replay's shape) loses its SWA
    window indices: the same batch planned eagerly keeps them. (Its launch line's EAGLE-3 with
    a window-retained pool serves only GPT-OSS's geometry; a split DFlash pool serves every
    model.)"""
    over, geo = draw(seed)
    k = len(geo["pattern"]) - geo["pattern"].rindex("S")  # the draft mirrors the last layers
    cfg = swafactory.validate(swafactory.compose([
        "backend=torch", "run=generate", "spec=dflash", "spec.draft_weights=random",
        "spec.draft_pool_split=true", f"spec.draft_num_layers={k}", "backend.cuda_graph=true",
        "run.num_layers=null", *over,
        "faults=graph_draft_extend_untranslated"]))  # a split DFlash pool: SWA groups, any model
    from swafactory.kvcache.shares import size_pools
    from swafactory.serving.parts import build_serving

    sv = build_serving(cfg, size_pools(cfg, 2, 512, chunk=64), "cpu", check_mode=True,
                       draft_layout="config")
    L, W, k = geo["lens"][1], geo["window"], 3  # three accepted tokens
    sv.slots.open(0)
    assert sv.slots.extend(0, L + k) is not None
    sv.slots.evict_out_of_window(0, L, W)
    batch = ForwardBatch.of("draft_extend", [ReqForward(0, sv.slots.reqs[0].row, L, k)],
                            sv.slots.req_to_token.table, sv.alloc.full_id)
    FAULT_COUNTS.clear()
    eager = sv.draft.init_forward_metadata(batch)
    assert FAULT_COUNTS["graph_draft_extend_untranslated"] == 0
    swa = [k for k, g in eager.groups.items() if g.sub_pool == "swa"]
    assert swa and all(eager.groups[k].tables.kv_indices.space == "swa" for k in swa), geo
    sv.draft._graph_plan = True  # what a capture's or a replay's `_plan_forward` marks
    graphed = sv.draft._tables(batch, *sv.draft._source())
    assert FAULT_COUNTS["graph_draft_extend_untranslated"] > 0, f"did not act on {geo}"
    assert all(graphed.groups[k].tables.kv_indices.space == "full" for k in swa), geo
