"""The pools' memory, said before it is taken: `pool_memory` (the console's line before a run
allocates) equals what `build_parts` then holds, and a run that attends a subset of layers gives
rows to those layers only, while every pool and index space is still sized for every layer."""
from __future__ import annotations

import pytest
import torch

import swafactory
from swafactory.harness.setup import attended_layers, build_parts, draws, pool_memory

CASES = [
    ("model=gemma4", "spec=eagle3", "backend=torch"),  # the README's first example
    ("model=gpt_oss_20b", "spec=frozen_kv_mtp", "backend=torch"),  # a FROZEN_KV dummy pool
    ("model=tiny", "spec=dflash", "spec.draft_pool_split=true", "backend=torch"),  # split draft
    ("model=tiny", "spec=eagle", "faults=no_draft_headroom", "backend=torch"),  # a short draft
    ("model=tiny", "spec=none", "backend=auto", "workload.layers=all"),  # every layer, bf16
    ("model=mistral_7b", "spec=eagle", "backend=torch", "workload.num_requests=1",
     "workload.max_running_requests=1"),  # all-SWA: a virtual full space, no full buffers
    ("model=mistral_7b", "spec=none", "backend=torch", "model.hybrid_pool=false",
     "workload.num_requests=1", "workload.max_running_requests=1"),  # the window as a mask
]


def _held(parts) -> tuple[int, int]:
    pools = [parts.pool, parts.draft_pool, parts.swap.dummy if parts.swap else None]
    subs = [sp for p in pools if p is not None for sp in p.sub_pools]
    return sum(sp.held_bytes for sp in subs), sum(sp.bytes for sp in subs)


@pytest.mark.parametrize("overrides", CASES, ids=lambda o: " ".join(o))
def test_the_line_says_what_the_pools_then_hold(overrides) -> None:
    cfg = swafactory.validate(swafactory.compose(list(overrides)))
    said = pool_memory(cfg)
    _, prompts, outs = draws(cfg)
    parts = build_parts(cfg, prompts, outs, "cpu", torch.Generator().manual_seed(0))
    assert (said.held_bytes, said.every_layer_bytes) == _held(parts)
    assert (said.sizes.full, said.sizes.swa) == (parts.sizes.full, parts.sizes.swa)
    assert said.line().startswith("pools will take ")


def test_a_subset_run_holds_rows_for_the_attended_layers_only() -> None:
    cfg = swafactory.validate(swafactory.compose(["model=gemma4", "spec=eagle3",
                                                  "backend=torch", "workload.layers=subset"]))
    layers = attended_layers(cfg)
    assert layers == [53, 57, 58, 59]  # two per layer group, every geometry
    _, prompts, outs = draws(cfg)
    parts = build_parts(cfg, prompts, outs, "cpu", torch.Generator().manual_seed(0))
    for i in range(cfg.model.num_layers):
        k, v, sub = parts.pool.get_kv(i)
        rows = sub.rows if i in layers else 0
        assert k.shape[0] == v.shape[0] == rows, i
    said = pool_memory(cfg)
    assert said.layers_held == 4 and said.held_bytes < said.every_layer_bytes / 10
    assert " (K/V of the 4 attended layers of 60; all 60: " in said.line()


def test_held_layers_are_poisoned_and_moved_and_the_others_refuse_a_read() -> None:
    """Frees poison, and accepted tree paths move, the held layers' rows; a layer without rows
    fails loudly (0 rows: any index is out of range), never reads another layer's data."""
    from swafactory.kvcache.factory import build_pools
    from swafactory.kvcache.locs import Locs
    from swafactory.kvcache.move import move_kv

    cfg = swafactory.validate(swafactory.compose(["model=mistral_7b", "backend=torch",
                                                  "spec=none", "model.hybrid_pool=false"]))
    pool, _ = build_pools(cfg, 16, 0, check_mode=True, layers=[2, 5])
    (sub,) = pool.sub_pools
    assert sub.held == (2, 5) and sub.held_bytes == sub.bytes * 2 // 32
    def slots(*ids: int) -> Locs:
        return Locs(tensor=torch.tensor(ids), space="full", pool_id="target.full")

    kv = torch.ones(2, sub.num_kv_heads, sub.head_dim)
    for layer in (2, 5):
        pool.write(layer, slots(3, 4), kv, 2 * kv)
    move_kv(pool, slots(3, 4), slots(7, 8))
    assert torch.equal(pool.read(5, slots(7, 8))[1], 2 * kv)
    sub.poison(torch.tensor([3, 4]))  # what an allocator's free does
    assert torch.isnan(pool.read(2, slots(3, 4))[0]).all()
    assert pool.get_kv(0)[0].shape[0] == 0
    with pytest.raises(IndexError):
        pool.read(0, slots(7))
    with pytest.raises(ValueError, match="not layers of mistral_7b"):
        build_pools(cfg, 16, 0, layers=[32])
