"""The triton backend's adapter: planner tables to our Triton kernels, eagerly or in CUDA graphs.

Eager forwards pass the planner's tables straight to `ops.paged_attention`. A decode pass whose
rows fit `decode_rows` (GPT-OSS, Mistral: Hkv · D ≤ 1024) runs that kernel instead: whole pool
rows per program, the split merge and the sink in the same launch, and, when the backend hands it
this step's K/V (``new_kv``), their write too. One launch per layer is what a small batch under a
CUDA graph pays for (GPT-OSS at bs 8: 48 writes and 24 merges were a third of the step).

CUDA graphs (`plan(…, graph=(bucket, 1))`): decode buckets only. Each (group, pass, bucket) owns
static tables (indptr, rows, positions) sized for ``bucket`` requests over the largest sub-pool;
`plan` refills them in place from the planner's device tables (device-to-device copies, nothing
read back), padding requests reading and writing the dummy row 0. The kernels size their grids
from the bucket alone, so a replay with fewer or longer requests runs the captured launches.
Multi-token buckets (verify, draft extend) are refused: use backend=flashinfer for those graphs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from swafactory.kernels.triton import CAPABILITIES  # defined before __init__ imports this module
from swafactory.kernels.triton.decode_rows import decode_rows, rows_config, rows_serve, rows_splits
from swafactory.kernels.triton.merge import interpreting
from swafactory.metadata.plan import PassCache

__all__ = ["Adapter", "StaticTables"]


@dataclass(eq=False)
class StaticTables:
    """A decode graph bucket's tables at fixed addresses (the kernel contract's names).

    qo_indptr: [n+1] int32 = arange; kv_indptr: [n+1] int32; kv_indices: [n·rows] int32;
    q_pos: [n] int32; kv_pos: [n·rows] int32; window: the group's W (sizes the split count).
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    q_pos: torch.Tensor
    kv_pos: torch.Tensor
    window: int | None
    counters: torch.Tensor
    """[n] int32 zeros of `decode_rows`' split counters: the bucket's own, so the captured
    launches keep their address whatever the eager forwards allocate."""
    mask = None
    mask_indptr = None
    max_q_len = 1

    @property
    def kv_rows(self) -> torch.Tensor:
        return self.kv_indices

    @classmethod
    def empty(cls, n: int, max_kv: int, window: int | None, device) -> StaticTables:
        i32 = dict(dtype=torch.int32, device=device)
        return cls(torch.arange(n + 1, **i32), torch.arange(n + 1, **i32),
                   torch.zeros(max_kv, **i32), torch.zeros(n, **i32), torch.zeros(max_kv, **i32),
                   window, torch.zeros(n, **i32))

    def fill(self, t) -> None:
        """Copy ``t`` (the planner's tables of B ≤ n one-query requests) in; requests past B read
        one key, the dummy row 0 at position 0, from a query at position 0."""
        n = self.q_pos.numel()
        nb = t.batch_size
        total = int(t.kv_host[-1])  # host-known: nothing is read back
        if nb > n or total + (n - nb) > self.kv_indices.numel():
            raise ValueError(f"a decode graph bucket of {n} requests over {self.kv_indices.numel()} "
                             f"keys cannot hold {nb} requests of {total} keys")
        self.kv_indptr[:nb + 1].copy_(t.kv_indptr)
        self.kv_indices[:total].copy_(t.kv_rows)
        self.kv_pos[:total].copy_(t.kv_pos)
        self.q_pos[:nb].copy_(t.q_pos)
        if nb < n:  # padding requests: one key each, after the batch's
            torch.add(self.kv_indptr[nb:nb + 1], self.qo_indptr[1:n - nb + 1],
                      out=self.kv_indptr[nb + 1:])
            self.kv_indices[total:total + n - nb].zero_()
            self.kv_pos[total:total + n - nb].zero_()
            self.q_pos[nb:].zero_()


class Adapter:
    """Wires planner tables to the Triton kernels; holds no pool logic."""

    capabilities = CAPABILITIES
    fuses_writes = True
    """`run` takes ``new_kv`` (this step's K/V and slots) and writes them itself."""

    def __init__(self) -> None:
        self._passes = PassCache("triton")
        self._static: dict[tuple, StaticTables] = {}
        self._counters: torch.Tensor | None = None
        """[≥ batch] int32 zeros `decode_rows` leaves zeroed, for eager forwards (one stream runs
        the layers in order, so they share them); a graph bucket has its own."""
        self._page = 1  # the planned pool's page size: its first page is the dummy
        self.rows = os.environ.get("SWAFACTORY_DECODE_ROWS", "1") != "0"
        """Whether decode passes that fit take `decode_rows` (``SWAFACTORY_DECODE_ROWS=0``: the
        per-head split-KV kernel, as before, for comparisons)."""

    def plan(self, forward_plan, pool, *, sigs=None, graph: tuple[int, int] | None = None) -> None:
        """Host work of one forward: the counters' size; for a graph bucket, refill its static
        tables from the planner's (device-to-device copies)."""
        del sigs
        self._passes.clear()
        self._page = pool.sub_pools[0].page_size
        if not forward_plan.groups:
            return
        dev = next(iter(forward_plan.groups.values())).tables.qo_indptr.device
        if graph is None:
            n = forward_plan.total_q
            if self._counters is None or self._counters.numel() < n or \
                    self._counters.device != dev:
                self._counters = torch.zeros(max(n, 64), dtype=torch.int32, device=dev)
            return
        bucket, tokens = graph
        if tokens != 1:
            raise ValueError(f"backend=triton replays decode graphs only (1 token per request); "
                             f"a bucket of {tokens} tokens needs backend=flashinfer")
        max_rows = max(sp.rows for sp in pool.sub_pools)
        for key, g in forward_plan.groups.items():
            for role, t in g.passes:
                sk = (key, role, bucket, id(pool))
                st = self._static.get(sk)
                if st is None:
                    st = self._static[sk] = StaticTables.empty(bucket, bucket * max_rows,
                                                               g.window, dev)
                st.fill(t)
                self._passes.put(t, st)

    def run(self, tables, q, k_buf, v_buf, *, window, scale, softcap=None, sinks=None,
            lse: bool = True, k_scale: float = 1.0, v_scale: float = 1.0, new_kv=None):
        """One pass → (o, lse). new_kv: (k, v [total_q, Hkv, D], slots [total_q] int64), this
        step's rows, written here (in the decode kernel where it serves, else first)."""
        from swafactory.kernels.triton.ops import paged_attention, uses_decode

        t = self._passes.get(id(tables), tables)
        graphed = t is not tables
        if self.rows and (q.is_cuda or interpreting()) and rows_serve(q, k_buf, v_buf) and \
                uses_decode(q, t.qo_indptr, t.mask, t.max_q_len):
            nb = q.shape[0]
            splits = None
            if graphed:  # fixed by the bucket: the captured grid
                block_n = rows_config(k_buf.shape[1], k_buf.shape[2])[0]
                keys = (window + block_n) if window is not None else 1 << 30
                splits = rows_splits(nb, keys, block_n, q.device)
            return decode_rows(q, k_buf, v_buf, t.kv_indptr, t.kv_rows, t.q_pos, t.kv_pos,
                               window=window, scale=scale, softcap=softcap, sinks=sinks,
                               new_kv=_contiguous(new_kv), dummy_rows=self._page,
                               num_splits=splits,
                               counters=t.counters if graphed else self._counters)
        if new_kv is not None:  # a pass the decode kernel does not serve: the store first,
            k, v, slots = new_kv  # the dummy page (padding rows' target) kept as it was
            page = self._page
            kept = k_buf[:page].clone(), v_buf[:page].clone()
            k_buf.index_copy_(0, slots, k)
            v_buf.index_copy_(0, slots, v)
            k_buf[:page].copy_(kept[0])
            v_buf[:page].copy_(kept[1])
        return paged_attention(q, k_buf, v_buf, t.qo_indptr, t.kv_indptr, t.kv_rows,
                               t.q_pos, t.kv_pos, mask=t.mask, mask_indptr=t.mask_indptr,
                               window=window, scale=scale, softcap=softcap, sinks=sinks,
                               max_q_len=t.max_q_len, k_scale=k_scale, v_scale=v_scale)

    def merge(self, o1, lse1, o2, lse2, sinks=None):
        """Cascade merge → o."""
        from swafactory.kernels.triton.merge import merge_attention_states

        return merge_attention_states(o1, lse1, o2, lse2, sinks)[0]


def _contiguous(new_kv):
    if new_kv is None:
        return None
    k, v, slots = new_kv
    return k.contiguous(), v.contiguous(), slots
