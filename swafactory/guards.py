"""An engine's mistakes, raised in its own terms (`build_backend(..., guards=True)`, the default).

Two kinds of check, so that guards never add a host sync:

* **host-side** (`forward_error`): shapes, dtypes and devices of q, k, v and sinks, from tensor
  metadata. `AttentionBackend.forward` compares a few ints inline and calls this only when one
  differs, to name every mismatch at once. Free: no tensor op, no read back.
* **deferred** (`DeviceCheck`): a check reduced on the device to a small int64 word, with a
  function that turns the word's values into the error. On CUDA the word is copied
  non-blocking into a pinned row behind an event (`PendingChecks`, rows and events made once),
  and `AttentionBackend.raise_pending` (the engine's own sync point) raises; on CPU, where
  reading is free, it raises at once, before anything is written. The checks:

  - positions a forward reads or writes that have no slot (a ``req_to_token`` entry 0, the
    dummy row: a row never opened or already finished, nodes past the allocation),
    `MissingSlotError`. On a GPU the planner's one key-list launch computes the word as it
    gathers the slots (`missing_check`: no launch of its own); elsewhere it is reduced from the
    planner's full-space tables (`slot_check`). SWA-space holes, slots freed after planning and
    rows a ``save_kv=False`` forward reads unwritten: `backend.slot_guard`;
  - a graph bucket's padding write slots (`graphs.state.check_padding`);
  - the write slots' bounds in check mode (`HybridSWAPool.check`).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from swafactory.errors import SwaFactoryError

__all__ = ["PendingChecks", "GuardError", "CallError", "CallTypeError", "CallOrderError",
           "MissingSlotError", "Q_DTYPES", "forward_error", "batch_error", "slot_check",
           "missing_check", "DeviceCheck", "defers", "batch_table", "NO_MISS", "LIST_SHIFT"]

Q_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
"""dtypes of q (and of k, v before the store casts or quantizes them)."""
NO_MISS = 2**62
"""A missing-slot word's value where every key (or write) has a slot."""
LIST_SHIFT = 2**40
"""A missing key's code in the planner's word: ``list index * LIST_SHIFT + its row in that
list`` (`metadata.keys_triton`)."""


class GuardError(SwaFactoryError):
    """A mistake the guards caught (a report names the guards as what caught it)."""


class CallError(GuardError, ValueError):
    """A `forward` argument of the wrong shape or device."""


class CallTypeError(GuardError, TypeError):
    """A `forward` argument of the wrong dtype, or not a tensor."""


class CallOrderError(GuardError, RuntimeError):
    """A backend call out of order (`forward` before `init_forward_metadata`, a replay before
    `init_cuda_graph_state`)."""


class MissingSlotError(GuardError, ValueError):
    """A forward reads or writes a position of a request that has no live slot, in any space:
    ``request``, ``row``, ``position`` (slot index in its row), ``access`` (reads or writes),
    ``space`` (the space's id), ``cause`` (`backend.slot_guard`'s codes)."""
    request = row = position = access = space = None
    cause = "no_slot"


def batch_table(req_to_token) -> torch.Tensor:
    """The ``[max_requests, max_context]`` table of ``req_to_token``: a tensor, or a
    `ReqToToken` (its ``.table``); anything else is a TypeError saying what to pass."""
    if isinstance(req_to_token, torch.Tensor):
        return req_to_token
    table = getattr(req_to_token, "table", None)
    if isinstance(table, torch.Tensor):
        return table
    raise TypeError(f"req_to_token must be the [max_requests, max_context] int tensor "
                    f"(ReqToToken.table), got {type(req_to_token).__name__}")


def _t(x) -> str:
    if not isinstance(x, torch.Tensor):
        return type(x).__name__
    return f"{list(x.shape)} {str(x.dtype).removeprefix('torch.')} on {x.device}"


def forward_error(layer_id: int, mode: str, rows: int, q_heads: int, kv_heads: int,
                  head_dim: int, device: torch.device, q, k, v, save_kv: bool,
                  sinks) -> Exception | None:
    """Every host-side mistake of one `forward` call, as one exception (None: no mistake).

    rows: the plan's query rows (total_q); q_heads: the runner's (``backend.q_heads``);
    kv_heads, head_dim, device: the layer's sub-pool. The exception's type is the first
    reason's: TypeError for a dtype or a non-tensor, ValueError for a shape or a device."""
    reasons: list[tuple[type, str]] = []

    def tensor(name: str, x, heads: int) -> None:
        if not isinstance(x, torch.Tensor):
            reasons.append((TypeError, f"{name} must be a tensor [{rows}, {heads}, {head_dim}], "
                                       f"got {type(x).__name__}"))
            return
        if x.dtype not in Q_DTYPES:
            reasons.append((TypeError, f"{name} is {str(x.dtype).removeprefix('torch.')}; "
                                       "accepted dtypes: float16, bfloat16, float32"))
        if x.dim() != 3:
            reasons.append((ValueError, f"{name} must be 3-D [rows, heads, head_dim] = "
                                        f"[{rows}, {heads}, {head_dim}], got {list(x.shape)}"))
        else:
            n, h, d = x.shape
            if n != rows:
                reasons.append((ValueError, f"{name} has {n} rows, but the plan has {rows} query "
                                            "rows (the batch's total_q): pass one row per query "
                                            "of the batch given to init_forward_metadata"))
            if h != heads:
                reasons.append((ValueError, f"{name} has {h} heads, expected {heads}"
                                + (" (the runner's q_heads: set backend.q_heads when the model "
                                   "differs from the config)" if name == "q" else
                                   " (the layer's KV heads)")))
            if d != head_dim:
                reasons.append((ValueError, f"{name} has head_dim {d}, expected {head_dim} "
                                            "(the layer's sub-pool)"))
        if x.device != device:
            reasons.append((ValueError, f"{name} is on {x.device}, the layer's pool on {device}: "
                                        f"move {name} to {device}"))

    tensor("q", q, q_heads)
    if save_kv:
        if k is None or v is None:
            reasons.append((ValueError, "this pass writes K/V (save_kv=True): pass k and v, or "
                                        "save_kv=False for a pass that writes nothing"))
        else:
            tensor("k", k, kv_heads)
            tensor("v", v, kv_heads)
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor):
            reasons.append((TypeError, f"sinks must be a tensor [{q_heads}] (one per q head), "
                                       f"got {type(sinks).__name__}"))
        elif tuple(sinks.shape) != (q_heads,):
            reasons.append((ValueError, f"sinks must be [{q_heads}] (one per q head), got "
                                        f"{_t(sinks)}"))
        elif sinks.dtype not in Q_DTYPES:
            reasons.append((TypeError, f"sinks are {str(sinks.dtype).removeprefix('torch.')}; "
                                       "accepted dtypes: float16, bfloat16, float32"))
        elif sinks.device != device:
            reasons.append((ValueError, f"sinks are on {sinks.device}, the layer's pool on "
                                        f"{device}: move them to {device}"))
    if not reasons:
        return None
    kind = CallTypeError if reasons[0][0] is TypeError else CallError
    text = "; ".join(r for _, r in reasons)
    return kind(f"{mode} layer {layer_id}: {text}")


def batch_error(batch, device: torch.device) -> Exception | None:
    """Every host-side mistake of a `ForwardBatch` (None: none), before anything is planned:
    its table's dtype, rank and device (the pool's is ``device``), a ``req_to_token`` row
    given twice, a decode forward with more than one query per request, a request reading past
    its row. Python over the batch's requests: a few µs at bs 64."""
    reasons: list[tuple[type, str]] = []
    t = batch.req_to_token
    if t.dtype not in (torch.int32, torch.int64) or t.dim() != 2:
        reasons.append((TypeError, f"req_to_token must be a 2-D int32/int64 tensor "
                                   f"[max_requests, max_context] (ReqToToken.table), got {_t(t)}"))
    elif t.device != device:
        reasons.append((ValueError, f"req_to_token is on {t.device}, the pool on {device}: "
                                    f"build ReqToToken on {device}"))
    reqs = batch.reqs
    if len({r.row for r in reqs}) != len(reqs):
        seen: dict[int, object] = {}
        for r in reqs:
            if r.row in seen:
                reasons.append((ValueError, f"requests {seen[r.row]!r} and {r.rid!r} both use "
                                            f"req_to_token row {r.row}: each request of a "
                                            "forward comes once, with its own row"))
                break
            seen[r.row] = r.rid
    if batch.mode == "decode" and any(s.nodes - s.query_from != 1 for s in batch.step_shapes):
        r = next(r for r in reqs if r.q_len != 1)
        reasons.append((ValueError, f"a decode forward has one query per request; request "
                                    f"{r.rid!r} has {r.q_len}: use mode='extend' (or "
                                    "'target_verify' for a verify step)"))
    if t.dim() == 2:
        width = t.shape[1]
        far = max(reqs, key=lambda r: r.prefix_len + r.nodes)
        if far.prefix_len + far.nodes > width:
            reasons.append((IndexError, f"request {far.rid!r} reaches position "
                                        f"{far.prefix_len + far.nodes - 1}, past req_to_token's "
                                        f"{width} columns (its max_context)"))
    if not reasons:
        return None
    kind = {TypeError: CallTypeError, IndexError: IndexError}.get(reasons[0][0], CallError)
    return kind(f"{batch.mode} forward of {len(reqs)} request{'s' * (len(reqs) != 1)}: "
                + "; ".join(r for _, r in reasons))


def defers(word: torch.Tensor) -> bool:
    """Whether a check whose word is ``word`` waits for `AttentionBackend.raise_pending`: on
    CUDA, where reading it now would sync the host. (Tests patch it to defer on CPU too.)"""
    return word.is_cuda


class DeviceCheck:
    """A check reduced on the device to ``word`` ([n <= 16] int64), read where reading is free.

    explain: the word's values (host ints) → the error, or None when they show none. A deferred
    check (CUDA) is staged by `PendingChecks`: its word copied non-blocking into a pinned row
    behind an event, then read at `raise_pending`; otherwise it is read when asked (at once)."""

    def __init__(self, word: torch.Tensor,
                 explain: Callable[[list[int]], Exception | None]) -> None:
        self.word, self.explain, self.event = word, explain, None
        self.deferred = defers(word)

    def error(self) -> Exception | None:
        """The error the word shows (waits on its event: work queued before the forward's)."""
        if self.event is not None:
            self.event.synchronize()
        return self.explain(self.word.tolist())


def _missing(batch, what: str, b: int, pos: int) -> MissingSlotError:
    r = batch.reqs[b]
    err = MissingSlotError(
        f"{batch.mode}: request {r.rid!r} (row {r.row}) {what} position {pos} (slot index in "
        f"its req_to_token row), which has no slot (entry 0, the dummy row): open the request "
        f"and allocate its positions [0, {r.prefix_len + r.nodes}) (RequestSlots.open / extend / "
        f"decode) before the forward, or plan it with fewer nodes")
    err.request, err.row, err.position, err.access, err.space = (r.rid, r.row, pos, what,
                                                                 batch.full_id)
    return err


def _request_of(ptr: list[int], i: int) -> int:
    """The request whose rows ``[ptr[b], ptr[b+1])`` hold row ``i`` (the last such, so an
    empty request before it is skipped)."""
    return max(b for b in range(len(ptr) - 1) if ptr[b] <= i)


def _write_error(batch, qo_host, widx: int) -> MissingSlotError:
    ptr = qo_host.tolist()
    b = _request_of(ptr, widx)
    r = batch.reqs[b]
    return _missing(batch, "writes", b, r.prefix_len + r.query_from + (widx - ptr[b]))


def missing_check(batch, word: torch.Tensor, lists, qo_host) -> DeviceCheck:
    """The check of the fused planner's own word (`keys_triton.FusedKeys.missing`, [2] int64:
    the first key and the first write row with no slot, computed in the planning launch): no
    launch of its own. lists: per key list, (its host indptr [B+1], its requests' first
    columns [B]); qo_host: [B+1] host query indptr."""
    def explain(w: list[int]) -> MissingSlotError | None:
        read, write = w
        if read != NO_MISS:
            s, k = divmod(read, LIST_SHIFT)
            kv_host, starts = lists[s]
            ptr = kv_host.tolist()
            b = _request_of(ptr, k)
            return _missing(batch, "reads", b, int(starts[b]) + k - ptr[b])
        if write != NO_MISS:
            return _write_error(batch, qo_host, write)
        return None
    return DeviceCheck(word, explain)


def slot_check(batch, reads: torch.Tensor | None, kv_host: torch.Tensor | None,
               writes: torch.Tensor | None, qo_host: torch.Tensor | None) -> DeviceCheck:
    """One forward's check for positions with no slot, from its tables (the planner without
    the fused launch: a CPU, or CUDA without Triton).

    reads: the plan's full-space key list ([total_kv] int64 full slots, each request's slots
    ``[kv_end - n, kv_end)`` in slot order) with its host indptr ([B+1]); writes: the full-space
    write slots ([total_q] int64) or None. Built where no full-space list exists (a runner whose
    layers are all SWA) from ``req_to_token`` directly. Nothing here reads the device."""
    table = batch.req_to_token
    ends = None
    if reads is None:  # no full-space group: gather [0, end) of each row from the table
        ends = [r.prefix_len + r.nodes if writes is not None else r.kv_end for r in batch.reqs]
        reads, kv_host = _rows(batch, table, ends)
    lists = [t if t is not None and t.numel() else None for t in (reads, writes)]
    if table.is_cuda:  # read late: the first 0's index travels in the word (nothing is kept)
        parts = []
        for t in lists:
            if t is None:
                parts += torch.ones(2, dtype=torch.int64, device=table.device).unbind()
            else:
                val, idx = t.min(0)  # the first 0 when there is one: min's first index
                parts += [val.long(), idx]
        word = torch.stack(parts)  # [4]: read min, its index, write's
    else:  # read at once: the minima alone (a plain reduction); an index only for an error
        word = torch.stack([torch.ones((), dtype=torch.int64) if t is None else t.min().long()
                            for t in lists])  # [2]: read min, write min

    def explain(w: list[int]) -> MissingSlotError | None:
        if len(w) == 2:  # the first 0's index (min's first), found for an error only
            rmin, wmin = w
            ridx = int(lists[0].argmin()) if rmin == 0 else None
            widx = int(lists[1].argmin()) if wmin == 0 else None
        else:
            rmin, ridx, wmin, widx = w
        if rmin == 0:
            ptr = kv_host.tolist()
            b = _request_of(ptr, ridx)
            end = batch.reqs[b].kv_end if ends is None else ends[b]
            return _missing(batch, "reads", b, end - (ptr[b + 1] - ptr[b]) + (ridx - ptr[b]))
        if wmin == 0:
            return _write_error(batch, qo_host, widx)
        return None
    return DeviceCheck(word, explain)


def _rows(batch, table: torch.Tensor, ends: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[n] slots of each request's ``[0, end)``, and the host indptr."""
    ptr = [0]
    for e in ends:
        ptr.append(ptr[-1] + e)
    dev = table.device
    host = torch.tensor([r.row for r in batch.reqs] + ptr + ends, dtype=torch.int64)
    d = host.to(dev, non_blocking=True)
    B = len(ends)
    rows, start, lens = d[:B], d[B:2 * B], d[2 * B + 1:]
    b = torch.repeat_interleave(torch.arange(B, device=dev), lens, output_size=ptr[-1])
    o = torch.arange(ptr[-1], device=dev) - start[b]
    return table[rows[b], o].long(), torch.tensor(ptr)


class _Staging:
    """Pinned rows that deferred words are copied into, each with its event, made once: a
    forward's check costs one copy and one event record, no pinned allocation or new event."""

    WIDTH = 16

    def __init__(self, n: int) -> None:
        self.n, self.i, self.rows, self.events = n, 0, None, ()
        self._views: dict[tuple[int, int], torch.Tensor] = {}  # (row, width) → view, made once

    def stage(self, check: DeviceCheck) -> None:
        word = check.word
        w = word.numel()
        if not word.is_cuda or w > self.WIDTH:  # a test's deferred CPU word; a wider word
            return  # is read from the device at raise_pending (a sync point anyway)
        if self.rows is None:
            self.rows = torch.empty((self.n, self.WIDTH), dtype=torch.int64, pin_memory=True)
            self.events = [torch.cuda.Event() for _ in range(self.n)]
        i, self.i = self.i, (self.i + 1) % self.n  # row i's last check has been read (MAX)
        row = self._views.get((i, w))
        if row is None:  # no view op per forward: a check's words come in a few widths
            row = self._views[i, w] = self.rows[i, :w]
        row.copy_(word, non_blocking=True)
        self.events[i].record()
        check.word, check.event = row, self.events[i]


class PendingChecks:
    """A backend's device checks (`DeviceCheck`) between the engine's sync points:
    each is read at once where reading is free (CPU) and kept otherwise (CUDA: no sync), to be
    raised by `raise_pending`."""

    MAX = 64
    """Checks kept; past it the oldest (long done) is read, so an engine that never calls
    `raise_pending` still gets its error, up to this many forwards late."""

    def __init__(self) -> None:
        self._checks: deque = deque()
        self._staging = _Staging(self.MAX + 1)  # one row more than the checks kept

    def __len__(self) -> int:
        return len(self._checks)

    def clear(self) -> None:
        """Forget the kept checks unread."""
        self._checks.clear()

    def defer(self, check) -> None:
        """Read ``check`` now where that is free, else keep it (None: nothing to check)."""
        if check is None:
            return
        if not check.deferred:
            err = check.error()
            if err is not None:
                raise err
            return
        self._staging.stage(check)
        self._checks.append(check)
        if len(self._checks) > self.MAX:
            err = self._checks.popleft().error()
            if err is not None:
                self._checks.clear()
                raise err

    def raise_pending(self) -> None:
        """Raise the first error of the kept checks, and forget them: one wait on the newest
        check's event (events are in stream order), then host reads."""
        checks, self._checks = self._checks, deque()
        if checks and checks[-1].event is not None:
            checks[-1].event.synchronize()
        for c in checks:
            err = c.error()
            if err is not None:
                raise err
