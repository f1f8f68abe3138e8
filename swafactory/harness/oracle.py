"""The fp32 oracle: attention over one request's *logical* K/V history.

It never touches pools, page tables or index spaces. Keys are given in logical order with their
positions; what a query may see is written out plainly:

* structure: causal (key position ≤ query position) for extend and decode; for a draft tree,
  the prefix plus the query node's ancestors and itself; for a DFlash block, the prefix plus
  the whole block (non-causal inside it). Causality lives here, nowhere else;
* window: a query at position p sees keys at positions p-W+1 … p (HF `sliding_window = W`),
  where p is the tree node's own position, not its index in the flattened batch.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["oracle_attention", "masked_attention", "visibility", "tree_visibility",
           "causal_visibility"]

_FLOOR = -80.0
"""Scores below the row's max by more than this weigh exp(-80) ≈ 2e-35 of it: nothing in fp32
(and the exp of anything below -88, or of -inf, leaves the CPU's vector path)."""


def causal_visibility(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """[nq, nk] bool: a key is visible if it is not in the query's future."""
    return k_pos[None, :] <= q_pos[:, None]


def tree_visibility(prefix_len: int, parents: Sequence[int]) -> torch.Tensor:
    """Visibility of a draft tree laid after ``prefix_len`` prefix keys.

    ``parents[i]`` is the tree index of node i's parent, or -1 for a child of the prefix.
    Returns [n, prefix_len + n] bool: every node sees the prefix, its ancestors and itself.
    """
    n = len(parents)
    vis = torch.zeros(n, prefix_len + n, dtype=torch.bool)
    vis[:, :prefix_len] = True
    for i in range(n):
        j = i
        while j != -1:
            vis[i, prefix_len + j] = True
            j = parents[j]
    return vis


def visibility(q_pos: torch.Tensor, k_pos: torch.Tensor, structure: torch.Tensor,
               window: int | None, sink: int = 0) -> torch.Tensor:
    """[nq, nk] bool: ``structure`` and, with a window, the distance from the query's own
    position is < W (or, with a draft window's sink, the key's position is < S). Causality is
    part of ``structure`` (a DFlash block sees keys ahead of it)."""
    if window is None:
        return structure
    d = q_pos[:, None].long() - k_pos[None, :].long()
    inside = d < window
    if sink:
        inside = inside | (k_pos[None, :].long() < sink)
    return structure & inside


def oracle_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     q_pos: torch.Tensor, k_pos: torch.Tensor, structure: torch.Tensor, *,
                     window: int | None, scale: float | None = None,
                     softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one request's queries over its logical keys, in fp32.

    q: [nq, Hq, D]; keys, values: [nk, Hkv, D] (any float dtype; Hq % Hkv == 0);
    q_pos: [nq] int, k_pos: [nk] int (token positions); structure: [nq, nk] bool (causal, tree
    or block visibility before the window); sinks: [Hq] float or None. Returns [nq, Hq, D] fp32.
    A query that sees no key and has no sink gets zeros.
    """
    return masked_attention(q, keys, values, visibility(q_pos, k_pos, structure, window),
                            scale=scale, softcap=softcap, sinks=sinks)


def masked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     allowed: torch.Tensor, *, scale: float | None = None,
                     softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`oracle_attention` with the visibility already decided, for one request or a padded batch.

    One request: q [nq, Hq, D], keys/values [nk, Hkv, D], allowed [nq, nk] bool → [nq, Hq, D].
    A padded batch: the same with a leading B (allowed [B, nq, nk]) → [B, nq, Hq, D] fp32.
    Padding keys and queries are simply not allowed; a query that sees nothing gets zeros.
    """
    if q.dim() == 3:
        return masked_attention(q[None], keys[None], values[None], allowed[None], scale=scale,
                                softcap=softcap, sinks=sinks)[0]
    b, nq, hq, d = q.shape
    nk, hkv = keys.shape[1], keys.shape[2]
    group = hq // hkv
    scale = d ** -0.5 if scale is None else scale
    # GQA: query head h reads KV head h // group, so view q as [B·Hkv, group·nq, D]; the scale
    # goes on q (smaller than the scores) and every pass over the scores runs in place
    qg = q.float().reshape(b, nq, hkv, group, d).permute(0, 2, 3, 1, 4).reshape(b * hkv, group * nq, d)
    if softcap is None:
        qg = qg * scale
    kt = keys.float().permute(0, 2, 3, 1).reshape(b * hkv, d, nk)
    s = torch.bmm(qg, kt).reshape(b, hq, nq, nk)
    if softcap is not None:
        s = s.mul_(scale / softcap).tanh_().mul_(softcap)
    s.masked_fill_(~allowed[:, None], -math.inf)
    if sinks is not None:  # the sink is one more logit in each head's denominator, with no value
        s = torch.cat([s, sinks.float().view(1, hq, 1, 1).expand(b, hq, nq, 1)], dim=3)
    m = s.amax(dim=3, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    # clamp (`_FLOOR`: a CPU exp below -88 is 4-15x slower, its denormals slow the matmul ~20x),
    # then the keys not allowed to exactly 0
    p = s.sub_(m).clamp_(min=_FLOOR).exp_()
    p[..., :nk].masked_fill_(~allowed[:, None], 0.0)
    denom = p.sum(dim=3).permute(0, 2, 1)[..., None]  # [B, nq, Hq, 1]
    pv = p[..., :nk].reshape(b * hkv, group * nq, nk)
    vv = values.float().permute(0, 2, 1, 3).reshape(b * hkv, nk, d)
    out = torch.bmm(pv, vv).reshape(b, hkv, group, nq, d).permute(0, 3, 1, 2, 4).reshape(b, nq, hq, d)
    return torch.where(denom > 0, out / denom.clamp_min(1e-30), 0.0)
