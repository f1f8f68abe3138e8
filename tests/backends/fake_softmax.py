"""The fakes' attention arithmetic (`flashinfer_fake`, `fa4_fake`): one request's grouped-query
softmax attention in fp32, as the libraries define it.

A key that is not allowed weighs exactly 0 (so a NaN value there still poisons the output, as a
kernel that multiplies it does); a query that sees no key gets zeros and lse -inf.
"""
from __future__ import annotations

import math

import torch

__all__ = ["attend"]

_FLOOR = -80.0  # exp of -inf or below -88 leaves the CPU's vector path (4-15x slower)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ok: torch.Tensor, scale: float,
           softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """q [nq, Hq, D], k / v [nk, Hkv, D] (fp32), ok [nq, nk] bool → (o [nq, Hq, D] fp32,
    natural-log lse [Hq, nq]); query head h reads KV head h // (Hq // Hkv)."""
    nq, hq, d = q.shape
    hkv = k.shape[1]
    if k.shape[0] == 0:  # no key at all
        return torch.zeros(nq, hq, d), torch.full((hq, nq), -math.inf)
    s = torch.einsum("qhgd,khd->hgqk", q.float().view(nq, hkv, hq // hkv, d), k)
    s = s.reshape(hq, nq, -1) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s.masked_fill_(~ok[None], -math.inf)
    m = s.amax(dim=2, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = s.sub_(m).clamp_(min=_FLOOR).exp_().masked_fill_(~ok[None], 0.0)
    den = p.sum(dim=2, keepdim=True)
    o = torch.einsum("hgqk,khd->qhgd", p.view(hkv, hq // hkv, nq, -1), v).reshape(nq, hq, d)
    o = o / torch.where(den > 0, den, torch.ones_like(den)).permute(1, 0, 2)
    return o, (m + torch.log(den))[..., 0]
