"""The fault catalog's third round, as transforms of a forward's plan: each takes the plan the
shared planner built and returns the one an engine with that bug would have run. Only
`FaultyBackend` calls them, and only when the config switches the fault on; each counts the
times it changed a table (`swafactory.fault_counts`), so a run it never reached ends inert.

| fault | what it changes | the field's bug |
|---|---|---|
| swa_metadata_missing_in_spec_modes | target_verify and draft_extend plan their SWA layers with no window: every key from position 0 | sglang #22679 |
| window_gather_from_zero | a verify's SWA key lists keep their length, but gather the request's first keys | sglang #39160, #39287 |
| verify_rows_share_write_loc | a verify's SWA rows all write at the request's first row's slot | atlas #745 |
| verify_as_decode | a verify runs as a multi-token decode: every row sees the whole step | flashinfer #3864, #4382 |
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from swafactory.fault_counts import FAULT_COUNTS
from swafactory.kvcache.locs import Locs
from swafactory.metadata.plan import ForwardPlan

__all__ = ["SPEC_MODES", "windows_dropped", "gather_from_zero", "rows_share_write_loc",
           "verify_as_decode"]

SPEC_MODES = ("target_verify", "draft_extend")
"""The forward modes whose SWA metadata sglang #22679 never filled."""


def _host_lens(indptr: torch.Tensor) -> np.ndarray:
    """[B] lengths from a host [B+1] indptr."""
    h = indptr.numpy().astype(np.int64)
    return h[1:] - h[:-1]


def _to(device, x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(x).to(device, non_blocking=True)


def windows_dropped(windows: dict, mode: str, has_swa: bool) -> dict:
    """FAULT swa_metadata_missing_in_spec_modes (sglang #22679): in a verify or a draft extend
    every layer is planned with no window, so an SWA group lists (and reads) every key from
    position 0, freed slots included. Other modes keep ``windows``."""
    if mode not in SPEC_MODES or not has_swa:
        return windows
    return {j: None for j in windows}


def gather_from_zero(fplan: ForwardPlan, source) -> ForwardPlan:
    """FAULT window_gather_from_zero (sglang #39160, #39287): each SWA group of a verify keeps
    its trimmed length and its positions, but its keys are gathered from the request's position
    0 (the full group's list, translated): a query reads the first keys as if they were its
    window's."""
    if fplan.mode != "target_verify" or source is None:
        return fplan
    full = next((g for g in fplan.groups.values() if g.sub_pool == "full" and g.window is None),
                None)
    if full is None or full.tables.kv_host is None:
        return fplan
    f_start = full.tables.kv_host.numpy().astype(np.int64)[:-1]
    groups = dict(fplan.groups)
    for key, g in fplan.groups.items():
        t = g.tables
        if g.sub_pool != "swa" or t.kv_host is None or g.cascade is not None:
            continue
        n = _host_lens(t.kv_host)
        if not (n < _host_lens(full.tables.kv_host)).any():
            continue  # every list already starts at 0: nothing to shift
        idx = np.concatenate([s + np.arange(k) for s, k in zip(f_start, n)]) if n.sum() \
            else np.zeros(0, np.int64)
        first = full.tables.kv_indices.tensor.index_select(0, _to(t.kv_pos.device, idx)).long()
        kv = source.translate(Locs("full", full.tables.kv_indices.pool_id, first))
        FAULT_COUNTS.acted("window_gather_from_zero")  # a list reads another window's keys
        groups[key] = replace(g, tables=replace(t, kv_indices=kv, kv_indices_i32=None,
                                                natural=False))
    return replace(fplan, groups=groups)


def rows_share_write_loc(fplan: ForwardPlan) -> ForwardPlan:
    """FAULT verify_rows_share_write_loc (atlas #745): one metadata for every verify row, so
    each SWA group writes all of a request's rows at its first row's slot."""
    if fplan.mode != "target_verify":
        return fplan
    groups = dict(fplan.groups)
    for key, g in fplan.groups.items():
        t = g.tables
        if g.sub_pool != "swa" or g.write_locs is None or t.qo_host is None:
            continue
        q = _host_lens(t.qo_host)
        if not (q > 1).any():
            continue
        starts = t.qo_host.numpy().astype(np.int64)[:-1]
        first = np.repeat(starts, q)
        w = g.write_locs
        same = replace(w, tensor=w.tensor.index_select(0, _to(w.tensor.device, first)))
        FAULT_COUNTS.acted("verify_rows_share_write_loc")  # rows of a request share one slot
        groups[key] = replace(g, write_locs=same)
    return replace(fplan, groups=groups)


def verify_as_decode(fplan: ForwardPlan) -> ForwardPlan:
    """FAULT verify_as_decode (flashinfer #3864, #4382): a verify planned through the decode
    path with q_len > 1: no structure mask, and every query of a request masked as its last
    one, so each row sees the step's later tokens (a chain's causal mask, a tree's ancestry,
    lost)."""
    if fplan.mode != "target_verify":
        return fplan
    groups = dict(fplan.groups)
    for key, g in fplan.groups.items():
        t = g.tables
        if t.qo_host is None:
            continue
        q = _host_lens(t.qo_host)
        if not (q > 1).any():
            continue
        ends = t.qo_host.numpy().astype(np.int64)[1:] - 1
        last = np.repeat(ends, q)
        q_pos = t.q_pos.index_select(0, _to(t.q_pos.device, last))
        FAULT_COUNTS.acted("verify_as_decode")  # a row sees the rows after it
        groups[key] = replace(g, tables=replace(t, q_pos=q_pos, mask=None, mask_indptr=None,
                                                natural=False), cascade=None)
    return replace(fplan, groups=groups)
