"""A graph bucket's kernel tables at fixed addresses, refilled in place at every replay: what
a captured kernel reads (the Triton adapter's graph path, FlashInfer's tile, and the torch
reference's, whose CPU replays are emulated over them). No kernel library is imported here, so
the CPU path needs torch alone."""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["StaticTables", "static_tables", "chain_bucket"]


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
