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

Measured and dropped (H200, `695e8c6`; its probe rows are in git history): a decode
kernel reading whole pool rows per (request, split), all KV heads at once, with the split merge
in the kernel's last program. Its serial merge tail made GPT-OSS's bs-8 full layer 67-112 µs
against the per-head kernel's 55, and the whole graphed step 1.15 ms against 1.01. The split
merge inside this kernel (`6d5bdb3`, reverted): bs-8 graphed step 0.896 ms against 0.626.
"""
from __future__ import annotations

import torch

from swafactory.kernels.cuda import KernelEnv, running_under
from swafactory.kernels.triton import CAPABILITIES  # defined before __init__ imports this module
from swafactory.kernels.triton.decode import decode_config
from swafactory.kernels.triton.merge import plan_splits
from swafactory.kernels.static_tables import StaticTables, chain_bucket, static_tables
from swafactory.metadata.batch import MODE_PASS
from swafactory.metadata.plan import PassCache

__all__ = ["Adapter", "StaticTables", "static_tables", "chain_bucket"]


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
        self.env = KernelEnv.read()
        """The environment overrides the kernels obey (`kernels.cuda.KernelEnv`), read once
        (`build_backend` sets one snapshot for all its adapters): `run` and `merge` run under
        it, so a layer's call reads no ``os.environ``."""

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

    def graph_route(self, mode: str, tokens: int) -> tuple[str, str]:
        """What a bucket of ``mode`` captures: the pass (it decides whether our CUDA kernels
        serve) and the variant (decode, a maskless chain, masked)."""
        variant = ("chain" if chain_bucket(self.graph_chains, mode) else
                   "decode" if tokens == 1 else "masked")
        return MODE_PASS.get(mode, "extend"), variant

    def graph_binding(self) -> tuple:
        """Which static tables the current plan's launches read (`AttentionBackend.bound_as`)."""
        return dict(self._passes), self._mode, self._page

    def restore_binding(self, state: tuple) -> None:
        self._passes.clear()
        self._passes.update(state[0])
        self._mode, self._page = state[1], state[2]

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
        with running_under(self.env):  # the kernels read the snapshot, not the environment
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

        with running_under(self.env):
            return merge_attention_states(o1, lse1, o2, lse2, sinks)[0]


def window_splits(q: torch.Tensor, k_buf: torch.Tensor, window: int) -> int:
    """The decode kernel's splits for a graph bucket of a windowed group: planned from W keys
    per request (the static tables' size says nothing about a window). GPT-OSS's W = 128 at
    bs 8: one split, so no merge launch (the default would plan 8, six of them empty)."""
    nb, hq, d = q.shape
    hkv = k_buf.shape[1]
    block_n = decode_config(d, hq // hkv)[1]
    return plan_splits(nb * hkv, nb * window, nb, block_n, q.device)
