"""A forward that reads a freed or unwritten slot, in the full space or the SWA space, raises
`MissingSlotError` naming the request, the position, the space and how it got there (issue 64,
rows 2, 3, 4 and 7), driven as the embedding guide's engine does: `build_pools` in check mode,
`RequestSlots`, `build_backend`, `ForwardBatch`, `forward` per layer, `raise_pending`.

On CPU a check raises where it is made (planning, or the first layer's forward); ``deferred``
runs patch `guards.defers` so that, as on CUDA, every check waits for `raise_pending`. The
checks' construction reads nothing on the host (`test_the_checks_read_nothing_back`)."""
from __future__ import annotations

import pytest
import torch

import swafactory
from swafactory import guards
from swafactory.backend import slot_guard
from swafactory.backend.slot_guard import changed, swa_holes, unwritten
from swafactory.guards import GuardError, MissingSlotError
from swafactory.kvcache import ReqToToken, RequestSlots, size_pools
from swafactory.kvcache.factory import build_pools
from swafactory.metadata import ForwardBatch, ReqForward

PROMPT = {"a": 40, "b": 29}  # prefilled, then evicted at L: "a" keeps positions 25.. (W = 16)


class Engine:
    """The guide's engine on `model=tiny` (sliding, sliding, full ×2, W = 16), pools in check
    mode: two requests prefilled and evicted at their committed lengths."""

    def __init__(self, page: int = 1, guards_on: bool = True) -> None:
        self.cfg = swafactory.validate(swafactory.compose(
            ["model=tiny", "backend=torch", "spec=none", f"backend.page_size={page}"]))
        self.m, self.W = self.cfg.model, self.cfg.model.sliding_window
        sizes = size_pools(self.cfg, max_requests=3, max_context=80, chunk=16)
        self.pool, self.alloc = build_pools(self.cfg, sizes.full, sizes.swa, check_mode=True)
        self.backend = swafactory.build_backend(self.cfg, pools=self.pool, guards=guards_on)
        self.book = RequestSlots(self.alloc, ReqToToken(3, sizes.full_per_request))
        self.L = dict(PROMPT)
        for rid, n in PROMPT.items():
            self.book.open(rid)
            self.book.extend(rid, n)
        self.forward("extend", [self.req(rid, 0, n) for rid, n in PROMPT.items()])
        for rid in PROMPT:
            self.book.evict_out_of_window(rid, self.L[rid], self.W)

    def req(self, rid, prefix: int, nodes: int = 1, row: int | None = None) -> ReqForward:
        return ReqForward(rid, self.book.reqs[rid].row if row is None else row, prefix, nodes)

    def layers(self):
        m = self.m
        for i, t in enumerate(m.layer_types):
            geo = m.swa if t == "sliding_attention" else m.full
            yield i, geo.num_kv_heads, geo.head_dim

    def forward(self, mode: str, reqs, *, between=None, save_kv: bool = True):
        """Plan, run ``between`` (the user's step between planning and forward), run every
        layer, then the engine's sync point; the outputs."""
        batch = ForwardBatch.of(mode, reqs, self.book.req_to_token.table, self.alloc.full_id)
        self.backend.init_forward_metadata(batch)
        if between is not None:
            between()
        n, outs = sum(r.q_len for r in reqs), []
        for layer, hkv, d in self.layers():
            q = torch.randn(n, self.m.num_attention_heads, d)
            k, v = torch.randn(n, hkv, d), torch.randn(n, hkv, d)
            outs.append(self.backend.forward(q, k, v, layer, save_kv=save_kv))
        self.backend.raise_pending()
        return outs

    def decode(self, **kw):
        """One decode step of both requests (positions L allocated first)."""
        self.book.decode(list(self.L))
        return self.forward("decode", [self.req(rid, self.L[rid]) for rid in self.L], **kw)


@pytest.fixture(params=["at_once", "deferred"])
def deferred(request, monkeypatch) -> bool:
    if request.param == "deferred":  # as on CUDA: every device check waits for raise_pending
        monkeypatch.setattr(guards, "defers", lambda word: True)
    return request.param == "deferred"


def _raised(fn) -> MissingSlotError:
    with pytest.raises(MissingSlotError) as info:
        fn()
    return info.value


def _says(err: MissingSlotError, *fragments: str) -> None:
    for f in fragments:
        assert f in str(err), (f, str(err))


def test_a_correct_engine_is_accepted(deferred: bool, monkeypatch) -> None:
    """Decode steps evicting at L (the boundary), a request finished between planning and a
    forward it is not part of, and save_kv=False over K/V written first: nothing raises, and
    check mode shows no NaN (no freed or unwritten row was read)."""
    rechecks = []
    monkeypatch.setattr(slot_guard, "changed",
                        lambda *a, real=slot_guard.changed: rechecks.append(a) or real(*a))
    e = Engine()
    for _ in range(3):
        outs = e.decode()
        assert not any(o.isnan().any() for o in outs)
        for rid in e.L:
            e.L[rid] += 1
            e.book.evict_out_of_window(rid, e.L[rid], e.W)
    e.book.open("c")
    e.book.extend("c", 4)
    e.book.decode(["a"])  # the books freed rows after planning; the plan's slots are intact
    outs = e.forward("decode", [e.req("a", e.L["a"])], between=lambda: e.book.finish("c"))
    assert not any(o.isnan().any() for o in outs) and len(rechecks) == 1  # only after a free
    e.book.decode(["b"])  # save_kv=False over K/V the engine stored itself (write_kv)
    batch = ForwardBatch.of("decode", [e.req("b", e.L["b"])], e.book.req_to_token,
                            e.alloc.full_id)
    e.backend.init_forward_metadata(batch)
    for layer, hkv, d in e.layers():
        e.backend.write_kv(layer, torch.randn(1, hkv, d), torch.randn(1, hkv, d))
        out = e.backend.forward(torch.randn(1, 8, d), None, None, layer, save_kv=False)
        assert not out.isnan().any()
    e.backend.raise_pending()


def test_row2_a_request_finished_after_planning(deferred: bool) -> None:
    """Plan, then `book.finish("b")`, then forward: b's slots are free (its K/V would land in
    them); raised naming b, the position, the space and the finish."""
    e = Engine()
    err = _raised(lambda: e.decode(between=lambda: e.book.finish("b")))
    assert (err.request, err.cause, err.access) == ("b", "finished", "reads")
    _says(err, "decode: request 'b' (row 1) reads position 0", "in full space 'target.full'",
          "request 'b' was finished (RequestSlots.finish) after this forward was planned",
          "plan the batch again without it")


def test_row2_a_finished_request_planned_again_is_named() -> None:
    """The same request planned after its finish: the full-space check names the finish."""
    e = Engine()
    row = e.book.reqs["b"].row
    e.book.finish("b")
    err = _raised(lambda: e.forward("decode", [e.req("b", 29, row=row)]))
    assert (err.request, err.position, err.cause) == ("b", 0, "finished")
    _says(err, "in full space 'target.full'", "request 'b' was finished (RequestSlots.finish)")


@pytest.mark.parametrize("when", ["before_planning", "after_planning"])
def test_row3_evicting_one_position_too_far(when: str, deferred: bool) -> None:
    """`evict_out_of_window("a", 41, …)` after the decode's allocation (the committed length is
    40): position 25, which the query at 40 still sees, loses its SWA slot."""
    e = Engine()
    too_far = lambda: e.book.evict_out_of_window("a", 41, e.W)  # noqa: E731
    if when == "before_planning":
        e.book.decode(list(e.L))
        too_far()
        err = _raised(lambda: e.forward("decode", [e.req(r, e.L[r]) for r in e.L]))
    else:
        err = _raised(lambda: e.decode(between=too_far))
    assert (err.request, err.position, err.space, err.cause) == ("a", 25, "target.swa",
                                                                 "evicted")
    _says(err, "decode: request 'a' (row 0) reads position 25", "in SWA space 'target.swa'",
          "evict_out_of_window freed its SWA slot", "SWA frontier is at 26",
          "query at position 40 sees positions from 25 (window 16)", "at most 40 here")
    assert ("after this forward was planned" in str(err)) == (when == "after_planning")


@pytest.mark.parametrize("page", [1, 4])
def test_row4_save_kv_false_over_a_never_written_position(page: int, deferred: bool) -> None:
    """A decode with save_kv=False whose token was never written: its query reads its own
    position (NaN in check mode; with pages, the zeros a fresh page is handed out with)."""
    e = Engine(page=page)
    err = _raised(lambda: e.decode(save_kv=False))
    assert (err.request, err.position, err.cause) == ("a", 40, "never_written")
    _says(err, "decode: request 'a' (row 0) reads position 40", "in SWA space 'target.swa'",
          "never written", "save_kv=False", "Pass save_kv=True")


@pytest.mark.parametrize("lengths", ["different", "equal"])
def test_row7_rows_swapped_between_requests(lengths: str) -> None:
    """Two requests given each other's rows: named as a swap (not "allocate more"), whatever
    their lengths, before anything is planned or written."""
    e = Engine()
    if lengths == "equal":
        e.book.extend("b", 11)
        e.forward("extend", [e.req("b", 29, 11)])
        e.L["b"] = 40
    rows = {rid: e.book.reqs[rid].row for rid in e.L}
    e.book.decode(list(e.L))
    before = [b.clone() for sp in e.pool.sub_pools for b in sp.k_bufs]
    with pytest.raises(GuardError) as info:
        e.forward("decode", [e.req("a", e.L["a"], row=rows["b"]),
                             e.req("b", e.L["b"], row=rows["a"])])
    assert isinstance(info.value, ValueError) and not isinstance(info.value, MissingSlotError)
    _says(info.value, "request 'a' is given req_to_token row 1",
          "holds request 'a' at row 0 and row 1 for request 'b'",
          "the rows of 'a' and 'b' are swapped", "book.reqs[rid].row")
    after = [b for sp in e.pool.sub_pools for b in sp.k_bufs]
    assert all(torch.equal(x.nan_to_num(), y.nan_to_num()) for x, y in zip(before, after))


def test_row7_requests_the_book_does_not_know_are_not_flagged() -> None:
    """An engine whose request ids are not the book's keys: its rows are its own business."""
    e = Engine()
    e.book.decode(["a"])
    outs = e.forward("decode", [ReqForward("engine-7", e.book.reqs["a"].row, 40, 1)])
    assert not any(o.isnan().any() for o in outs)


def test_guards_off_check_nothing() -> None:
    """``guards=False`` runs none of these checks (the user's NaN shows instead)."""
    e = Engine(guards_on=False)
    outs = e.decode(between=lambda: e.book.evict_out_of_window("a", 41, e.W))
    assert outs[0].isnan().any()


class _OnDevice(torch.Tensor):
    """A device tensor whose values the host may not read (each read a sync on a GPU)."""

    READS = {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__",
             "nonzero", "argwhere", "masked_select", "unique"}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in cls.READS or (
                getattr(func, "__name__", "") == "repeat_interleave"
                and kwargs.get("output_size") is None):
            raise AssertionError(f"{func.__name__} read a device tensor on the host")
        return super().__torch_function__(func, types, args, kwargs)


def test_the_checks_read_nothing_back() -> None:
    """Building the SWA-hole, changed-since-planning and unwritten checks over device tensors
    that refuse host reads raises nothing: their words are read at `raise_pending` only."""
    e = Engine()
    e.book.decode(list(e.L))
    batch = ForwardBatch.of("decode", [e.req(r, e.L[r]) for r in e.L],
                            e.book.req_to_token.table, e.alloc.full_id)
    fplan = e.backend.init_forward_metadata(batch)
    dev = lambda t: t.as_subclass(_OnDevice)  # noqa: E731
    smap = e.pool.mapping
    for g in fplan.groups.values():  # the plan's lists and the books' tables, "on the device"
        object.__setattr__(g.tables.kv_indices, "tensor", dev(g.tables.kv_indices.tensor))
    wrapped = ForwardBatch.of("decode", batch.reqs, dev(e.book.req_to_token.table),
                              e.alloc.full_id)
    mapping = smap.table
    object.__setattr__(smap, "table", dev(mapping))
    try:
        checks = [swa_holes(wrapped, fplan), changed(wrapped, fplan, e.pool),
                  unwritten(wrapped, fplan.group(0).tables.qo_host, 0,
                            dev(e.pool.swa.k_bufs[0]), dev(fplan.group(0).write_locs.tensor),
                            e.pool.swa)]
    finally:
        object.__setattr__(smap, "table", mapping)
    holes, moved, unsaved = (c.explain(c.word.as_subclass(torch.Tensor).tolist())
                             for c in checks)  # what raise_pending reads
    assert holes is None and moved is None  # a clean plan, the books unchanged since
    assert unsaved is not None and (unsaved.request, unsaved.position) == ("a", 40)
