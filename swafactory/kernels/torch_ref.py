"""The torch reference backend: exact fp32 gather + masked softmax over the planner's tables.

It is the CPU default and the readable statement of the kernel contract (`metadata.AttnTables`):
per request, gather the key rows, score them in fp32, mask by structure and window position,
add the sink to the denominator, and return the output with its log-sum-exp.
"""
from __future__ import annotations

import math

import torch

from swafactory.registry.capabilities import Capabilities

__all__ = ["CAPABILITIES", "Adapter", "attend", "merge_states", "apply_sinks"]

_TINY = torch.finfo(torch.float32).tiny

CAPABILITIES = Capabilities(
    name="torch",
    summary="fp32 gather + masked softmax over the same plans; the CPU default and the reference",
    kernel="torch fp32 gather+softmax",
    devices=frozenset({"cpu", "cuda"}),
    tree_masks=frozenset({"custom_mask", "cascade"}),
    sinks=True,
    sinks_note="sink logits join the softmax denominator",
    softcap=True,
    kv_dtypes=frozenset({"float32", "float16", "bfloat16"}),
)


def attend(tables, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, *,
           window: int | None, scale: float, softcap: float | None = None,
           sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass of the kernel contract.

    tables: `metadata.AttnTables`. q: [total_q, Hq, D]; k_buf, v_buf: [rows, Hkv, D];
    sinks: [Hq] or None. Returns o [total_q, Hq, D] (q's dtype) and lse [total_q, Hq] fp32.
    A masked key never contributes, even if its row holds NaN (a poisoned, freed slot); a NaN in
    a visible key reaches the output, which is how check mode exposes stale reads.
    """
    total_q, hq, d = q.shape
    hkv = k_buf.shape[1]
    group = hq // hkv
    o = torch.zeros(total_q, hq, d, dtype=torch.float32, device=q.device)
    lse = torch.full((total_q, hq), -math.inf, dtype=torch.float32, device=q.device)
    qo, kvp = tables.qo_indptr.tolist(), tables.kv_indptr.tolist()
    mi = tables.mask_indptr.tolist() if tables.mask is not None else None
    idx_all = tables.kv_indices.tensor.long()
    for b in range(len(qo) - 1):
        q0, q1, k0, k1 = qo[b], qo[b + 1], kvp[b], kvp[b + 1]
        if q1 == q0:
            continue
        qp, kp = tables.q_pos[q0:q1].long(), tables.kv_pos[k0:k1].long()
        if mi is not None:
            allowed = tables.mask[mi[b]:mi[b + 1]].view(q1 - q0, k1 - k0).bool()
        else:
            allowed = kp[None, :] <= qp[:, None]
        if window is not None:
            allowed = allowed & (qp[:, None] - kp[None, :] < window)
        idx = idx_all[k0:k1]
        nq, nk = q1 - q0, k1 - k0
        k, v = k_buf[idx].float(), v_buf[idx].float()  # [nk, Hkv, D]
        # query head h reads KV head h // group: batch over KV heads, rows (group, query)
        qg = q[q0:q1].float().reshape(nq, hkv, group, d).permute(1, 2, 0, 3).reshape(hkv, -1, d)
        s = torch.bmm(qg, k.permute(1, 2, 0)).reshape(hq, nq, nk) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~allowed[None], -math.inf)
        if sinks is not None:
            s = torch.cat([s, sinks.float().view(hq, 1, 1).expand(hq, nq, 1)], dim=2)
        m = torch.logsumexp(s, dim=2)  # [Hq, nq]
        p = torch.exp(s - m.masked_fill(torch.isinf(m), 0)[..., None])[..., :nk]
        p = p.masked_fill(p < _TINY, 0.0)  # denormals (< 1e-38 of the sum) slow CPU matmuls ~20×
        # 0 · NaN is NaN: multiply by NaN-free values, then mark queries that *see* a NaN row
        bad = torch.isnan(v).any(dim=2)  # [nk, Hkv]
        if bad.any():
            v = torch.nan_to_num(v, nan=0.0)
        out = torch.bmm(p.reshape(hkv, group * nq, nk), v.permute(1, 0, 2).contiguous())
        out = out.reshape(hkv, group, nq, d).permute(2, 0, 1, 3).reshape(nq, hq, d)
        if bad.any():
            sees = (allowed.float() @ bad.float()) > 0  # [nq, Hkv]
            out[sees.repeat_interleave(group, dim=1)] = math.nan
        o[q0:q1], lse[q0:q1] = out, m.T
    return o.to(q.dtype), lse


def merge_states(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Merge two partial passes (cascade) and add the sink once.

    o1, o2: [n, H, D]; lse1, lse2: [n, H] fp32 (-inf = the pass saw no key); sinks: [H] or None.
    Returns [n, H, D] in o1's dtype.
    """
    parts = [lse1, lse2] + ([sinks.float().expand_as(lse1)] if sinks is not None else [])
    lse = torch.logsumexp(torch.stack(parts), dim=0)
    safe = lse.masked_fill(torch.isinf(lse), 0)
    w1 = torch.exp(lse1 - safe)[..., None]
    w2 = torch.exp(lse2 - safe)[..., None]
    return (w1 * o1.float() + w2 * o2.float()).to(o1.dtype)


def apply_sinks(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Add one sink logit per head to the softmax denominator, after the fact (exact).

    o: [n, H, D]; lse: [n, H] natural-log fp32 (-inf = no visible key); sinks: [H].
    With ``Z = exp(lse)`` the sinkless denominator, the sink-aware output is
    ``o · Z / (Z + exp(sink)) = o · σ(lse - sink)`` and its LSE is ``logaddexp(lse, sink)``.
    """
    s = sinks.float().view(1, -1)
    w = torch.sigmoid(lse - s)
    return (o.float() * w[..., None]).to(o.dtype), torch.logaddexp(lse, s)


class Adapter:
    """Wires planner tables to `attend`; holds no pool logic."""

    capabilities = CAPABILITIES

    def run(self, tables, q, k_buf, v_buf, *, window, scale, softcap=None, sinks=None):
        """One pass → (o, lse)."""
        return attend(tables, q, k_buf, v_buf, window=window, scale=scale, softcap=softcap,
                      sinks=sinks)

    def merge(self, o1, lse1, o2, lse2, sinks=None):
        """Cascade merge → o."""
        return merge_states(o1, lse1, o2, lse2, sinks)
