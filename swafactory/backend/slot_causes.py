"""How a slot a forward reads or writes went missing, in the caller's terms: the request, the
position, the index space and the cause, read from the request's book (`RequestSlots`, found
from the batch's table by `kvcache.requests.books_of`) on the error path only.

Causes (`MissingSlotError.cause`): ``finished`` (`RequestSlots.finish` freed the request's slots
and row), ``evicted`` (`evict_out_of_window` freed an SWA slot still in a query's window),
``freed`` (freed some other way, or by a book the guards cannot see), ``reassigned`` (freed and
handed out again since planning), ``swapped`` (a row the book gives another request) and
``never_written`` (`slot_guard.unwritten`). The plan-time swap check (`swapped_rows`) runs on
every guarded plan: host ints only, a list index and a compare per request."""
from __future__ import annotations

from swafactory.guards import CallError, MissingSlotError
from swafactory.kvcache.requests import books_of

__all__ = ["slot_error", "hole_error", "refined", "swapped_rows", "first_query"]


def first_query(r) -> int:
    """Position of request ``r``'s earliest query: where its window starts from."""
    return r.prefix_len + r.step.first_query_depth


def slot_error(batch, b: int, col: int, access: str, space: str, kind: str, cause: str,
               why: str, fix: str) -> MissingSlotError:
    """The error of request ``b``'s slot index ``col`` (its `ReqToToken` column) in the
    ``kind`` space ``space`` (``full`` or ``SWA``; its id), with its fields set."""
    r = batch.reqs[b]
    err = MissingSlotError(f"{batch.mode}: request {r.rid!r} (row {r.row}) {access} position "
                           f"{col} (slot index in its req_to_token row) in {kind} space "
                           f"{space!r}: {why}. {fix}")
    err.request, err.row, err.position, err.access = r.rid, r.row, col, access
    err.space, err.cause = space, cause
    return err


def _swap_words(book, r, batch) -> str | None:
    """Why request ``r``'s row is not its own in ``book`` (None: it is, or the book does not
    know the request)."""
    s = book.reqs.get(r.rid)
    holder = book.row_owners[r.row] if 0 <= r.row < len(book.row_owners) else None
    if s is None or s.row == r.row:
        return None
    text = f"the book (RequestSlots) holds request {r.rid!r} at row {s.row}"
    if holder is None:
        return f"{text}, and row {r.row} is free"
    swapped = any(o.rid == holder and o.row == s.row for o in batch.reqs)
    return (f"{text} and row {r.row} for request {holder!r}"
            + (f": the rows of {r.rid!r} and {holder!r} are swapped" if swapped else ""))


_OWN_ROW = "Pass each request's own row: ReqForward(rid, book.reqs[rid].row, ...)"


def swapped_rows(batch, book) -> CallError | None:
    """A request of ``batch`` given a row its book holds for another request (or its own
    request at another row): the rows are swapped, whatever the lengths. Requests the book does
    not know (an engine with its own ids) are skipped."""
    owners = book.row_owners
    for r in batch.reqs:
        row = r.row
        if 0 <= row < len(owners) and owners[row] == r.rid:
            continue  # the common case: a list index and a compare
        s = book.reqs.get(r.rid)
        if s is not None and s.row != row:
            return CallError(f"{batch.mode} forward: request {r.rid!r} is given req_to_token "
                             f"row {row}, but {_swap_words(book, r, batch)}. {_OWN_ROW}")
    return None


def hole_error(batch, b: int, col: int, access: str, space: str, kind: str,
               window: int | None = None, since_plan: bool = False,
               now: int | None = None) -> MissingSlotError:
    """Request ``b``'s slot index ``col`` has no live slot in ``space``: the cause the book
    tells (finished, swapped rows, evicted past the window), else what the tables show.
    since_plan: found by comparing the plan with the books at the forward; now: the slot the
    tables hold there now (0: none)."""
    r = batch.reqs[b]
    book = books_of(batch.req_to_token)
    after = " after this forward was planned" if since_plan else ""
    if book is not None:
        err = _booked(batch, b, col, access, space, kind, book, after)
        if err is not None:
            return err
        s = book.reqs.get(r.rid)
        if kind == "SWA" and s is not None and col < s.swa_evicted:
            return _evicted(batch, b, col, access, space, window, s.swa_evicted,
                            book.page_size, after)
    if since_plan and now:
        return slot_error(batch, b, col, access, space, kind, "reassigned",
                          f"its slot was freed and handed out again{after} (slot {now} now)",
                          "Free slots only after the forwards that read them, or plan again")
    if kind == "SWA" and not since_plan:
        why = ("its full→SWA mapping entry is 0: its SWA slot was freed (evict_out_of_window "
               "past the window, truncate or finish) or never mapped")
    else:
        why = (f"its slot was freed{after} (finish, truncate or evict_out_of_window between "
               "init_forward_metadata and forward)")
    return slot_error(batch, b, col, access, space, kind, "freed", why,
                      "evict_out_of_window's seq_len is the first position a later query can "
                      "have (the committed length; L - 1 for a FROZEN_KV draft); free a "
                      "request's slots only after its last forward")


def _evicted(batch, b: int, col: int, access: str, space: str, window: int | None,
             frontier: int, page: int, after: str) -> MissingSlotError:
    """An SWA slot the request's eviction freed while this forward still lists it: inside the
    window (evicted too far), or before it in the page the list starts on (a frontier that is
    not floored to a page: kernels read that page whole, masked by position)."""
    q0 = first_query(batch.reqs[b])
    lo = max(0, q0 - window + 1) if window else 0
    why = (f"evict_out_of_window freed its SWA slot{after} (the request's SWA frontier is at "
           f"{frontier})")
    if window is None:  # an SWA sub-pool's layers planned as full attention
        return slot_error(batch, b, col, access, space, "SWA", "evicted",
                          f"{why}, yet this forward plans the SWA sub-pool's layers with no "
                          f"window, so its query at position {q0} reads every position from 0",
                          "Plan sliding layers with their window: build the backend without "
                          "windows= (it derives each runner's windows from what its layers read)")
    if col >= lo:
        return slot_error(batch, b, col, access, space, "SWA", "evicted",
                          f"{why}, yet this forward's query at position {q0} sees positions from "
                          f"{lo} (window {window})",
                          "Evict after the step that commits, with seq_len the first position a "
                          "later query can have (the committed length; L - 1 for a FROZEN_KV "
                          f"draft): at most {q0} here")
    return slot_error(batch, b, col, access, space, "SWA", "evicted",
                      f"{why}; the position is before the window (from {lo}) but in the page "
                      f"the key list starts on (page_size {page}), which kernels read whole, "
                      "masked by position",
                      "Free SWA slots a whole page at a time: the eviction frontier must be "
                      "floored to a page (RequestSlots.evict_out_of_window does)")


def _booked(batch, b: int, col: int, access: str, space: str, kind: str, book,
            after: str) -> MissingSlotError | None:
    """The causes a book names for any space: the request finished, or its row is another's."""
    r = batch.reqs[b]
    swap = _swap_words(book, r, batch)
    if swap is not None:
        return slot_error(batch, b, col, access, space, kind, "swapped", swap, _OWN_ROW)
    if r.rid not in book.reqs and r.rid in book.finished:
        holder = book.row_owners[r.row] if 0 <= r.row < len(book.row_owners) else None
        return slot_error(batch, b, col, access, space, kind, "finished",
                          f"request {r.rid!r} was finished (RequestSlots.finish){after}, "
                          "which freed its slots and its row"
                          + (f" (row {r.row} now holds request {holder!r})" if holder is not None
                             else ""),
                          "Finish a request after its last forward, and plan the batch again "
                          "without it (init_forward_metadata)")
    return None


def refined(err, batch):
    """``err`` (`guards`' full-space `MissingSlotError`) with the cause the book names, when it
    names one (a finished request, a swapped row); else ``err`` itself."""
    if not isinstance(err, MissingSlotError) or err.cause != "no_slot" or err.request is None:
        return err
    book = books_of(batch.req_to_token)
    if book is None:
        return err
    b = next((i for i, r in enumerate(batch.reqs)
              if r.rid == err.request and r.row == err.row), None)
    if b is None:
        return err
    better = _booked(batch, b, err.position, err.access, err.space, "full", book, "")
    return err if better is None else better
