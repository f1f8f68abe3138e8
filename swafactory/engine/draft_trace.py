"""Every draft row of a run beside its clean twin's: where a fault first changed what the draft
proposed.

A mean accept length within a margin of the clean twin's can hide a fault that changed the
draft (a drop of 10% passed a 10% margin; sglang's #27737 collapse starts small). So a run with
a fault keeps, for each request, every draft pass's rows in launch order: draft decode (a
chain's step, a tree level, a DFlash block) and draft extend. Each row is kept as its top
`TOP` logits (ids and values), which is what decides the draft's tokens and costs a few bytes
at any vocabulary. The twin (faults=none, same prompts and weights) keeps the same; the first
entry where the two differ names the request, spec step, mode and row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["TOP", "TraceRow", "fingerprint", "first_difference"]

TOP = 8
"""Logits kept per draft row: the top-1 gives the token, the rest the margin to the next."""


@dataclass(frozen=True)
class TraceRow:
    """One draft pass of one request. step: the spec steps the request had verified when the
    pass's values came back; mode: ``draft_decode`` or ``draft_extend``; ids, values: [rows,
    TOP] int64 / fp32, each row's top logits, largest first."""

    step: int
    mode: str
    ids: torch.Tensor
    values: torch.Tensor


def fingerprint(step: int, mode: str, rows: torch.Tensor) -> TraceRow:
    """``rows``: [n, vocab] fp32 host logits of one request's rows in a draft pass."""
    values, ids = rows.float().topk(min(TOP, rows.shape[-1]), dim=-1)
    return TraceRow(step, mode, ids, values)


def first_difference(mine: dict, twin: dict, tol: float) -> str | None:
    """The first place, over requests in id order, where a run's draft passes (``mine``:
    {request id: [TraceRow, ...]}) leave the clean twin's (``twin``, the same): a pass the
    other did not make, another top-1 token, or top logits further apart than ``tol`` relative
    to the twin's largest. None: every pass agrees. The step named is the earliest over the
    requests."""
    found: list[tuple[int, str]] = []
    for rid in sorted(set(mine) | set(twin), key=str):
        a, b = mine.get(rid, []), twin.get(rid, [])
        for i in range(max(len(a), len(b))):
            if i >= len(a) or i >= len(b):
                row = b[i] if i < len(b) else a[i]
                found.append((row.step, f"request {rid} spec step {row.step}: a {row.mode} pass "
                              f"{'only the clean twin' if i >= len(a) else 'the twin never'} "
                              "made"))
                break
            x, y = a[i], b[i]
            if (x.step, x.mode, x.ids.shape) != (y.step, y.mode, y.ids.shape):
                found.append((min(x.step, y.step), f"request {rid} spec step {y.step}: a "
                              f"{x.mode} pass of {x.ids.shape[0]} rows where the twin ran a "
                              f"{y.mode} of {y.ids.shape[0]}"))
                break
            scale = float(y.values.abs().max().clamp_min(1e-6))
            err = (x.values - y.values).abs().amax(dim=-1) / scale
            bad = (x.ids[:, 0] != y.ids[:, 0]) | ~(err <= tol)
            if bool(bad.any()):
                j = int(bad.nonzero()[0])
                found.append((x.step, f"request {rid} spec step {x.step}, {x.mode} row {j}: "
                              f"top-1 token {int(x.ids[j, 0])} (logit {float(x.values[j, 0]):.3g})"
                              f" against the twin's {int(y.ids[j, 0])} "
                              f"({float(y.values[j, 0]):.3g}), top-{TOP} logits "
                              f"{float(err[j]):.1e} apart"))
                break
    return min(found, key=lambda f: f[0])[1] if found else None
