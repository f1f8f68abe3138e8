"""torch FlexAttention over a padded per-request view of the planner's tables.

Layout. FlexAttention reads dense ``[B, H, S, D]`` tensors, not a paged pool. Once per forward
(`Adapter.plan`) each pass's CSR tables become a padded batch: request b's queries in row b
(``q_len_b`` of ``qmax``), its key rows in row b (``kv_len_b`` of ``kvmax``), and one bool
visibility tensor ``[B, qmax, kvmax]`` = ``structure & (q_pos - kv_pos < W)``, the same rule as
every other backend (causal by position when there is no structure mask). The block mask is built
from that tensor once per pass, so empty key blocks (padding, out-of-window keys) are skipped and
full blocks run unmasked. Per layer only the gather of the layer's K/V rows and the kernel run.
Planning reads nothing back: the padded sizes come from the planner's host indptrs
(``AttnTables.qo_host``/``kv_host``), and padded rows map back to query rows by a gather, never
by a boolean index (a device sync), so a host that runs ahead is never stalled.

Because the keys are gathered, any pool page size works; the price is one K/V copy per layer.
On CPU it runs FlexAttention's unfused eager path (tests, small shapes). On CUDA the code path
compiles the kernel with dynamic shapes and forces FlexAttention's prefill kernel for every pass
(``FORCE_USE_FLEX_ATTENTION``): its flex-decoding kernel, picked for short passes, failed to lower
passes of 64-100 queries per request on the H200 (``CAPABILITIES.devices_note``).
Sinks use the exact LSE epilogue (`torch_ref.apply_sinks`); FlexAttention's LSE is natural-log.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import cache

import torch

from swafactory.kernels.torch_ref import apply_sinks, merge_state
from swafactory.metadata.plan import PassCache
from swafactory.registry.capabilities import Capabilities

__all__ = ["CAPABILITIES", "Adapter", "padded_pass", "host_sizes", "gather_or_zeros"]

CAPABILITIES = Capabilities(
    name="flex",
    summary="torch FlexAttention on a padded per-request gather; one block mask per pass per forward",
    kernel="FlexAttention (block mask)",
    devices=frozenset({"cpu", "cuda"}),
    devices_note="on CUDA the adapter compiles with dynamic shapes and forces FlexAttention's "
                 "prefill kernel (kernel_options FORCE_USE_FLEX_ATTENTION): at 1da1d66 its "
                 "flex-decoding kernel failed to lower extend passes of 64-100 queries per "
                 "request (NoValidChoicesError); bench/probes/flex_compile.py (then bench/flex_probe.py) at e05dc49 lowered all 15 "
                 "serve-like shapes with the forced kernel",
    max_head_dim=256,
    head_dim_note="swafactory caps FlexAttention at head_dim 256: larger heads are not verified "
                  "on a GPU",
    tree_masks=frozenset({"custom_mask", "cascade"}),
    sinks=True,
    sinks_note="sinks join the denominator after the kernel, from the returned LSE",
    softcap=True,
    kv_dtypes=frozenset({"float32", "float16", "bfloat16"}),
)

_BLOCK = 128  # FlexAttention's own default: the kernels' tile sizes divide it on every arch


@dataclass(eq=False)
class _Padded:
    """One pass as a padded batch (host work, once per forward)."""

    q_index: torch.Tensor
    """[B * qmax] long: total_q row of each padded query slot (0 in padding)."""
    q_slots: torch.Tensor
    """[total_q] long: the padded slot (b · qmax + i) of each query row, in row order."""
    kv_index: torch.Tensor
    """[B * kvmax] long: pool row of each padded key slot (0 in padding, zeroed after gather)."""
    kv_valid: torch.Tensor
    """[B * kvmax] bool."""
    vis: torch.Tensor
    """[B, qmax, kvmax] bool visibility (structure, causality, window, padding)."""
    shape: tuple[int, int, int]
    """(B, qmax, kvmax)."""
    block_mask: object = None


def host_sizes(tables, adapter: str = "flex") -> tuple[int, int, int, int]:
    """(B, qmax, kvmax, total_q) of a pass from its host indptrs (``qo_host``, ``kv_host``, which
    the planner always sets): nothing is read back from the device. qmax and kvmax are at least
    1 (a padded row is never empty)."""
    qo, kv = tables.qo_host, tables.kv_host
    if qo is None or kv is None:
        raise ValueError(f"{adapter} adapter: tables.{'qo_host' if qo is None else 'kv_host'} "
                         "is None; plan with `metadata.plan.plan` (it sets the host indptrs), "
                         "or set qo_host/kv_host: the adapter reads no length back")
    b = qo.numel() - 1
    if b <= 0:
        return 0, 1, 1, 0
    qmax = max(1, int((qo[1:] - qo[:-1]).max()))
    kvmax = max(1, int((kv[1:] - kv[:-1]).max()))
    return b, qmax, kvmax, int(qo[-1])


def padded_pass(tables, window: int | None, adapter: str = "flex") -> _Padded:
    """The padded-batch form of one pass, with no host sync. tables: `metadata.AttnTables`
    (with its host indptrs); adapter: the name its errors give."""
    dev = tables.qo_indptr.device
    b, qmax, kvmax, total_q = host_sizes(tables, adapter)
    qo = tables.qo_indptr.long()
    kv = tables.kv_indptr.long()
    q_len, kv_len = qo[1:] - qo[:-1], kv[1:] - kv[:-1]
    qi = torch.arange(qmax, device=dev)
    ki = torch.arange(kvmax, device=dev)
    q_valid = qi[None, :] < q_len[:, None]  # [B, qmax]
    kv_valid = ki[None, :] < kv_len[:, None]
    q_rows = torch.where(q_valid, qo[:-1, None] + qi[None, :], 0)
    kv_rows = torch.where(kv_valid, kv[:-1, None] + ki[None, :], 0)
    q_pos = tables.q_pos.long()[q_rows]  # [B, qmax]
    # a pass may have no key at all (a paged cascade's prefix half when every prefix is shorter
    # than a page): the padding's row 0 does not exist then, so read from one zero
    kv_pos = gather_or_zeros(tables.kv_pos.long(), kv_rows)
    d = q_pos[:, :, None] - kv_pos[:, None, :]
    if tables.mask is not None:
        mi = tables.mask_indptr.long()
        flat = mi[:-1, None, None] + qi[None, :, None] * kv_len[:, None, None] + ki[None, None, :]
        inside = q_valid[:, :, None] & kv_valid[:, None, :]
        vis = tables.mask.bool()[torch.where(inside, flat, 0)] & inside
    else:
        vis = (d >= 0) & q_valid[:, :, None] & kv_valid[:, None, :]
    if window is not None:
        vis = vis & (d < window)
    kv_index = gather_or_zeros(tables.kv_indices.tensor.long(), kv_rows)
    # each query row's request, from a host-known count (no sync), then its padded slot
    req = torch.repeat_interleave(torch.arange(b, device=dev), q_len, output_size=total_q)
    q_slots = req * qmax + torch.arange(total_q, device=dev) - qo[:-1][req]
    return _Padded(q_rows.reshape(-1), q_slots, kv_index.reshape(-1), kv_valid.reshape(-1), vis,
                   (b, qmax, kvmax))


def gather_or_zeros(values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``values[rows]``; zeros when ``values`` is empty (every row is padding then)."""
    return values[rows] if values.numel() else torch.zeros_like(rows)


@cache
def _flex():
    import torch._dynamo

    from torch.nn.attention.flex_attention import flex_attention

    # one compiled variant per (head_dim, GQA, soft-cap, dtype) a process meets; past dynamo's
    # default limit of 8 it would silently fall back to the unfused path, which materializes
    # every score. Raise the limit, never lower it.
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, name, max(getattr(cfg, name), 64))
    return torch.compile(flex_attention, dynamic=True), flex_attention


_FORCE_PREFILL = {"FORCE_USE_FLEX_ATTENTION": True}


@cache  # one score_mod per (cap, device): no per-layer host→device copy, no recompiles
def _softcap_mod(softcap: float, device: torch.device):
    # a captured tensor, not a float: dynamo turns closure floats into scalar inputs, which
    # FlexAttention's compiled lowering rejects ("unbacked_bindings")
    cap = torch.tensor(float(softcap), dtype=torch.float32, device=device)

    def score_mod(s, bi, h, qi, ki):
        return cap * torch.tanh(s / cap)

    return score_mod


def _lse_kwarg() -> dict:
    try:  # torch ≥ 2.9 returns auxiliary outputs through AuxRequest; return_lse is deprecated
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:
        return {"return_lse": True}
    return {"return_aux": AuxRequest(lse=True)}


def _block_mask(p: _Padded):
    from torch.nn.attention.flex_attention import create_block_mask

    vis = p.vis
    b, qmax, kvmax = p.shape

    def mask_mod(bi, h, qi, ki):
        return vis[bi, qi, ki]

    return create_block_mask(mask_mod, b, None, qmax, kvmax, device=vis.device,
                             BLOCK_SIZE=_BLOCK)


class Adapter:
    """Wires planner tables to FlexAttention; holds no pool logic."""

    capabilities = CAPABILITIES

    def __init__(self) -> None:
        self._passes: PassCache = PassCache("flex")

    def plan(self, forward_plan, pool, *, sigs=None, graph=None) -> None:
        """Padded layouts and block masks for every pass of ``forward_plan`` (once per forward)."""
        del pool, sigs, graph  # no host-planned kernel signature; no graph path
        self._passes.clear()
        for g in forward_plan.groups.values():
            for _, t in g.passes:
                p = self._passes.put(t, padded_pass(t, g.window))
                p.block_mask = _block_mask(p)

    def run(self, tables, q, k_buf, v_buf, *, window, scale, softcap=None, sinks=None,
            lse: bool = True):
        """One pass → (o [total_q, Hq, D] in q's dtype, lse [total_q, Hq] fp32, natural log;
        computed whatever ``lse`` says).

        q: [total_q, Hq, D]; k_buf, v_buf: [rows, Hkv, D]; sinks: [Hq] or None.
        """
        del window  # inside the planned visibility
        p = self._passes.of(tables)
        b, qmax, kvmax = p.shape
        hq, d = q.shape[1], q.shape[2]
        hkv = k_buf.shape[1]
        qp = q[p.q_index].view(b, qmax, hq, d).transpose(1, 2)
        valid = p.kv_valid[:, None, None]
        # padding rows point at row 0, which may be a poisoned (NaN) slot: 0 · NaN is NaN
        kp = torch.where(valid, k_buf[p.kv_index], 0).to(q.dtype)
        vp = torch.where(valid, v_buf[p.kv_index], 0).to(q.dtype)
        kp = kp.view(b, kvmax, hkv, d).transpose(1, 2)
        vp = vp.view(b, kvmax, hkv, d).transpose(1, 2)
        score_mod = None if softcap is None else _softcap_mod(softcap, q.device)
        compiled, eager = _flex()
        fn = compiled if q.is_cuda else eager
        # CUDA: never the flex-decoding kernel, which did not lower short extend passes (H200)
        force = {"kernel_options": _FORCE_PREFILL} if q.is_cuda else {}
        with warnings.catch_warnings():  # CPU: the unfused path is the point (tests, small shapes)
            warnings.filterwarnings("ignore", message=".*without torch.compile.*")
            o, lse = fn(qp, kp, vp, score_mod=score_mod, block_mask=p.block_mask, scale=scale,
                        enable_gqa=hq != hkv, **_lse_kwarg(), **force)
        lse = getattr(lse, "lse", lse)
        o = o.transpose(1, 2).reshape(b * qmax, hq, d)[p.q_slots]  # a gather: no sync
        lse = lse.transpose(1, 2).reshape(b * qmax, hq)[p.q_slots].float()
        # a query that sees no key: FlexAttention leaves lse at -inf but o at 0, as the contract
        if sinks is not None:
            o, lse = apply_sinks(o, lse, sinks)
        return o.to(q.dtype), lse

    def merge(self, o1, lse1, o2, lse2, sinks=None):
        """Cascade merge → o (the sink joins once, here)."""
        return merge_state(o1, lse1, o2, lse2, sinks)[0]
