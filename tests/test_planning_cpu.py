"""The vectorized planner on CPU: its tables equal a per-request reference for mixed batches,
its device work does not grow with the batch, and the slot bookkeeping reads back once per call.

Timings and the device-op counts are bench/bench_planning.py's; here ops are only counted."""
from __future__ import annotations

import os
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from swafactory.kvcache.allocator import SWAAllocator
from swafactory.kvcache.pool import HybridSWAPool, KVPool, ReqToToken
from swafactory.kvcache.requests import RequestSlots
from swafactory.metadata.batch import ForwardBatch, ReqForward
from swafactory.metadata.plan import plan
from swafactory.resolve.source import KVSource

TREE8 = (-1, 0, 0, 1, 1, 2, 2, 3)
LAYERS = {0: ("swa", 0), 1: ("full", 0), 2: ("swa", 0)}


_VIEWS = {"view", "slice", "select", "unsqueeze", "alias", "detach", "reshape", "expand",
          "lift_fresh", "_unsafe_view", "as_strided", "unbind", "t"}


class _Count(TorchDispatchMode):
    """aten ops issued under it: ``ops`` (views excluded) and ``names``."""

    def __init__(self) -> None:
        super().__init__()
        self.names: dict[str, int] = {}
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.names[name] = self.names.get(name, 0) + 1
        self.ops += name not in _VIEWS
        return func(*args, **(kwargs or {}))


def _world(bs: int, ctx: int, nodes: int, P: int = 1, seed: int = 0, device: str = "cpu"):
    size = bs * (-(-(ctx + nodes) // P) + 1) * P
    alloc = SWAAllocator(size, size, P, device)
    alloc.shuffle(torch.Generator().manual_seed(seed))
    pool = HybridSWAPool(KVPool(alloc.full.size, P, 1, 1, 4, torch.float32, device),
                         KVPool(alloc.swa.size, P, 1, 1, 4, torch.float32, device,
                                pool_id="target.swa", space="swa"),
                         {0: ("swa", 0), 1: ("full", 0)})
    pool.register_mapping(alloc.mapping)
    slots = RequestSlots(alloc, ReqToToken(bs, ctx + nodes + P, device))
    for rid in range(bs):
        slots.open(rid)
        slots.extend(rid, ctx + nodes)
    return alloc, pool, slots


def _ops(bs: int, nodes: int, parents, windows) -> int:
    alloc, pool, slots = _world(bs, 40, nodes)
    reqs = [ReqForward(r, slots.reqs[r].row, 40, nodes, parents=parents) for r in range(bs)]
    batch = ForwardBatch.of("target_verify", reqs, slots.req_to_token.table, alloc.full_id)
    source = KVSource(pool, alloc.mapping, "test")
    plan(batch, LAYERS, windows, source)  # first use of a step shape builds its tables
    with _Count() as c:
        plan(batch, LAYERS, windows, source)
    return c.ops


@pytest.mark.parametrize("nodes,parents,bound", [(1, None, 70), (8, None, 70), (8, TREE8, 110)])
def test_ops_per_forward_do_not_grow_with_the_batch(nodes, parents, bound) -> None:
    """Host and device ops together (on CPU both are CPU ops): none per request, and fewer
    than the planner that built each group on its own (78 / 220 here, 63 / 99 now; of these
    ~20 would run on a GPU: bench_planning counts device ops)."""
    windows = {0: 16, 1: None, 2: 16}  # two groups: the windowed one's starts differ
    small, large = (_ops(bs, nodes, parents, windows) for bs in (2, 24))
    assert small == large <= bound


def test_groups_with_the_same_window_starts_share_one_key_list() -> None:
    alloc, pool, slots = _world(3, 30, 1)
    reqs = [ReqForward(r, slots.reqs[r].row, 30, 1) for r in range(3)]
    batch = ForwardBatch.of("decode", reqs, slots.req_to_token.table, alloc.full_id)
    fp = plan(batch, {0: ("full", 0), 1: ("full", 0)}, {0: 1000, 1: None},
              KVSource(pool, alloc.mapping, "test"))
    a, b = fp.groups["full/w1000"].tables, fp.groups["full"].tables
    assert a is not b and a.kv_indices.tensor is b.kv_indices.tensor  # a window past every ctx
    assert a.qo_indptr.dtype == a.kv_pos.dtype == torch.int32 and a.kv_pos.is_contiguous()


def _reference(batch: ForwardBatch, window, need_mask: bool):
    """Per request, straight from the definitions: (slots, kv_pos, q_pos, writes, mask)."""
    table, out = batch.req_to_token, ([], [], [], [], [])
    for r in batch.reqs:
        d = r.depths
        first_q = r.prefix_len + min(d[r.query_from:])
        start = 0 if window is None else min(r.prefix_len, max(0, first_q - window + 1))
        out[0].append(table[r.row, start:r.kv_end].long())
        nodes = [r.prefix_len + x for x in d][:r.kv_end - r.prefix_len]
        out[1].append(torch.tensor(list(range(start, r.prefix_len)) + nodes, dtype=torch.int32))
        out[2].append(torch.tensor([r.prefix_len + x for x in d[r.query_from:]],
                                   dtype=torch.int32))
        out[3].append(table[r.row, r.prefix_len + r.query_from:r.prefix_len + r.nodes].long())
        if need_mask:
            sm = r.node_structure()
            if sm is None:
                sm = torch.ones(r.nodes, r.nodes, dtype=torch.bool).tril()[r.query_from:]
            pre = torch.ones(r.q_len, r.prefix_len - start, dtype=torch.bool)
            out[4].append(torch.cat([pre, sm], 1).reshape(-1))
    return [torch.cat(x) if x else None for x in out]


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("seed", range(6))
def test_tables_equal_a_per_request_reference_for_mixed_batches(seed: int, impl: str) -> None:
    """Both ways of building the key lists: torch ops (CPU, and GPUs without triton) and the
    fused Triton kernel (on a GPU when there is one, else under the interpreter)."""
    device = "cpu"
    if impl == "triton":
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") != "1":
            if not torch.cuda.is_available():
                pytest.skip("the fused kernel needs a GPU or TRITON_INTERPRET=1")
            device = "cuda"
    rng = random.Random(seed)
    P = rng.choice([1, 4])
    alloc, pool, slots = _world(10, 50, 8, P, seed, device)
    reqs = []
    for r in range(rng.randrange(1, 11)):
        n, kw = rng.randrange(1, 9), {}
        kind = rng.choice(["chain", "tree", "block", "prefix_only", "draft"])
        if kind == "tree":
            kw["parents"] = tuple([-1] + [rng.randrange(-1, i) for i in range(1, n)])
        kw.update(block=kind == "block", prefix_only=kind == "prefix_only")
        if kind in ("draft", "prefix_only", "tree"):
            kw["query_from"] = rng.randrange(0, n) if kind != "prefix_only" else n - 1
        reqs.append(ReqForward(r, slots.reqs[r].row, rng.randrange(0, 50), n, **kw))
    batch = ForwardBatch.of("target_verify", reqs, slots.req_to_token.table, alloc.full_id)
    windows = {0: rng.choice([1, 5, 20]), 1: None, 2: 1000}
    source = KVSource(pool, alloc.mapping, "test")
    fp = plan(batch, LAYERS, windows, source, impl=impl)
    for layer in LAYERS:
        g = fp.group(layer)
        slots_, kv_pos, q_pos, writes, mask = _reference(batch, windows[layer], batch.needs_mask)
        t = g.tables
        if g.sub_pool == "swa":
            slots_, writes = alloc.full_to_swa[slots_], alloc.full_to_swa[writes]
        slots_, writes = slots_.cpu(), writes.cpu()
        assert torch.equal(t.kv_indices.tensor.cpu(), slots_)
        assert torch.equal(t.kv_pos.cpu(), kv_pos) and torch.equal(t.q_pos.cpu(), q_pos)
        assert torch.equal(g.write_locs.tensor.cpu(), writes)
        assert torch.equal(t.kv_host, t.kv_indptr.cpu()) and int(t.kv_host[-1]) == len(slots_)
        if impl == "triton":  # the kernel writes the int32 rows FlashInfer indexes with too
            assert torch.equal(t.kv_indices_i32.cpu(), slots_.to(torch.int32))
        else:
            assert t.kv_indices_i32 is None
        assert (t.mask is None) == (mask is None)
        if mask is not None:
            assert torch.equal(t.mask.cpu(), mask.cpu()) and int(t.mask_indptr[-1]) == mask.numel()


def _fused_or_skip() -> str:
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        if not torch.cuda.is_available():
            pytest.skip("the fused kernel needs a GPU or TRITON_INTERPRET=1")
        return "cuda"
    return "cpu"


@pytest.mark.parametrize("seed", range(4))
def test_fused_missing_slot_word_names_what_the_tables_check_names(seed: int) -> None:
    """The guards' missing-slot word that the fused key-list launch computes as it gathers
    (`guards.missing_check`, a GPU's) names the same request, row and position as the check
    reduced from the torch planner's tables (`guards.slot_check`): one hole in one request's
    row, at a prefix key or a step node; none in a clean batch."""
    from swafactory.guards import NO_MISS, missing_check, slot_check

    device = _fused_or_skip()
    rng = random.Random(seed)
    alloc, pool, slots = _world(6, 40, 8, 1, seed, device)
    reqs = []
    for r in range(rng.randrange(2, 7)):
        n, kw = rng.randrange(1, 9), {}
        if rng.random() < 0.5:
            kw["parents"] = tuple([-1] + [rng.randrange(-1, i) for i in range(1, n)])
        reqs.append(ReqForward(r, slots.reqs[r].row, rng.randrange(1, 40), n, **kw))
    table = slots.req_to_token.table
    windows = {0: rng.choice([1, 5, 20]), 1: None, 2: 1000}
    source = KVSource(pool, alloc.mapping, "test")

    def both():
        batch = ForwardBatch.of("target_verify", reqs, table, alloc.full_id)
        fused = plan(batch, LAYERS, windows, source, impl="triton")
        ref = plan(batch, LAYERS, windows, source, impl="torch")
        assert fused.missing is not None and ref.missing is None
        g = ref.group(1)  # the full group: every request's whole read range
        qo = g.tables.qo_host
        a = missing_check(batch, fused.missing.word, fused.missing.lists, qo).error()
        b = slot_check(batch, g.tables.kv_indices.tensor, g.tables.kv_host,
                       g.write_locs.tensor, qo).error()
        return fused, a, b

    fused, a, b = both()
    assert a is None and b is None and fused.missing.word.tolist() == [NO_MISS, NO_MISS]
    r = rng.choice(reqs)
    col = rng.randrange(0, r.prefix_len + r.nodes)  # a prefix key or one of the step's nodes
    table[r.row, col] = 0
    _, a, b = both()
    assert a is not None and b is not None and str(a) == str(b), (str(a), str(b))
    assert f"request {r.rid!r} (row {r.row}) reads position {col} " in str(a)


@pytest.mark.parametrize("seed", range(3))
def test_cascade_split_equals_a_per_request_reference(seed: int) -> None:
    """The cascade's prefix pass is each request's committed keys (no mask), its expand pass
    the step's nodes with their structure columns: checked request by request."""
    rng = random.Random(seed)
    alloc, pool, slots = _world(8, 50, 8, 1, seed)
    reqs = [ReqForward(0, slots.reqs[0].row, rng.randrange(0, 50), 8, parents=TREE8)]
    for r in range(1, rng.randrange(2, 8)):
        kind = rng.choice(["tree", "chain", "prefix_only"])
        kw = dict(parents=TREE8) if kind == "tree" else dict(
            query_from=7, prefix_only=True) if kind == "prefix_only" else {}
        reqs.append(ReqForward(r, slots.reqs[r].row, rng.randrange(0, 50), 8, **kw))
    batch = ForwardBatch.of("target_verify", reqs, slots.req_to_token.table, alloc.full_id)
    windows = {0: rng.choice([1, 5, 20]), 1: None, 2: 1000}
    fp = plan(batch, LAYERS, windows, KVSource(pool, alloc.mapping, "test"), cascade=True)
    for layer in LAYERS:
        g = fp.group(layer)
        pre_t, exp_t = g.cascade
        t = g.tables
        kvh, qoh = t.kv_host.tolist(), t.qo_host.tolist()
        pre_rows, exp_rows, exp_mask, m0 = [], [], [], 0
        for b, r in enumerate(reqs):
            n, q = kvh[b + 1] - kvh[b], qoh[b + 1] - qoh[b]
            p = n - (0 if r.prefix_only else r.nodes)  # committed keys of request b
            pre_rows += range(kvh[b], kvh[b] + p)
            exp_rows += range(kvh[b] + p, kvh[b + 1])
            exp_mask.append(t.mask[m0:m0 + q * n].view(q, n)[:, p:].reshape(-1))
            m0 += q * n
        for part, rows in ((pre_t, pre_rows), (exp_t, exp_rows)):
            rows = torch.tensor(rows, dtype=torch.long)
            assert torch.equal(part.kv_indices.tensor, t.kv_indices.tensor[rows])
            assert part.kv_indices.space == t.kv_indices.space
            assert torch.equal(part.kv_pos, t.kv_pos[rows]) and torch.equal(part.q_pos, t.q_pos)
            assert torch.equal(part.kv_host, part.kv_indptr) and int(part.kv_host[-1]) == len(rows)
        assert pre_t.mask is None and torch.equal(exp_t.mask, torch.cat(exp_mask))
        assert int(exp_t.mask_indptr[-1]) == exp_t.mask.numel()


def test_a_row_past_the_table_is_refused_by_name() -> None:
    alloc, pool, slots = _world(2, 10, 1)
    batch = ForwardBatch.of("decode", [ReqForward("r9", 7, 10, 1)], slots.req_to_token.table,
                            alloc.full_id)
    with pytest.raises(IndexError, match="'r9': row 7"):
        plan(batch, LAYERS, {0: 4, 1: None, 2: 4}, KVSource(pool, alloc.mapping, "test"))


def _scalar_reads(fn) -> int:
    with _Count() as c:
        fn()
    return c.names.get("_local_scalar_dense", 0) + c.names.get("_to_copy", 0)


def test_slot_bookkeeping_reads_back_once_per_call_not_once_per_request() -> None:
    reads = []
    for bs in (2, 12):
        alloc, pool, slots = _world(bs, 9, 0, P=4)
        rids = list(range(bs))
        reads.append((_scalar_reads(lambda: slots.decode(rids)),
                      _scalar_reads(lambda: slots.extend_batch(rids, [3] * bs)),
                      _scalar_reads(slots.held_pages)))
        assert all(v == 0 for v in slots.leaks().values())
    assert reads[0] == reads[1]  # per-request `int(table[row, last])` reads grew with bs
