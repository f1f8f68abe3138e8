"""The `kv` check (`harness.kv_check`): a row a forward reads that holds other data than its
request wrote is caught exactly, also where the oracle's tolerance lets it pass; clean forwards
of every kind pass it (the conformance runs elsewhere in the suite run it on every check)."""
from __future__ import annotations

import pytest
import torch

import swafactory
from swafactory.harness.kv_check import StaleKV
from swafactory.harness.world import World

TOL = 2e-2


def _world(extra=()) -> World:
    cfg = swafactory.compose(["model=tiny", "backend=torch", "spec=none", *extra])
    return World(cfg, size_full=4096, size_swa=2048, seed=0)


def _two_requests(w: World, n: int = 40) -> None:
    for rid in (0, 1):
        w.open(rid)
    w.forward("extend", [w.req(0, 0, n), w.req(1, 0, n)], range(6))


def _row(w: World, rid, slot_index: int, layer: int) -> int:
    """The pool row of ``rid``'s token at ``slot_index`` in ``layer``'s sub-pool (SWA layers:
    translated through the allocator's mapping)."""
    full = int(w.slots.req_to_token.table[w.slots.reqs[rid].row, slot_index])
    sub = w.pool.sub_pool(layer)
    return int(w.alloc.mapping.table[full]) if sub.space == "swa" else full


@pytest.mark.parametrize("layer", [2, 1])  # the full layer, an SWA layer
def test_a_nudged_live_row_passes_the_oracle_and_fails_the_kv_check(layer: int) -> None:
    w = _world()
    _two_requests(w)
    k_buf, _, _ = w.pool.get_kv(layer)
    row = _row(w, 1, 35, layer)  # inside the window of the next decode
    k_buf[row, 0, 0] += 0.05  # a small wrong write: one element of one key of 41
    decode = [w.req(0, 40, 1), w.req(1, 40, 1)]
    checks = w.forward("decode", decode, [layer])  # the oracle alone lets it pass
    assert all(c.err <= TOL for c in checks)
    w2 = _world()
    _two_requests(w2)
    w2.pool.get_kv(layer)[0][_row(w2, 1, 35, layer), 0, 0] += 0.05
    with pytest.raises(StaleKV) as e:
        w2.forward("decode", [w2.req(0, 40, 1), w2.req(1, 40, 1)], [layer], kv_tolerance=TOL)
    assert e.value.request == 1 and e.value.layer == layer
    assert "slot index 35" in e.value.detail and "live row" in e.value.detail


@pytest.mark.parametrize("mode", ["decode", "verify_tree", "prefix_only"])
def test_clean_forwards_pass_the_kv_check(mode: str) -> None:
    """Decode, a tree verify (nodes after the prefix in slot order) and FROZEN_KV-style
    prefix-only queries read exactly what their requests wrote; every layer of both groups is
    read in turn (one per group per forward)."""
    w = _world()
    _two_requests(w)
    for step in range(4):
        if mode == "decode":
            reqs = [w.req(r, 40 + step, 1) for r in (0, 1)]
        elif mode == "verify_tree":
            reqs = [w.req(r, 40, 4, parents=(-1, 0, 0, 1)) for r in (0, 1)]
        else:
            reqs = [w.req(r, 40, 2, query_from=1, prefix_only=True) for r in (0, 1)]
        w.forward("decode" if mode == "decode" else "target_verify", reqs, range(6),
                  kv_tolerance=TOL)


def test_a_nan_row_read_is_a_kv_failure_where_the_history_holds_a_value() -> None:
    """A freed (poisoned) row read in place of a live one: NaN there, a value in the history."""
    w = _world()
    _two_requests(w)
    k_buf, _, _ = w.pool.get_kv(2)
    k_buf[_row(w, 0, 3, 2)] = float("nan")  # a freed row: poisoned whole
    with pytest.raises(StaleKV) as e:
        # the oracle sees NaN too, so give it an infinite tolerance to reach the kv check
        w.forward("decode", [w.req(0, 40, 1), w.req(1, 40, 1)], [2], kv_tolerance=float("inf"))
    assert e.value.request == 0 and "slot index 3" in e.value.detail
    assert torch.isnan(k_buf).any()


def test_every_layer_and_head_of_a_group_is_read_in_turn() -> None:
    """One (layer, KV head) pair per group per forward, each pair in turn: a wrong value in one
    head of one SWA layer's row is caught at that pair's forward, not before."""
    w = _world()
    _two_requests(w)
    swa = [0, 1, 3, 4]  # tiny: SSF SSF, 4 KV heads on the SWA layers
    k_buf, _, _ = w.pool.get_kv(3)
    k_buf[_row(w, 1, 39, 3), 2, 5] += 0.05  # layer 3 is the 3rd SWA layer, head 2
    turn_caught = None
    for step in range(16):
        try:
            w.forward("decode", [w.req(r, 40 + step, 1) for r in (0, 1)], swa + [2],
                      kv_tolerance=TOL)
        except StaleKV as e:
            turn_caught = step
            assert (e.layer, e.request) == (3, 1)
            break
    assert turn_caught == 2 + 2 * 4  # layer index 2 of 4 in the group, head 2
