"""The target's hidden states that a feature draft reads (EAGLE-3, MTP/NEXTN), and where each
request's features wait on the device until the draft reads them.

A feature draft's row at position p reads the token at p and the feature of position p - 1:
the target's (fused) hidden state there when p - 1 is committed, else the draft's own output at
the node before (sglang's EAGLE and NEXTN workers read the same pairs, with the draft's K/V one
position earlier; RoPE is relative, so the scores are the same). Position 0 reads zeros.

`FeatureTap` records the target's hidden states during a forward with forward hooks (no change
to the model code, and inside a CUDA graph the hooked tensors are the graph's static outputs).
`FeatureBook` keeps per request, on the device: the feature of the last committed position, the
verify's rows, and the draft's own rows of this step. Every index it takes is a host fact (a
position, a node id, an accepted path), so no feature is ever read back.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from swafactory.serving.readback import pinned_ids

__all__ = ["FeatureTap", "FeatureBook", "eagle3_capture_ids"]


def eagle3_capture_ids(num_layers: int) -> list[int]:
    """sglang's default EAGLE-3 aux layers: the outputs of layers 1, L/2 - 1 and L - 4 (its
    ``layers_to_capture`` = these + 1: the inputs of layers 2, L/2 and L - 3), clamped to the
    model (a shallow target repeats a layer)."""
    return [min(max(i, 0), num_layers - 1) for i in (1, num_layers // 2 - 1, num_layers - 4)]


class FeatureTap:
    """Records a model's hidden states during each forward: the outputs of decoder layers
    ``layers`` (ids into ``model.model.layers``), or of the final norm for ``"norm"``,
    concatenated in that order. `take` returns the last forward's [T, F] (one packed sequence)."""

    def __init__(self, model, sources: Sequence[int | str]) -> None:
        self.sources = list(sources)
        self._got: list[torch.Tensor | None] = [None] * len(self.sources)
        self._handles = []
        for i, s in enumerate(self.sources):
            mod = model.model.norm if s == "norm" else model.model.layers[s]
            self._handles.append(mod.register_forward_hook(self._hook(i)))

    def _hook(self, i: int):
        def hook(_mod, _args, out):
            self._got[i] = out[0] if isinstance(out, tuple) else out
        return hook

    def take(self) -> torch.Tensor:
        """[T, F] of the last forward (F = hidden × sources), in the model's dtype."""
        if any(g is None for g in self._got):
            raise RuntimeError("FeatureTap.take before a forward ran the tapped layers")
        out = torch.cat([g.reshape(-1, g.shape[-1]) for g in self._got], dim=-1)
        self._got = [None] * len(self.sources)
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _take(rows: torch.Tensor, idx: Sequence[int]) -> torch.Tensor:
    """rows[idx] (host node ids) without a blocking host-to-device copy: a slice where the ids
    are consecutive (chains, a prefix path), else a pinned index copy (trees)."""
    idx = list(idx)
    if idx == list(range(idx[0], idx[0] + len(idx))):
        return rows[idx[0]:idx[0] + len(idx)]
    return rows.index_select(0, pinned_ids(idx, rows.device))


class FeatureBook:
    """Each request's features on the device ([F] rows, the draft's input width), and the
    feature inputs of each draft forward.

    last: the feature of position ``committed - 1`` (what the next step's root reads); chunk: a
    prefill chunk's target rows until the draft's extend reads them; verify: the verify's rows
    by node; own: the draft's own output rows of this step by node; extend: the inputs of the
    ``draft_extend`` over the accepted path."""

    def __init__(self, width: int, device: torch.device, dtype: torch.dtype,
                 shifted: bool = True) -> None:
        self.width, self.device, self.dtype = width, device, dtype
        self.shifted = shifted  # False: a row reads its own position's features (DFlash)
        self.last: dict[Hashable, torch.Tensor] = {}    # [1, F]
        self.chunk: dict[Hashable, torch.Tensor] = {}   # [n, F]
        self.verify: dict[Hashable, torch.Tensor] = {}  # [nodes, F]
        self.own: dict[Hashable, torch.Tensor] = {}     # [nodes queried so far, F]
        self.extend: dict[Hashable, torch.Tensor] = {}  # [accepted, F]

    def _before(self, rid: Hashable) -> torch.Tensor:
        """[1, F]: the feature of the position before the newest uncommitted one (zeros
        before position 0)."""
        first = self.last.get(rid)
        if first is None:
            return torch.zeros(1, self.width, device=self.device, dtype=self.dtype)
        return first

    def _prefix(self, rid: Hashable, rows: torch.Tensor, n: int) -> torch.Tensor:
        """Inputs of ``n`` positions p … p + n - 1 whose target features are ``rows`` ([n, F]):
        the feature before p, then rows[:n - 1] (unshifted: rows[:n])."""
        if not self.shifted:
            return rows[:n]
        return torch.cat([self._before(rid), rows[:n - 1]])

    def target_rows(self, mode: str, reqs, fused: torch.Tensor) -> None:
        """After a target forward: its rows' features ([T, F], request by request)."""
        row = 0
        for f in reqs:
            rows, row = fused[row:row + f.q_len], row + f.q_len
            if mode == "target_verify":
                self.verify[f.rid] = rows
            elif mode == "extend":
                self.chunk[f.rid] = rows

    def draft_rows(self, reqs, hidden: torch.Tensor) -> None:
        """After a draft_decode: the draft's own output rows ([T, F]) by the nodes queried."""
        row = 0
        for f in reqs:
            rows, row = hidden[row:row + f.q_len], row + f.q_len
            kept = self.own.get(f.rid) if f.query_from else None
            self.own[f.rid] = rows if kept is None else torch.cat([kept[:f.query_from], rows])

    def inputs(self, mode: str, reqs, early: bool = False) -> torch.Tensor:
        """The feature inputs [T, F] of a draft forward's query rows. A query node reads its
        parent's feature: the root reads ``last``, a drafted node the draft's own row of its
        parent; a committed position (``draft_extend``) the target's row before it."""
        out = []
        for f in reqs:
            rid = f.rid
            if mode == "draft_decode" and f.block:  # DFlash's block rows read no features
                out.append(torch.zeros(f.q_len, self.width, device=self.device,
                                       dtype=self.dtype))
            elif mode == "draft_decode":
                nodes = range(f.query_from, f.nodes)
                par = [i - 1 if f.parents is None else f.parents[i] for i in nodes]
                if par[0] < 0:  # the root (a chain's step 0, a tree's level 0)
                    out.append(self._before(rid))
                    par = par[1:]
                if par:
                    out.append(_take(self.own[rid], par))
            elif rid in self.chunk:  # a prefill chunk's draft extend
                rows = self.chunk.pop(rid)
                out.append(self._prefix(rid, rows, f.q_len))
                self.last[rid] = rows[-1:]
            elif early:  # every verified chain node, before the accept lengths are back
                out.append(self._prefix(rid, self.verify[rid], f.q_len))
            else:
                out.append(self.extend.pop(rid))
        return torch.cat(out)

    def accepted(self, rid: Hashable, path: Sequence[int]) -> None:
        """After a verify's accept (``path``: node ids, host): the inputs of the draft_extend
        over the accepted positions, and ``last`` = the feature of the newest one."""
        rows = _take(self.verify[rid], path)
        self.extend[rid] = self._prefix(rid, rows, len(path))
        self.last[rid] = rows[-1:]

    def drop(self, rid: Hashable) -> None:
        for d in (self.last, self.chunk, self.verify, self.own, self.extend):
            d.pop(rid, None)
