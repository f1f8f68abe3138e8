"""The guards' slot checks in every index space, a base of `AttentionBackend`: a forward that
reads or writes a position with no live slot, full or SWA, raises `MissingSlotError` naming the
request, the position, the space and how it got there (`slot_causes`).

Each check is a `guards.DeviceCheck` (read at once on CPU, at `raise_pending` on CUDA: no host
sync), and each runs where the slots it checks are final:

* **planning** (`_check_slots`): full-space holes (`guards.missing_check` / `slot_check`) and,
  joined into the same word, SWA-space holes: an SWA key list's 0 (a full slot whose full→SWA
  mapping entry is 0: evicted past the window). One min per distinct SWA list. Rows swapped
  between requests are named on the host first (`slot_causes.swapped_rows`);
* **the first layer's forward**, only when the pools freed rows since planning (`KVPool.freed`,
  a host int the allocator bumps): the plan's slots against the books now (`changed`), for a
  request finished, or evicted past the window, between planning and forward;
* **a ``save_kv=False`` forward in check mode**, once per layer group: the rows of its own nodes
  it reads must hold K/V (`unwritten`: NaN, or a fresh page's zeros, is never written).

Uses `core.AttentionBackend`'s attributes (``_plan``, ``_pool``, ``_checked``, ``_graphed``,
``_writes``, ``_defer``)."""
from __future__ import annotations

import torch

from swafactory.backend.slot_causes import hole_error, refined, slot_error, swapped_rows
from swafactory.guards import DeviceCheck, _request_of, missing_check, slot_check
from swafactory.kvcache.pool import host_to_device
from swafactory.kvcache.requests import books_of

__all__ = ["SlotGuards", "joined", "swa_holes", "changed", "unwritten"]


def _frees(pool) -> int:
    return sum(p.freed for p in pool.sub_pools)


class SlotGuards:
    """The slot checks of a guarded backend (module docstring)."""

    _guarded: tuple | None = None
    """(plan, batch, the pools' frees at planning) of the last plan the guards checked."""

    def _check_slots(self, batch, fplan, pool) -> None:
        """The planning checks of ``fplan`` over ``pool``: swapped rows (host), then full- and
        SWA-space holes in one word, read now where that is free (CPU), else kept for
        `raise_pending` (no sync here)."""
        book = books_of(batch.req_to_token)
        if book is not None:
            err = swapped_rows(batch, book)
            if err is not None:
                raise err
        qo_host = next(iter(fplan.groups.values())).tables.qo_host
        if fplan.missing is not None:  # a GPU: the fused planner's word (no launch of its own)
            full = missing_check(batch, fplan.missing.word, fplan.missing.lists, qo_host)
        else:  # the plan's full-space tables reduced on the device
            reads = writes = None
            for g in fplan.groups.values():
                t = g.tables
                if t.kv_indices.space == "full" and (reads is None or g.window is None):
                    reads = t  # an unwindowed full list covers every request's read range
                if writes is None and g.write_locs is not None and g.write_locs.space == "full":
                    writes = g.write_locs.tensor
            full = slot_check(batch, None if reads is None else reads.kv_indices.tensor,
                              None if reads is None else reads.kv_host, writes, qo_host)
        check = joined(full, swa_holes(batch, fplan))
        inner = check.explain
        check.explain = lambda w: refined(inner(w), batch)  # the book's cause, on error only
        self._defer(check)
        self._guarded = (fplan, batch, _frees(pool))

    def _check_layer(self, layer_id: int, g, sub, pair: tuple[str, str]) -> None:
        """`LayerPath._check_layer`, and at a forward's first layer the plan's slots against
        the books when the pools freed rows since planning (a host int compare otherwise)."""
        snap = self._guarded
        if not self._checked and snap is not None and snap[0] is self._plan \
                and not self._graphed:
            now = _frees(self._pool)
            if now != snap[2]:
                self._guarded = (snap[0], snap[1], now)  # once per free, not per forward
                self._defer(changed(snap[1], self._plan, self._pool))
        super()._check_layer(layer_id, g, sub, pair)

    def _unsaved(self, layer_id: int, e) -> None:
        """A ``save_kv=False`` forward of a plan that writes: in check mode its queries' own
        rows must hold K/V stored before (once per layer group and sub-pool)."""
        self._checked.add(e.wpair)
        idx = self._writes[e.key][0]
        snap = self._guarded
        if (idx is None or not e.sub.check_mode or self._graphed or snap is None
                or snap[0] is not self._plan or self.view.role == "draft_reads_target"):
            return  # (a FROZEN_KV reader writes nothing by contract: save_kv=False is its call)
        qo_host = self._plan.groups[e.key].tables.qo_host
        self._defer(unwritten(snap[1], qo_host, layer_id, e.k_buf, idx, e.sub))


def joined(*checks: DeviceCheck | None) -> DeviceCheck | None:
    """One check of several words (one copy and one event on CUDA): the first error of the
    checks in order."""
    checks = [c for c in checks if c is not None]
    if len(checks) < 2:
        return checks[0] if checks else None
    sizes = [c.word.numel() for c in checks]
    word = torch.cat([c.word.reshape(-1).long() for c in checks])

    def explain(w: list[int]):
        at = 0
        for c, n in zip(checks, sizes):
            err = c.explain(w[at:at + n])
            if err is not None:
                return err
            at += n
        return None
    return DeviceCheck(word, explain)


def swa_holes(batch, fplan) -> DeviceCheck | None:
    """The SWA key lists' holes: an entry 0 (a full slot mapped to no SWA slot). Each distinct
    list: its min (CPU), or its min and that min's first index (CUDA, read late)."""
    lists, seen = [], set()
    for g in fplan.groups.values():
        locs = g.tables.kv_indices
        t = locs.tensor
        if locs.space == "swa" and id(t) not in seen and t.numel():
            seen.add(id(t))
            lists.append((t, g.tables.kv_host, g.window, locs.pool_id))
    if not lists:
        return None
    cuda = lists[0][0].is_cuda
    if cuda:
        word = torch.cat([x.view(1) for t, *_ in lists for x in t.min(0)])
    else:
        word = torch.stack([t.min() for t, *_ in lists])

    def explain(w: list[int]):
        for i, (t, host, window, space) in enumerate(lists):
            if (w[2 * i] if cuda else w[i]) != 0:
                continue
            k = w[2 * i + 1] if cuda else int((t == 0).nonzero()[0, 0])
            ptr = host.tolist()
            b = _request_of(ptr, k)
            col = batch.reqs[b].kv_end - (ptr[b + 1] - ptr[b]) + (k - ptr[b])
            return hole_error(batch, b, col, "reads", space, "SWA", window)
        return None
    return DeviceCheck(word, explain)


def changed(batch, fplan, pool) -> DeviceCheck | None:
    """The plan's slots against the books now: each distinct key list and write list gathered
    again from ``req_to_token`` (and, for an SWA list, the full→SWA mapping); the first slot
    that differs per list. Only when the pools freed rows since planning."""
    table = batch.req_to_token
    mapping = pool.mapping.table if pool.mapping is not None else None
    lists, seen = [], set()
    for access in ("reads", "writes"):
        for kind in ("full", "swa"):
            for g in fplan.groups.values():
                t = g.tables
                locs, ptr = (t.kv_indices, t.kv_host) if access == "reads" else (g.write_locs,
                                                                                 t.qo_host)
                if (locs is None or locs.space != kind or id(locs.tensor) in seen
                        or not locs.tensor.numel() or (kind == "swa" and mapping is None)):
                    continue
                seen.add(id(locs.tensor))
                lists.append((locs, ptr.tolist(), access, g.window))
    if not lists:
        return None
    dev, B = table.device, len(batch.reqs)
    firsts, nows, starts = [], [], []
    for locs, ptr, access, _ in lists:
        lens = [ptr[b + 1] - ptr[b] for b in range(B)]
        st = [r.kv_end - n if access == "reads" else r.prefix_len + r.query_from
              for r, n in zip(batch.reqs, lens)]
        d = host_to_device(torch.tensor([r.row for r in batch.reqs] + ptr[:-1] + st + lens,
                                        dtype=torch.int64), dev)
        total = ptr[-1]
        b = torch.repeat_interleave(torch.arange(B, device=dev), d[3 * B:], output_size=total)
        at = torch.arange(total, device=dev)
        now = table[d[:B][b], d[2 * B:3 * B][b] + at - d[B:2 * B][b]].long()
        if locs.space == "swa":
            now = mapping[now]
        firsts.append(torch.where(now != locs.tensor, at, total).min())
        nows.append(now)
        starts.append(st)

    def explain(w: list[int]):
        for (locs, ptr, access, window), k, now, st in zip(lists, w, nows, starts):
            if k >= ptr[-1]:
                continue
            b = _request_of(ptr, k)
            kind = "full" if locs.space == "full" else "SWA"
            return hole_error(batch, b, st[b] + k - ptr[b], access, locs.pool_id, kind, window,
                              since_plan=True, now=int(now[k]))
        return None
    return DeviceCheck(torch.stack(firsts), explain)


def unwritten(batch, qo_host, layer_id: int, k_buf: torch.Tensor, idx: torch.Tensor,
              sub) -> DeviceCheck | None:
    """The rows ``idx`` (a ``save_kv=False`` forward's own nodes, which its queries read) of
    ``k_buf`` in check mode: NaN (never written, or freed), or on pages > 1 all zeros (a page
    handed out and not written), is the first such row's request and position."""
    if any(s.prefix_only for s in batch.step_shapes):  # its queries read none of their nodes
        return None
    n = idx.numel()
    rows = k_buf.index_select(0, idx).reshape(n, -1)
    if rows.element_size() == 1:  # fp8: isnan wants a wider float
        rows = rows.float()
    bad = rows.isnan().any(1)
    if sub.page_size > 1:
        bad = bad | (rows == 0).all(1)
    at = torch.arange(n, device=idx.device)
    word = torch.where(bad, at, n).min().view(1)
    held = "NaN" if sub.page_size == 1 else "NaN, or the zeros a page is handed out with"

    def explain(w: list[int]):
        if w[0] >= n:
            return None
        ptr = qo_host.tolist()
        b = _request_of(ptr, w[0])
        r = batch.reqs[b]
        return slot_error(
            batch, b, r.prefix_len + r.query_from + w[0] - ptr[b], "reads", sub.pool_id,
            "full" if sub.space == "full" else "SWA", "never_written",
            f"layer {layer_id} reads this forward's own node there, which was never written: "
            f"the forward passed save_kv=False and nothing stored its K/V before (the row still "
            f"holds check mode's {held})",
            "Pass save_kv=True (the default) with this forward's k and v, or store them first "
            "(backend.write_kv(layer, k, v) after planning)")
    return DeviceCheck(word, explain)
