"""The triton backend's adapter: planner tables to our Triton kernels, eagerly or in CUDA graphs.

Every pass goes to `ops.paged_attention` (decode or extend by the tables). A decode pass takes
this step's K/V from the backend (``new_kv``) and its kernel writes them: split 0 of each
(request, KV head) stores the row, the last split attends to it from registers. That is two
launches less per layer, what a small batch under a CUDA graph pays for (GPT-OSS at bs 8: the
48 ``index_copy_`` writes took 165 µs of a 1.06 ms step). The backend hands ``new_kv`` to decode
passes only; other passes it stores first, as for every adapter.

At head_dim 64 in bf16 on Hopper (GPT-OSS) `decode_attention` sends the pass to our CUDA
cluster kernel (`kernels/cuda/decode_d64.cu`), with the same contract: the splits merge inside
the kernel, so a layer is one launch (GPT-OSS graphed step at bs 8 0.568 ms, 1.48× the floor;
bs 64 3.19 ms). Over fp8 e4m3 pools at head_dim 256/512 (Gemma 4) decode goes to
`kernels/cuda/decode_fp8.cu`, the step's K/V stored (quantized) first.

CUDA graphs (`plan(…, graph=(bucket, 1))`): decode buckets only. Each (group, pass, bucket) owns
static tables (indptr, rows, positions) sized for what ``bucket`` requests can read (``graph_keys``:
bs × context, SWA bs × (W + 1 + page); the largest sub-pool's rows when unset);
`plan` refills them in place from the planner's device tables (device-to-device copies, nothing
read back), padding requests reading and writing the dummy row 0. The decode kernel sizes its
grid from static sizes alone, so a replay with fewer or longer requests runs the captured
launches. Multi-token buckets (verify, draft extend) are refused: use backend=flashinfer there.

Measured and dropped (H200, `695e8c6`, bench/results/probe-decode-rows-695e8c6.json): a decode
kernel reading whole pool rows per (request, split), all KV heads at once, with the split merge
in the kernel's last program. Its serial merge tail made GPT-OSS's bs-8 full layer 67-112 µs
against the per-head kernel's 55, and the whole graphed step 1.15 ms against 1.01. The split
merge inside this kernel (`6d5bdb3`, reverted): bs-8 graphed step 0.896 ms against 0.626.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from swafactory.kernels.triton import CAPABILITIES  # defined before __init__ imports this module
from swafactory.kernels.triton.decode import decode_config
from swafactory.kernels.triton.merge import plan_splits
from swafactory.metadata.plan import PassCache

__all__ = ["Adapter", "StaticTables"]


@dataclass(eq=False)
class StaticTables:
    """A decode graph bucket's tables at fixed addresses (the kernel contract's names).

    qo_indptr: [n+1] int32 = arange; kv_indptr: [n+1] int32; kv_indices: [n·rows] int32;
    q_pos: [n] int32; kv_pos: [n·rows] int32 (rows: most keys per request, `graph_keys`).
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    q_pos: torch.Tensor
    kv_pos: torch.Tensor
    mask = None
    mask_indptr = None
    max_q_len = 1

    @property
    def kv_rows(self) -> torch.Tensor:
        return self.kv_indices

    @classmethod
    def empty(cls, n: int, max_kv: int, device) -> StaticTables:
        i32 = dict(dtype=torch.int32, device=device)
        return cls(torch.arange(n + 1, **i32), torch.arange(n + 1, **i32),
                   torch.zeros(max_kv, **i32), torch.zeros(n, **i32), torch.zeros(max_kv, **i32))

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
        self._page = 1  # the planned pool's page size: its first page is the dummy
        self.kernels = None
        """The backend's `registry.kernel_choice.KernelPolicy` (set by `build_backend`): whether
        our CUDA kernels may serve a pass; None: wherever they fit."""
        self._mode = None  # the planned forward's mode: which pass's choice serves it
        self.graph_keys = None
        """(window, tokens) → most keys one request of a graph bucket lists (set by
        `AttentionBackend.init_cuda_graph_state`); None: the largest sub-pool's rows."""

    def plan(self, forward_plan, pool, *, sigs=None, graph: tuple[int, int] | None = None) -> None:
        """Host work of one forward: none eagerly; for a graph bucket, refill its static tables
        from the planner's (device-to-device copies)."""
        del sigs
        self._passes.clear()
        self._mode = getattr(forward_plan, "mode", None)
        self._page = pool.sub_pools[0].page_size
        if graph is None or not forward_plan.groups:
            return
        bucket, tokens = graph
        if tokens != 1:
            raise ValueError(f"backend=triton replays decode graphs only (1 token per request); "
                             f"a bucket of {tokens} tokens needs backend=flashinfer")
        dev = next(iter(forward_plan.groups.values())).tables.qo_indptr.device
        max_rows = max(sp.rows for sp in pool.sub_pools)
        for key, g in forward_plan.groups.items():
            for role, t in g.passes:
                sk = (key, role, bucket, id(pool))
                st = self._static.get(sk)
                if st is None:
                    keys = max_rows if self.graph_keys is None else self.graph_keys(g.window, 1)
                    st = self._static[sk] = StaticTables.empty(bucket, bucket * keys, dev)
                st.fill(t)
                self._passes.put(t, st)

    def graph_bytes(self) -> int:
        """Bytes of every graph bucket's static tables."""
        return sum(t.numel() * t.element_size() for st in self._static.values()
                   for t in (st.qo_indptr, st.kv_indptr, st.kv_indices, st.q_pos, st.kv_pos))

    def run(self, tables, q, k_buf, v_buf, *, window, scale, softcap=None, sinks=None,
            lse: bool = True, k_scale: float = 1.0, v_scale: float = 1.0, new_kv=None):
        """One pass → (o, lse); the kernel computes the LSE either way (``lse`` is a hint).
        new_kv: (k, v [total_q, Hkv, D], slots [total_q] int64), this step's rows, written here
        (by the decode kernel, else first)."""
        from swafactory.kernels.triton.ops import paged_attention

        t = self._passes.get(id(tables), tables)  # a graph bucket's static tables, or these
        splits = skip = None
        if t is not tables and window is not None:  # a static list is sized for the context:
            splits = window_splits(q, k_buf, window)  # split by the window's keys instead
            skip = False  # and holds the planner's trimmed lists: no tile test, loads pipelined
        return paged_attention(q, k_buf, v_buf, t.qo_indptr, t.kv_indptr, t.kv_rows,
                               t.q_pos, t.kv_pos, mask=t.mask, mask_indptr=t.mask_indptr,
                               window=window, scale=scale, softcap=softcap, sinks=sinks,
                               max_q_len=t.max_q_len, k_scale=k_scale, v_scale=v_scale,
                               new_kv=new_kv, dummy_rows=self._page, num_splits=splits,
                               skip_empty=skip, cuda=None if self.kernels is None else
                               self.kernels.cuda(self._mode, window is not None))

    def merge(self, o1, lse1, o2, lse2, sinks=None):
        """Cascade merge → o."""
        from swafactory.kernels.triton.merge import merge_attention_states

        return merge_attention_states(o1, lse1, o2, lse2, sinks)[0]


def window_splits(q: torch.Tensor, k_buf: torch.Tensor, window: int) -> int:
    """The decode kernel's splits for a graph bucket of a windowed group: planned from W keys
    per request (the static tables' size says nothing about a window). GPT-OSS's W = 128 at
    bs 8: one split, so no merge launch (the default would plan 8, six of them empty)."""
    nb, hq, d = q.shape
    hkv = k_buf.shape[1]
    block_n = decode_config(d, hq // hkv)[1]
    return plan_splits(nb * hkv, nb * window, nb, block_n, q.device)
