"""The torch reference backend, and the kernel contract executed in torch.

It is the CPU default, the Triton backend's CPU fallback, and the tests' second opinion: the
readable statement of what every adapter computes for one pass.

One call attends the queries of a batch over paged K/V of one layer, in flattened CSR form
(built once per forward by the planner):

* ``q``: [total_q, Hq, D] fp32/fp16/bf16. ``k_buf``, ``v_buf``: [rows, Hkv, D], the layer's pool
  buffers (Hq % Hkv == 0; query head h reads KV head h // (Hq // Hkv)).
* ``qo_indptr``: [B+1] int32 — request b owns queries ``qo_indptr[b]:qo_indptr[b+1]``.
* ``kv_indptr``: [B+1] int32; ``kv_indices``: [total_kv] int32/int64 — pool rows of request b's
  keys, in logical order. Row 0 (the dummy slot) may appear only where the key is masked out.
* ``q_pos``: [total_q] int32, ``kv_pos``: [total_kv] int32 — token positions (tree nodes sit at
  prefix_len + depth, so positions need not be contiguous or monotonic).
* ``mask``: bool/uint8, request b's [q_len_b, kv_len_b] block row-major from ``mask_indptr[b]``
  ([B+1] int32, in elements); it is the *structure* (causal, tree ancestry, DFlash block).
  ``None`` means causal: ``kv_pos <= q_pos``; so does a request's empty block
  (``mask_indptr[b] == mask_indptr[b+1]``: a chain request in a graph bucket captured with a
  mask). Causality lives only in the structure.
* ``window``: HF W or None; allowed = structure & (q_pos - kv_pos < W); ``sink``: S, a draft
  window's sink (``spec.draft_sink``): allowed = structure & (q_pos - kv_pos < W or kv_pos < S).
* ``scale``: softmax scale; ``softcap``: s = cap·tanh(s/cap) before masking; ``sinks``: [Hq]
  fp32, one extra logit per head in the denominator with a zero value.
* ``k_scale``, ``v_scale``: host floats; fp8 buffers hold K / k_scale and V / v_scale
  (`swafactory.kvcache.quant`), so a kernel reads K = stored · k_scale (1.0 for other dtypes).

Returns ``o`` [total_q, Hq, D] in q's dtype and ``lse`` [total_q, Hq] fp32 (natural log of the
masked scores' sum, sink included). A query that sees nothing and has no sink gets o = 0 and
lse = -inf. A non-finite K/V row that a query cannot see never reaches it; one it sees does.
"""
from __future__ import annotations

import math

import torch

from swafactory.kernels.static_tables import static_tables
from swafactory.metadata.batch import MODE_PASS
from swafactory.metadata.plan import PassCache
from swafactory.registry.capabilities import Capabilities
from swafactory.window import in_window

__all__ = ["CAPABILITIES", "Adapter", "attend", "attention_reference", "check_contract",
           "merge_state", "apply_sinks"]

_FLOOR = -80.0
"""Scores below the row's max by more than this weigh exp(-80) ≈ 2e-35 of it: nothing in fp32."""
_SCORE_BUDGET = 1 << 25  # elements of one fp32 score chunk (128 MiB): parallel runs share a GPU

CAPABILITIES = Capabilities(
    name="torch",
    summary="fp32 gather + masked softmax over the same plans; the CPU default and the reference",
    kernel="torch fp32 gather+softmax",
    devices=frozenset({"cpu", "cuda"}),
    tree_masks=frozenset({"custom_mask", "cascade"}),
    sinks=True,
    sinks_note="sink logits join the softmax denominator",
    softcap=True,
    graph_emulation=True,  # CPU: a replay runs the captured step over its bucket's static tables
    kv_dtypes=frozenset({"float32", "float16", "bfloat16", "fp8_e4m3"}),
    draft_sink=True,  # a second key range is one more term of the position mask
)


def check_contract(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                   qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                   q_pos: torch.Tensor, kv_pos: torch.Tensor, mask: torch.Tensor | None,
                   mask_indptr: torch.Tensor | None, sinks: torch.Tensor | None) -> tuple[int, int]:
    """Shape checks shared by every implementation; returns (B, group). Never syncs the device."""
    if q.dim() != 3 or k_buf.dim() != 3 or v_buf.shape != k_buf.shape:
        raise ValueError(f"q must be [total_q, Hq, D] and k_buf/v_buf [rows, Hkv, D] alike; got "
                         f"{tuple(q.shape)}, {tuple(k_buf.shape)}, {tuple(v_buf.shape)}")
    hq, d = q.shape[1], q.shape[2]
    hkv = k_buf.shape[1]
    if k_buf.shape[2] != d or hq % hkv:
        raise ValueError(f"head_dim {k_buf.shape[2]} vs {d}, or Hq={hq} not a multiple of Hkv={hkv}")
    b = qo_indptr.numel() - 1
    if kv_indptr.numel() != b + 1 or q_pos.numel() != q.shape[0] or kv_pos.numel() != kv_indices.numel():
        raise ValueError("indptr/positions disagree with q or kv_indices in length")
    if (mask is None) != (mask_indptr is None):
        raise ValueError("mask and mask_indptr come together")
    if sinks is not None and sinks.numel() != hq:
        raise ValueError(f"sinks must be [Hq={hq}], got {tuple(sinks.shape)}")
    return b, hq // hkv


def attention_reference(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                        qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                        kv_indices: torch.Tensor, q_pos: torch.Tensor, kv_pos: torch.Tensor, *,
                        mask: torch.Tensor | None = None, mask_indptr: torch.Tensor | None = None,
                        window: int | None = None, scale: float, softcap: float | None = None,
                        sinks: torch.Tensor | None = None, k_scale: float = 1.0,
                        v_scale: float = 1.0, sink: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract above in fp32, vectorized per request. Returns (o, lse)."""
    nb, group = check_contract(q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, q_pos, kv_pos,
                               mask, mask_indptr, sinks)
    total_q, hq, d = q.shape
    hkv = hq // group
    o = torch.zeros(total_q, hq, d, dtype=torch.float32, device=q.device)
    lse = torch.full((total_q, hq), -math.inf, dtype=torch.float32, device=q.device)
    qo, kv = qo_indptr.tolist(), kv_indptr.tolist()
    mo = mask_indptr.tolist() if mask_indptr is not None else None
    sk = sinks.float().view(hkv, group) if sinks is not None else None
    for b in range(nb):
        q0, q1, k0, k1 = qo[b], qo[b + 1], kv[b], kv[b + 1]
        nq, nk = q1 - q0, k1 - k0
        if nq == 0 or nk == 0:  # no key: zeros, and lse -inf as initialized or the sink's
            if nq and sk is not None:  # logit, the whole denominator
                lse[q0:q1] = sk.reshape(1, hq).expand(nq, hq)
            continue
        rows = kv_indices[k0:k1].long()
        kb, vb = k_buf[rows].float(), v_buf[rows].float()                    # [nk, Hkv, D]
        if k_scale != 1.0 or v_scale != 1.0:  # dequantized (an fp8 pool)
            kb, vb = kb * k_scale, vb * v_scale
        kp = kv_pos[k0:k1].long()
        # 0·NaN would leak a masked non-finite value: multiply clean values, then poison only
        # the queries that really see a non-finite value.
        # (a row with a non-finite value is zeroed whole: every query that sees it is poisoned
        # anyway, and one that does not gives it weight exactly 0; amax propagates NaN)
        bad = ~torch.isfinite(vb.abs().amax(-1))                             # [nk, Hkv]
        vclean = vb.masked_fill(bad[..., None], 0.0)
        kt, vt = kb.permute(1, 2, 0), vclean.permute(1, 0, 2)                # [Hkv, D, nk], [Hkv, nk, D]
        bad = bad.float()
        # queries in chunks: a long prefill's [Hq, nq, nk] scores stay within _SCORE_BUDGET
        step = max(1, _SCORE_BUDGET // max(1, hq * nk))
        for c0 in range(q0, q1, step):
            c1 = min(q1, c0 + step)
            n = c1 - c0
            qp = q_pos[c0:c1].long()
            if mask is None or mo[b + 1] == mo[b]:  # causal (an empty block too)
                allowed = kp[None, :] <= qp[:, None]
            else:
                m0 = mo[b] + (c0 - q0) * nk
                allowed = mask[m0:m0 + n * nk].view(n, nk).bool()
            if window is not None:
                allowed = allowed & in_window(qp[:, None] - kp[None, :], kp[None, :], window,
                                              sink)
            # [Hkv, G·n, D] @ [Hkv, D, nk]: the scale folded into q (smaller than the scores),
            # then every pass over the scores in place, one exp (a logsumexp would take two)
            qh = q[c0:c1].float().view(n, hkv, group, d).permute(1, 2, 0, 3).reshape(
                hkv, group * n, d)
            if softcap is None:
                qh = qh * scale
            s = torch.bmm(qh, kt).view(hkv, group, n, nk)                       # [Hkv, G, n, nk]
            if softcap is not None:
                s = s.mul_(scale / softcap).tanh_().mul_(softcap)
            s.masked_fill_(~allowed, -math.inf)  # a masked NaN key becomes -inf here
            m = s.amax(dim=-1)                                                # [Hkv, G, n]
            if sk is not None:  # the sink: one more logit in the denominator, with no value
                m = torch.maximum(m, sk[:, :, None].expand_as(m))
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            # exp of -inf or of anything below -88 leaves the CPU's vector path (4-15x slower),
            # and its denormals slow the matmul ~20x: clamp, then the masked keys to exactly 0
            p = s.sub_(m[..., None]).clamp_(min=_FLOOR).exp_().masked_fill_(~allowed, 0.0)
            den = p.sum(dim=-1)
            if sk is not None:
                den = den + torch.exp(sk[:, :, None] - m)
            lse_b = m + torch.log(den)                                        # -inf: sees nothing
            ob = torch.bmm(p.view(hkv, group * n, nk), vt).view(hkv, group, n, d)
            ob = (ob / torch.where(den > 0, den, torch.ones_like(den))[..., None]).permute(
                2, 0, 1, 3)                                                   # [n, Hkv, G, D]
            seen_bad = (allowed.float() @ bad) > 0                            # [n, Hkv]
            ob = ob.masked_fill(seen_bad[:, :, None, None], math.nan)
            o[c0:c1] = ob.reshape(n, hq, d)
            lse[c0:c1] = lse_b.permute(2, 0, 1).reshape(n, hq)
    return o.to(q.dtype), lse


def attend(tables, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, *,
           window: int | None, scale: float, softcap: float | None = None,
           sinks: torch.Tensor | None = None, k_scale: float = 1.0,
           v_scale: float = 1.0, sink: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention_reference` over one pass's planner tables (`metadata.AttnTables`)."""
    return attention_reference(q, k_buf, v_buf, tables.qo_indptr, tables.kv_indptr,
                               tables.kv_indices.tensor, tables.q_pos, tables.kv_pos,
                               mask=tables.mask, mask_indptr=tables.mask_indptr, window=window,
                               scale=scale, softcap=softcap, sinks=sinks, k_scale=k_scale,
                               v_scale=v_scale, sink=sink)


def merge_state(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor,
                sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention states over disjoint key sets (cascade: prefix + expand).

    o1, o2: [N, H, D] any float dtype; lse1, lse2: [N, H] fp32 (natural log, -inf = empty);
    sinks: [H] fp32 or None, applied here once. Returns (o [N, H, D] in o1's dtype, lse [N, H]).
    """
    parts = [lse1.float(), lse2.float()]
    if sinks is not None:
        parts.append(sinks.float()[None, :].expand_as(parts[0]))
    lse = torch.logsumexp(torch.stack(parts), dim=0)
    base = torch.where(lse == -math.inf, torch.zeros_like(lse), lse)
    w1, w2 = torch.exp(parts[0] - base), torch.exp(parts[1] - base)
    o = w1[..., None] * o1.float() + w2[..., None] * o2.float()
    return o.to(o1.dtype), lse


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
    """Wires planner tables to `attend`; holds no pool logic.

    Graph buckets (`plan(…, graph=(bucket, tokens))`) read static tables, one set per (group,
    pass, bucket, tokens), refilled in place at each replay as FlashInfer's per-pass wrappers
    are: an emulated replay (CPU) runs the captured step over the tables its capture bound, so a
    graph replayed for another pass reads tables that replay never refilled, as on a GPU."""

    capabilities = CAPABILITIES

    def __init__(self) -> None:
        self._passes = PassCache("torch")
        self._static: dict[tuple, object] = {}
        self._mode = None
        self.graph_keys = None
        """(window, tokens) → most keys one request of a graph bucket lists (set by
        `AttentionBackend.init_cuda_graph_state`); None: the largest sub-pool's rows."""

    def plan(self, forward_plan, pool, *, sigs=None, graph: tuple[int, int] | None = None) -> None:
        """Host work of one forward: none eagerly; for a graph bucket, refill the static tables
        of its pass from the planner's."""
        del sigs
        self._passes.clear()
        self._mode = forward_plan.mode
        if graph is None:
            return
        capture = forward_plan.source_rule == "graph capture"
        route = self.graph_route(self._mode, graph[1])
        rows = max(sp.rows for sp in pool.sub_pools)
        for key, g in forward_plan.groups.items():
            keys = rows if self.graph_keys is None else self.graph_keys(g.window, graph[1])
            for role, t in g.passes:
                st = static_tables(self._static, (key, f"{role}/{route}", *graph, id(pool)), t,
                                   t.qo_indptr.device, keys, False, capture)
                # padding requests read no key (o = 0), not the dummy row: unlike a library's
                # kernel the reference needs none, and a poisoned dummy would put NaN in rows a
                # model may roll into a request's (DFlash's shifted logits)
                nb = t.batch_size
                st.kv_indptr[nb + 1:].copy_(st.kv_indptr[nb:nb + 1].expand(graph[0] - nb))
                self._passes.put(t, st)

    def graph_route(self, mode: str, tokens: int) -> str:
        """The tables a bucket of ``mode`` binds: its pass's."""
        del tokens
        return MODE_PASS.get(mode, "extend")

    def graph_binding(self) -> tuple:
        """Which static tables the current plan's launches read (`AttentionBackend.bound_as`)."""
        return dict(self._passes), self._mode

    def restore_binding(self, state: tuple) -> None:
        self._passes.clear()
        self._passes.update(state[0])
        self._mode = state[1]

    def graph_bytes(self) -> int:
        """Bytes of every graph bucket's static tables."""
        return sum(st.nbytes for st in self._static.values())

    def run(self, tables, q, k_buf, v_buf, *, window, scale, softcap=None, sinks=None,
            lse: bool = True, k_scale: float = 1.0, v_scale: float = 1.0, sink: int = 0):
        """One pass → (o, lse); the kernel computes the LSE either way (``lse`` is a hint).
        q rows past the tables' are a graph bucket's padding: they read nothing (o = 0)."""
        st = self._passes.get(id(tables))
        if st is not None:  # a graph bucket: every row, padding requests read the dummy row
            return attention_reference(q, k_buf, v_buf, st.qo_indptr, st.kv_indptr,
                                       st.kv_indices, st.q_pos, st.kv_pos, mask=st.mask,
                                       mask_indptr=st.mask_indptr, window=window, scale=scale,
                                       softcap=softcap, sinks=sinks, k_scale=k_scale,
                                       v_scale=v_scale, sink=sink)
        n = tables.q_pos.numel()
        if q.shape[0] > n:
            o, lse = attend(tables, q[:n], k_buf, v_buf, window=window, scale=scale,
                            softcap=softcap, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
                            sink=sink)
            pad = q.shape[0] - n
            return (torch.cat([o, o.new_zeros(pad, *o.shape[1:])]),
                    torch.cat([lse, lse.new_full((pad, lse.shape[1]), -math.inf)]))
        return attend(tables, q, k_buf, v_buf, window=window, scale=scale, softcap=softcap,
                      sinks=sinks, k_scale=k_scale, v_scale=v_scale, sink=sink)

    def merge(self, o1, lse1, o2, lse2, sinks=None):
        """Cascade merge → o."""
        return merge_state(o1, lse1, o2, lse2, sinks)[0]
