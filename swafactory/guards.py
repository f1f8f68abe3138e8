"""An engine's mistakes, raised in its own terms (`build_backend(..., guards=True)`, the default).

Two kinds of check, so that guards never add a host sync:

* **host-side** (`forward_error`): shapes, dtypes and devices of q, k, v and sinks, from tensor
  metadata. `AttentionBackend.forward` compares a few ints inline and calls this only when one
  differs, to name every mismatch at once. Free: no tensor op, no read back.
* **deferred** (`SlotCheck`): positions a forward reads or writes that have no slot (a
  ``req_to_token`` entry 0, the dummy row: a row never opened or already finished, nodes past
  the allocation). `init_forward_metadata` reduces the planner's full-space tables on the device
  to an error word (min slot and its index); on CUDA the word is copied non-blocking into pinned
  memory behind an event, and `AttentionBackend.raise_pending` (the engine's own sync point)
  raises `MissingSlotError`. On CPU, where reading is free, it raises at once, before anything
  is written.
* **deferred, any word** (`DeviceCheck`): the same pinned copy behind an event for any check
  reduced on the device to a small int64 word, with a function that turns the word's values
  into the error: a graph bucket's padding write slots (`graph_state.check_padding`), the
  write slots' bounds in check mode (`HybridSWAPool.check`).
"""
from __future__ import annotations

from collections import deque

from collections.abc import Callable

import torch

from swafactory.errors import SwaFactoryError

__all__ = ["PendingChecks", "GuardError", "CallError", "CallTypeError", "CallOrderError",
           "MissingSlotError", "Q_DTYPES", "forward_error", "batch_error", "SlotCheck",
           "DeviceCheck", "defers", "batch_table"]

Q_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
"""dtypes of q (and of k, v before the store casts or quantizes them)."""


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
    """A forward reads or writes a position of a request that has no slot (entry 0)."""


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
    """A check reduced on the device to ``word`` ([n] int64), read where reading is free.

    explain: the word's values (host ints) → the error, or None when they show none. On CUDA the
    word is copied non-blocking into pinned memory behind an event (`deferred`: the backend
    keeps it for `raise_pending`); on CPU it is read when asked (the backend asks at once)."""

    def __init__(self, word: torch.Tensor,
                 explain: Callable[[list[int]], Exception | None]) -> None:
        self.explain, self.event = explain, None
        self.deferred = defers(word)
        if word.is_cuda:
            self.word = torch.empty(word.shape, dtype=word.dtype, pin_memory=True)
            self.word.copy_(word, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.word = word

    def error(self) -> Exception | None:
        """The error the word shows (waits on its event: work queued before the forward's)."""
        if self.event is not None:
            self.event.synchronize()
        return self.explain(self.word.tolist())


class SlotCheck:
    """One forward's deferred check for positions with no slot.

    reads: the plan's full-space key list ([total_kv] int64 full slots, each request's slots
    ``[kv_end - n, kv_end)`` in slot order) with its host indptr ([B+1]); writes: the full-space
    write slots ([total_q] int64) or None. Built where no full-space list exists (a runner whose
    layers are all SWA) from ``req_to_token`` directly. Nothing here reads the device."""

    def __init__(self, batch, reads: torch.Tensor | None, kv_host: torch.Tensor | None,
                 writes: torch.Tensor | None, qo_host: torch.Tensor | None) -> None:
        self.batch, self.kv_host, self.qo_host = batch, kv_host, qo_host  # host: read on error
        table = batch.req_to_token
        self.ends = None
        if reads is None:  # no full-space group: gather [0, end) of each row from the table
            reads, self.kv_host = self._rows(table, writes is not None)
        parts = []
        for t in (reads, writes):
            if t is None or t.numel() == 0:
                parts += torch.ones(2, dtype=torch.int64, device=table.device).unbind()
            else:
                val, idx = t.min(0)  # the first 0 when there is one: min's first index
                parts += [val.long(), idx]
        word = torch.stack(parts)  # [4]: read min, its index, write min, its index
        self.event = None
        if word.is_cuda:  # behind an event: read at the engine's sync point, not here
            self.word = torch.empty(4, dtype=torch.int64, pin_memory=True)
            self.word.copy_(word, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.word = word
        self.deferred = self.event is not None

    def _rows(self, table: torch.Tensor, writes: bool) -> tuple[torch.Tensor, list[int]]:
        """[n] slots of each request's ``[0, end)`` (end: its kv_end, or its last node when it
        writes), and the host indptr."""
        ends = self.ends = [r.prefix_len + r.nodes if writes else r.kv_end
                            for r in self.batch.reqs]
        ptr = [0]
        for e in ends:
            ptr.append(ptr[-1] + e)
        dev = table.device
        host = torch.tensor([r.row for r in self.batch.reqs] + ptr + ends, dtype=torch.int64)
        d = host.to(dev, non_blocking=True)
        B = len(ends)
        rows, start, lens = d[:B], d[B:2 * B], d[2 * B + 1:]
        b = torch.repeat_interleave(torch.arange(B, device=dev), lens, output_size=ptr[-1])
        o = torch.arange(ptr[-1], device=dev) - start[b]
        return table[rows[b], o].long(), torch.tensor(ptr)

    def error(self) -> MissingSlotError | None:
        """The error this forward's tables show (waits on its event: the planning's own work,
        which precedes the forward's kernels on the stream)."""
        if self.event is not None:
            self.event.synchronize()
        rmin, ridx, wmin, widx = self.word.tolist()
        if rmin == 0:
            ptr = self.kv_host.tolist()
            b = max(i for i in range(len(ptr) - 1) if ptr[i] <= ridx)
            r = self.batch.reqs[b]
            end = r.kv_end if self.ends is None else self.ends[b]
            pos = end - (ptr[b + 1] - ptr[b]) + (ridx - ptr[b])
            what = "reads"
        elif wmin == 0:
            ptr = self.qo_host.tolist()
            b = max(i for i in range(len(ptr) - 1) if ptr[i] <= widx)
            r = self.batch.reqs[b]
            pos = r.prefix_len + r.query_from + (widx - ptr[b])
            what = "writes"
        else:
            return None
        return MissingSlotError(
            f"{self.batch.mode}: request {r.rid!r} (row {r.row}) {what} position {pos} (slot "
            f"index in its req_to_token row), which has no slot (entry 0, the dummy row): open "
            f"the request and allocate its positions [0, {r.prefix_len + r.nodes}) "
            f"(RequestSlots.open / extend / decode) before the forward, or plan it with fewer "
            f"nodes")


class PendingChecks:
    """A backend's device checks (`SlotCheck`, `DeviceCheck`) between the engine's sync points:
    each is read at once where reading is free (CPU) and kept otherwise (CUDA: no sync), to be
    raised by `raise_pending`."""

    MAX = 64
    """Checks kept; past it the oldest (long done) is read, so an engine that never calls
    `raise_pending` still gets its error, up to this many forwards late."""

    def __init__(self) -> None:
        self._checks: deque = deque()

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
