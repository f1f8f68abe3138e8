"""Each request's *logical* K/V history, kept beside its pools for the oracle.

Rows are in slot order: row i holds the token at ``pos[i]`` (the committed tokens first, at
positions 0, 1, …; then this step's draft nodes). A sliding-window layer's rows that no future
query can see are dropped (`History.drop_before`): a Gemma 4 serve run would otherwise hold
every token of all 50 SWA layers, most of a GPU's memory once several runs share it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["History"]


class _Rows:
    """Rows ``[start, n)`` of one layer's ``[rows, H, D]`` history in the drawn K/V's dtype
    (exact: the oracle upcasts). The buffer grows by a quarter of the live rows, so reads never
    re-stack tokens; dropping rows only narrows a view, and the next growth copies live rows."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.start = 0
        self.n = 0

    def set_tail(self, keep: int, new: torch.Tensor) -> None:
        """Rows ``keep:`` become ``new`` ([m, H, D])."""
        if keep < self.start:
            raise IndexError(f"rows before {self.start} were dropped; cannot rewrite from {keep}")
        end = keep + new.shape[0]
        if self.buf is None or end - self.start > self.buf.shape[0]:
            cap = max(64, end - self.start, (5 * (0 if self.buf is None else self.buf.shape[0])) // 4)
            grown = torch.empty(cap, *new.shape[1:], dtype=new.dtype, device=new.device)
            if self.buf is not None:
                grown[:self.n - self.start] = self.buf[:self.n - self.start]
            self.buf = grown
        self.buf[keep - self.start:end - self.start] = new
        self.n = end

    def rows(self, lo: int, hi: int) -> torch.Tensor:
        """Rows ``lo:hi`` (``lo`` ≥ `start`)."""
        return self.buf[lo - self.start:hi - self.start]

    def drop_before(self, start: int) -> None:
        """Forget rows before ``start`` (no copy)."""
        start = min(start, self.n)
        if start > self.start and self.buf is not None:
            self.buf = self.buf[start - self.start:]
            self.start = start


@dataclass
class History:
    """One request's tokens in slot order: position, and K/V rows per (history) layer.

    A layer stored in fp8 keeps two histories: ``k``/``v``, what the pool holds (each value
    quantized and dequantized with the layer's scales, the oracle's exact check), and
    ``k_raw``/``v_raw``, the values the model wrote (the reported error of fp8 against bf16)."""

    pos: list[int] = field(default_factory=list)
    k: dict[int, _Rows] = field(default_factory=dict)
    v: dict[int, _Rows] = field(default_factory=dict)
    k_raw: dict[int, _Rows] = field(default_factory=dict)
    v_raw: dict[int, _Rows] = field(default_factory=dict)

    def _stores(self) -> tuple[dict[int, _Rows], ...]:
        return self.k, self.v, self.k_raw, self.v_raw

    def record(self, layer: int, keep: int, k: torch.Tensor, v: torch.Tensor,
               raw: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Tokens ``keep:`` of ``layer`` become ``k``, ``v`` ([m, Hkv, D]); ``raw``: the values
        before an fp8 pool's rounding (the same shapes), kept beside them."""
        pairs = [(self.k, k), (self.v, v)]
        if raw is not None:
            pairs += [(self.k_raw, raw[0]), (self.v_raw, raw[1])]
        for store, new in pairs:
            store.setdefault(layer, _Rows()).set_tail(keep, new)

    def has_raw(self, layer: int) -> bool:
        """True when ``layer`` keeps the values before rounding (an fp8 layer)."""
        return layer in self.k_raw

    def kv_from(self, layer: int, n: int, raw: bool = False
                ) -> tuple[int, torch.Tensor, torch.Tensor]:
        """``(start, keys, values)``: tokens ``start:n`` of ``layer``, ``[n - start, Hkv, D]``
        each, where ``start`` is the first row still kept (0 unless rows were dropped);
        ``raw``: the values before an fp8 pool's rounding."""
        k, v = (self.k_raw[layer], self.v_raw[layer]) if raw else (self.k[layer], self.v[layer])
        if k.n < n:
            raise IndexError(f"history of layer {layer} holds {k.n} tokens, {n} asked")
        return k.start, k.rows(k.start, n), v.rows(v.start, n)

    def kv(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``n`` tokens' keys and values of ``layer``: ``[n, Hkv, D]`` each."""
        start, keys, values = self.kv_from(layer, n)
        if start:
            raise IndexError(f"history of layer {layer} dropped its first {start} tokens")
        return keys, values

    def drop_before(self, layer: int, start: int) -> None:
        """Forget ``layer``'s tokens before ``start``: no query to come can see them (a sliding
        window layer, ``start`` ≤ the oldest position still inside every future window)."""
        for store in self._stores():
            if layer in store:
                store[layer].drop_before(start)

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens (rejected draft tokens are dropped)."""
        del self.pos[n:]
        for store in self._stores():
            for rows in store.values():
                rows.n = max(rows.start, min(rows.n, n))

    def reorder_tail(self, start: int, picks: Sequence[int]) -> None:
        """Tokens ``start + picks[j]`` become ``start + j`` (accepted tree path moved in place)."""
        moved: dict[tuple, torch.Tensor] = {}  # one index per (device, first kept row), not per layer
        for store in self._stores():
            for rows in store.values():
                key = (rows.buf.device, rows.start)
                if key not in moved:
                    host = torch.tensor([start + i - rows.start for i in picks])
                    moved[key] = host.to(rows.buf.device, non_blocking=True)
                rows.set_tail(start, rows.buf[moved[key]].clone())
        del self.pos[start:]
        self.pos.extend(range(start, start + len(picks)))
