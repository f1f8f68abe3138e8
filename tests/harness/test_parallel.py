"""Tensor parallelism on CPU: heads sharded over gloo ranks, outputs gathered and checked against
the single-process oracle; impossible splits refused by the registry."""
from __future__ import annotations

import pytest

import swafactory
from swafactory.config.paths import group_options
from swafactory.parallel import Shard, shard_config
from swafactory.registry.device import CPU


def test_shards_split_or_replicate_kv_heads() -> None:
    cfg = swafactory.compose(["model=tiny", "parallel.tp=4"])  # 8 q heads; swa 4, full 2 KV heads
    shards = [Shard(r, 4) for r in range(4)]
    assert [s.q_heads(8) for s in shards] == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]
    assert [s.kv_heads(4) for s in shards] == [slice(0, 1), slice(1, 2), slice(2, 3), slice(3, 4)]
    assert [s.kv_heads(2) for s in shards] == [slice(0, 1), slice(0, 1), slice(1, 2), slice(1, 2)]
    for s in shards:  # each rank's query heads read KV heads it holds (GQA group 4 on full)
        q = s.q_heads(8)
        assert {h // 4 for h in range(q.start, q.stop)} == set(range(s.kv_heads(2).start,
                                                                     s.kv_heads(2).stop))
    m = shard_config(cfg, shards[1]).model
    assert (m.num_attention_heads, m.swa.num_kv_heads, m.full.num_kv_heads) == (2, 1, 1)


def test_impossible_splits_are_refused_with_reasons() -> None:
    reasons = swafactory.check(swafactory.compose(["model=tiny", "backend=torch",
                                                   "parallel.tp=3"]), CPU)
    fields = {r.field for r in reasons}
    assert fields == {"parallel.tp", "model.swa.num_kv_heads", "model.full.num_kv_heads"}
    assert swafactory.check(swafactory.compose(["model=tiny", "backend=torch", "parallel.tp=8"]),
                            CPU) == []  # 8 q heads, KV heads replicated


@pytest.mark.parametrize("spec", group_options("spec"))
def test_tp2_gloo_every_spec_matches_the_single_process_oracle(spec: str) -> None:
    r = swafactory.run(swafactory.compose(["backend=torch", "model=tiny", f"spec={spec}",
                                           "parallel.tp=2"]))
    assert r.status == "ok", r.mismatch
    assert r.tp == 2 and len(r.rank_attention_ms) == 2 and r.gather_ms_per_step > 0
    assert r.checks == r.passed > 0 and r.peak_swa_use > 0.9


def test_tp4_with_replicated_kv_heads() -> None:
    r = swafactory.run(swafactory.compose(["backend=torch", "model=tiny", "spec=eagle3",
                                           "parallel.tp=4"]))
    assert r.status == "ok" and r.tp == 4 and r.checks == r.passed > 0
