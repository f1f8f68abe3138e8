"""The oracle's side of one forward: what each request's queries see, decided once, then every
layer's reference output in as few tensor operations as its size allows.

A forward checks every layer against the same requests, so visibility (structure and window) is
built once per (request, window) and the padded batch layout once per forward. Per layer:

* small passes (decode, verify, draft steps: the most frequent) run as one padded batch:
  ``[B, qmax, Hq, D]`` queries over ``[B, kmax, Hkv, D]`` keys, a few dozen operations whatever
  the batch size;
* large passes (prefill chunks) run request by request, in query chunks, so no score tensor
  grows past `SCORE_BUDGET` elements: many harness processes share one GPU's memory.
"""
from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from itertools import accumulate

import torch
from torch.nn.utils.rnn import pad_sequence

from swafactory.harness.oracle import (causal_visibility, masked_attention, tree_visibility,
                                       visibility)
from swafactory.metadata.batch import ReqForward

__all__ = ["ForwardOracle", "request_visibility", "SCORE_BUDGET"]

SCORE_BUDGET = 1 << 25
"""Elements of one fp32 [heads, queries, keys] score tensor (128 MiB) the oracle may build."""
CPU_PAD_WASTE = 1.0
"""On CPU, where compute rather than launches costs, pad only when it adds no work (the
factor of padded to real scores allowed); on a GPU the batch always pads within the budget."""


def _on(device: torch.device | str, t: torch.Tensor) -> torch.Tensor:
    """A small host tensor on the device without a sync: a blocking copy would wait for every
    kernel queued before it, and on a GPU shared by many processes each wait takes its turn."""
    return t.to(device, non_blocking=True)


def request_visibility(window: int | None, r: ReqForward, pos: Sequence[int],
                       device: torch.device | str, sink: int = 0) -> torch.Tensor:
    """[q_len, kv_end] bool: which of the request's logical keys (token positions ``pos`` in
    slot order) each of its queries sees: structure, then the window (and its sink)."""
    n = r.kv_end
    k_pos = _on(device, torch.tensor(pos[:n]))
    q_pos = _on(device, r.node_positions()[r.query_from:])
    if r.prefix_only:  # queries past the prefix that see all of it and none of the step's nodes
        structure = torch.ones(r.q_len, n, dtype=torch.bool, device=device)
    elif r.parents is not None:
        structure = _on(device, tree_visibility(r.prefix_len, list(r.parents)))[r.query_from:]
    elif r.block:
        structure = torch.ones(r.q_len, n, dtype=torch.bool, device=device)
    else:  # committed history and a chain: causal by position
        structure = causal_visibility(q_pos, k_pos)
    return visibility(q_pos, k_pos, structure, window, sink)


class ForwardOracle:
    """Reference outputs of one forward's layers. ``histories`` maps request id → `History`."""

    def __init__(self, reqs: Sequence[ReqForward], histories: Mapping[Hashable, object],
                 device: torch.device | str) -> None:
        self.reqs, self.hist, self.device = list(reqs), histories, device
        self.n = [r.kv_end for r in self.reqs]
        self.q_len = [r.q_len for r in self.reqs]
        self.qmax = max(self.q_len)
        self.row0 = list(accumulate(self.q_len, initial=0))[:-1]  # each one's first q row
        # the padded [B, qmax] layout, decided on the host: row b·qmax + i is q row row0[b] + i
        qi = torch.arange(self.qmax)
        lens = torch.tensor(self.q_len)
        valid = qi[None, :] < lens[:, None]                             # [B, qmax]
        index = torch.where(valid, torch.tensor(self.row0)[:, None] + qi[None, :], 0)
        self.q_index = _on(device, index.reshape(-1))
        self.q_valid = _on(device, valid.reshape(-1).nonzero().squeeze(1))  # padded rows kept
        self._vis: dict[tuple, list[torch.Tensor]] = {}
        self._padded: dict[tuple, torch.Tensor] = {}

    def visible(self, window: int | None, sink: int = 0) -> list[torch.Tensor]:
        """Per request, [q_len, n] bool (built on first use per window and sink)."""
        if (window, sink) not in self._vis:
            self._vis[window, sink] = [request_visibility(window, r, self.hist[r.rid].pos,
                                                          self.device, sink) for r in self.reqs]
        return self._vis[window, sink]

    def _padded_visible(self, window: int | None, sink: int, starts: tuple[int, ...],
                        kmax: int) -> torch.Tensor:
        """[B, qmax, kmax] bool: each request's visibility from its first kept history row."""
        key = (window, sink, starts)
        if key not in self._padded:
            pad = torch.zeros(len(self.reqs), self.qmax, kmax, dtype=torch.bool,
                              device=self.device)
            for i, (v, s) in enumerate(zip(self.visible(window, sink), starts)):
                pad[i, :v.shape[0], :v.shape[1] - s] = v[:, s:]
            self._padded[key] = pad
        return self._padded[key]

    def reference(self, spec, q: torch.Tensor, sinks: torch.Tensor | None,
                  raw: bool = False) -> torch.Tensor:
        """One layer's reference: q [total_q, Hq, D] → [total_q, Hq, D] fp32.
        ``spec``: the layer's `LayerSpec` (window, scale, soft-cap, history layer); ``raw``:
        over the K/V an fp8 layer was given, before its pool rounded them."""
        hq, d = q.shape[1], q.shape[2]
        kv = [self.hist[r.rid].kv_from(spec.history_layer, n, raw=raw)
              for r, n in zip(self.reqs, self.n)]
        starts = tuple(s for s, _, _ in kv)
        lens = [n - s for n, s in zip(self.n, starts)]
        kw = dict(scale=spec.scale, softcap=spec.softcap, sinks=sinks)
        if self._batched(hq, lens):
            keys = pad_sequence([k for _, k, _ in kv], batch_first=True)
            values = pad_sequence([v for _, _, v in kv], batch_first=True)
            qb = q[self.q_index].view(len(self.reqs), self.qmax, hq, d)
            allowed = self._padded_visible(spec.window, spec.sink, starts, max(lens))
            return masked_attention(qb, keys, values, allowed, **kw).reshape(-1, hq, d)[self.q_valid]
        refs = []
        for (s, keys, values), vis, row0, r in zip(kv, self.visible(spec.window, spec.sink),
                                                     self.row0, self.reqs):
            step = max(1, SCORE_BUDGET // max(1, hq * keys.shape[0]))
            for c in range(0, r.q_len, step):
                c1 = min(r.q_len, c + step)
                refs.append(masked_attention(q[row0 + c:row0 + c1], keys, values, vis[c:c1, s:],
                                             **kw))
        return torch.cat(refs)

    def _batched(self, hq: int, lens: list[int]) -> bool:
        padded = len(self.reqs) * self.qmax * max(lens)
        if hq * padded > SCORE_BUDGET:
            return False
        on_cpu = torch.device(self.device).type == "cpu"
        return not on_cpu or padded <= CPU_PAD_WASTE * sum(a * b for a, b in zip(self.q_len, lens))
