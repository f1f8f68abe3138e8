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

CUDA graphs (`plan(…, graph=(bucket, tokens))`): every mode. Each (group, pass, bucket, tokens)
owns static tables (indptrs, rows, positions; for several tokens a mask and its indptr) sized for
what ``bucket`` requests can read (``graph_keys``: bs × context, SWA bs × (W + tokens + page);
the largest sub-pool's rows when unset); `plan` refills them in place from the planner's device
tables (device-to-device copies, nothing read back), padding requests reading and writing the
dummy row 0. The kernels size their grids from static sizes alone, so a replay with fewer or
longer requests runs the captured launches. A multi-token bucket is captured with a mask; a
chain's requests get empty blocks, which the extend kernel reads as causal by position, so one
capture replays chains, trees and DFlash blocks with the eager step's kernels.

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

__all__ = ["Adapter", "StaticTables", "static_tables", "chain_bucket"]


@dataclass(eq=False)
class StaticTables:
    """A graph bucket's tables at fixed addresses (the kernel contract's names): ``n`` requests
    of up to ``tokens`` queries.

    qo_indptr: [n+1] int32; kv_indptr: [n+1] int32; kv_indices: [n·rows] int32; q_pos:
    [n·tokens] int32; kv_pos: [n·rows] int32 (rows: most keys per request, `graph_keys`). A
    multi-token bucket also holds mask: [n·tokens·rows] uint8 and mask_indptr: [n+1] int32; a
    request whose block is empty is causal by position (a chain), so one capture replays
    chains and trees.
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    q_pos: torch.Tensor
    kv_pos: torch.Tensor
    mask: torch.Tensor | None = None
    mask_indptr: torch.Tensor | None = None
    max_q_len: int = 1
    ar: torch.Tensor | None = None
    """[n+1] int32 ``arange`` (a multi-token bucket's; a decode bucket's ``qo_indptr`` is one):
    padding requests' offsets (one key, ``tokens`` queries each)."""

    @property
    def kv_rows(self) -> torch.Tensor:
        return self.kv_indices

    @property
    def nbytes(self) -> int:
        """Bytes of its device buffers."""
        return sum(t.numel() * t.element_size() for t in
                   (self.qo_indptr, self.kv_indptr, self.kv_indices, self.q_pos, self.kv_pos,
                    self.mask, self.mask_indptr, self.ar) if t is not None)

    @classmethod
    def empty(cls, n: int, max_kv: int, device, tokens: int = 1,
              masked: bool = True) -> StaticTables:
        """masked=False: a chain bucket, no mask (the kernel's causal rule by position, as
        eager runs a chain: its maskless variant)."""
        i32 = dict(dtype=torch.int32, device=device)
        mask = mask_indptr = None
        if tokens > 1 and masked:
            mask = torch.zeros(n * tokens * (max_kv // max(n, 1)), dtype=torch.uint8,
                               device=device)
            mask_indptr = torch.zeros(n + 1, **i32)
        ar = torch.arange(n + 1, **i32)
        return cls(ar * tokens if tokens > 1 else ar, ar.clone(), torch.zeros(max_kv, **i32),
                   torch.zeros(n * tokens, **i32), torch.zeros(max_kv, **i32), mask, mask_indptr,
                   tokens, ar if tokens > 1 else None)

    def fill(self, t, capture: bool = False) -> None:
        """Copy ``t`` (the planner's tables of B ≤ n requests of ≤ tokens queries) in; requests
        past B read one key, the dummy row 0 at position 0, from ``tokens`` queries at position
        0 (a multi-token bucket's padding queries are the bucket's last rows). A chain bucket
        (no mask) refuses a batch with a structure, but for a capture's shapes (``capture``)."""
        n = self.kv_indptr.numel() - 1
        tokens = self.max_q_len
        nb = t.batch_size
        total = int(t.kv_host[-1])  # host tensors (the planner's): nothing is read back
        total_q = int(t.qo_host[-1])
        if tokens == 1 and t.mask is not None:
            raise ValueError("a 1-token graph bucket runs the decode kernel, which takes no "
                             "structure mask: capture tokens >= 2 for masked batches")
        if nb > n or total + (n - nb) > self.kv_indices.numel() or t.max_q_len > tokens:
            raise ValueError(f"a graph bucket of {n} requests × {tokens} tokens over "
                             f"{self.kv_indices.numel()} keys cannot hold {nb} requests of "
                             f"{total} keys and up to {t.max_q_len} queries")
        self.kv_indptr[:nb + 1].copy_(t.kv_indptr)
        self.kv_indices[:total].copy_(t.kv_rows)
        self.kv_pos[:total].copy_(t.kv_pos)
        self.q_pos[:total_q].copy_(t.q_pos)
        if tokens > 1:
            self.qo_indptr[:nb + 1].copy_(t.qo_indptr)
            if self.mask is not None:
                self._fill_mask(t, nb)
            elif t.mask is not None and not capture:
                raise ValueError("this graph bucket was captured for plain chains (the spec "
                                 "makes no trees), but the batch has a structure (a tree or a "
                                 "block): run it eagerly, or capture with a tree spec")
        if nb < n:  # padding requests: one key each, after the batch's
            ones = self.ar if self.ar is not None else self.qo_indptr  # 0, 1, 2, ...
            torch.add(self.kv_indptr[nb:nb + 1], ones[1:n - nb + 1],
                      out=self.kv_indptr[nb + 1:])
            self.kv_indices[total:total + n - nb].zero_()
            self.kv_pos[total:total + n - nb].zero_()
            if tokens > 1:
                torch.add(self.qo_indptr[nb:nb + 1], self.ar[1:n - nb + 1], alpha=tokens,
                          out=self.qo_indptr[nb + 1:])
        if total_q < self.q_pos.numel():
            self.q_pos[total_q:].zero_()

    def _fill_mask(self, t, nb: int) -> None:
        """The planner's structure blocks (trees, blocks), else empty blocks: causal."""
        n = self.mask_indptr.numel() - 1
        if t.mask is None:
            self.mask_indptr.zero_()
            return
        m = t.mask.view(torch.uint8) if t.mask.dtype == torch.bool else t.mask
        if m.numel() > self.mask.numel():
            raise ValueError(f"a graph bucket's mask holds {self.mask.numel()} elements, the "
                             f"batch's structure has {m.numel()}")
        self.mask[:m.numel()].copy_(m)
        self.mask_indptr[:nb + 1].copy_(t.mask_indptr)
        if nb < n:  # padding requests: empty blocks
            self.mask_indptr[nb + 1:].copy_(self.mask_indptr[nb:nb + 1].expand(n - nb))


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
        self.graph_chains = False
        """The spec drafts chains (set by `AttentionBackend.init_cuda_graph_state`): a target
        verify bucket is captured without a mask (`chain_bucket`)."""

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
        dev = next(iter(forward_plan.groups.values())).tables.qo_indptr.device
        max_rows = max(sp.rows for sp in pool.sub_pools)
        chain = chain_bucket(self.graph_chains, self._mode)
        capture = getattr(forward_plan, "source_rule", None) == "graph capture"
        for key, g in forward_plan.groups.items():
            for role, t in g.passes:
                self._passes.put(t, static_tables(self._static, (key, role, bucket, tokens,
                                                                 id(pool)), t, dev, max_rows
                                                  if self.graph_keys is None else
                                                  self.graph_keys(g.window, tokens),
                                                  chain and g.cascade is None, capture))

    def graph_bytes(self) -> int:
        """Bytes of every graph bucket's static tables."""
        return sum(st.nbytes for st in self._static.values())

    def run(self, tables, q, k_buf, v_buf, *, window, scale, softcap=None, sinks=None,
            lse: bool = True, k_scale: float = 1.0, v_scale: float = 1.0, new_kv=None):
        """One pass → (o, lse); the kernel computes the LSE either way (``lse`` is a hint).
        new_kv: (k, v [total_q, Hkv, D], slots [total_q] int64), this step's rows, written here
        (by the decode kernel, else first)."""
        from swafactory.kernels.triton.ops import paged_attention

        t = self._passes.get(id(tables), tables)  # a graph bucket's static tables, or these
        splits = skip = None
        if t is not tables and window is not None and t.max_q_len == 1:  # a static decode
            # list is sized for the context: split by the window's keys instead
            splits = window_splits(q, k_buf, window)
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


def static_tables(cache: dict, key: tuple, t, device, keys: int, chain: bool = False,
                  capture: bool = False) -> StaticTables:
    """The bucket's `StaticTables` under ``key`` (group, role, bucket, tokens, pool id), made on
    first use with ``keys`` per request, refilled from ``t``. chain: a bucket of plain chains
    (`chain_bucket`), held without a mask, so its replay runs eager's maskless kernel; capture:
    ``t`` is a capture's shapes."""
    key = (*key, chain)
    st = cache.get(key)
    if st is None:
        bucket, tokens = key[2], key[3]
        st = cache[key] = StaticTables.empty(bucket, bucket * keys, device, tokens,
                                             masked=not chain)
    st.fill(t, capture)
    return st


def chain_bucket(chains: bool, mode: str | None) -> bool:
    """Whether a graph bucket of ``mode`` holds plain chains: target verify under a spec that
    makes no trees (``chains``: `AttentionBackend.init_cuda_graph_state` sets it). Eager runs
    those through the kernel's maskless variant; a masked capture of them ran GPT-OSS-20b's chain
    verify at bs 64 1.19× slower than eager (H200, `1b933cc`), where a tree's replay matched."""
    return chains and mode == "target_verify"


def window_splits(q: torch.Tensor, k_buf: torch.Tensor, window: int) -> int:
    """The decode kernel's splits for a graph bucket of a windowed group: planned from W keys
    per request (the static tables' size says nothing about a window). GPT-OSS's W = 128 at
    bs 8: one split, so no merge launch (the default would plan 8, six of them empty)."""
    nb, hq, d = q.shape
    hkv = k_buf.shape[1]
    block_n = decode_config(d, hq // hkv)[1]
    return plan_splits(nb * hkv, nb * window, nb, block_n, q.device)
