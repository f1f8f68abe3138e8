"""The per-layer path of `AttentionBackend`: each layer's `LayerEntry`, gathered once per pass
(decode, verify, extend: a pass may run on another family's adapter) while the pool and layer
groups stay, then `forward` (checks from tensor metadata only, the K/V store, the kernel) once
per layer.

A base of `AttentionBackend`: it uses the attributes `core.AttentionBackend.__init__` sets and
the current plan (``_plan``, ``_pool``, ``adapters``, ``kernel_of``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from swafactory.backend.layer_contract import sinks_error
from swafactory.errors import SpaceError
from swafactory.guards import Q_DTYPES, forward_error
from swafactory.kvcache.quant import is_fp8, store_rows
from swafactory.metadata.batch import ForwardBatch
from swafactory.metadata.plan import ForwardPlan
from swafactory.registry.kernel_choice import MODE_PASS

__all__ = ["LayerEntry", "LayerPath"]


@dataclass(frozen=True, slots=True)
class LayerEntry:
    """What a layer's `forward` needs of the current plan and pool, gathered once per plan (and
    again only when the pool, the layer groups or the fp8 scales change), so the per-layer path
    reads attributes instead of looking anything up."""

    key: str
    """The layer's group key in the plan."""
    k_buf: torch.Tensor
    """[rows, Hkv, D] the layer's K buffer (pool dtype)."""
    v_buf: torch.Tensor
    """[rows, Hkv, D] the layer's V buffer."""
    sub: object
    """The sub-pool holding the layer (`kvcache.pool.SubPool`)."""
    kw: dict
    """The adapter's per-layer keywords: window, scale, softcap, fp8 k_scale/v_scale."""
    pair: tuple
    """(group key, sub-pool id): the unit of the read checks, once per forward."""
    adapter: object
    """The kernel adapter serving the layer's group."""
    scales: tuple
    """(k_scale, v_scale) the store quantizes with (1.0, 1.0 unless fp8)."""
    wpair: tuple
    """(group key, sub-pool id, "w"): the unit of the write checks."""
    hkv: int
    """KV heads of the layer."""
    d: int
    """head_dim of the layer."""
    fp8: bool
    """The pool stores fp8."""
    fuse: bool
    """The decode kernel may write the step's K/V itself."""
    device: torch.device
    """The pool's device."""
    dtype: torch.dtype
    """The K buffer's dtype."""
    plain: bool
    """The store is a plain ``index_copy_`` when k and v come in ``dtype``: not fp8, not check
    mode, V in K's dtype."""


class LayerPath:
    """The plan's per-layer entries and `forward` / `write_kv`."""

    def _read_scales(self, layer_id: int, scales: tuple[float, float]) -> dict:
        """The kernel keywords that dequantize an fp8 layer's reads with its ``scales``."""
        return {"k_scale": scales[0], "v_scale": scales[1]}


    def _set_plan(self, fplan: ForwardPlan, graphed: bool) -> None:
        """Make ``fplan`` the current forward's: each group's write rows as the int64 index the
        store takes (once per group, not per layer), and the pass's per-layer entries, built
        once per pass and again only when the pool, the layer groups or the fp8 scales change."""
        self._plan, self._graphed = fplan, graphed
        self._checked = set()
        self._writes = {key: _rows(g.write_locs) for key, g in fplan.groups.items()}
        # groups whose pass is decode (host facts): a kernel may write their K/V itself
        self._decode = {key for key, g in fplan.groups.items() if g.cascade is None
                        and g.tables.mask is None and g.tables.max_q_len == 1}
        pool = self._pool
        cached = self._layers
        version = pool.scales_version
        pass_ = MODE_PASS.get(fplan.mode, "extend")
        if (cached is None or cached[0] is not pool or cached[1] != fplan.layer_groups
                or cached[3] != version):
            # the pool is held, so its identity cannot be reused by another one
            cached = self._layers = (pool, dict(fplan.layer_groups), {}, version)
        entries = cached[2].get(pass_)
        if entries is None:  # once per pass: a pass may run on another family's adapter
            entries = cached[2][pass_] = {}
            for layer, key in fplan.layer_groups.items():
                k_buf, v_buf, sub = pool.get_kv(layer)
                kw = dict(window=fplan.groups[key].window, scale=self._scale(sub),
                          softcap=self.softcap)
                if fplan.groups[key].sink:  # only kernels with the draft_sink capability
                    kw["sink"] = fplan.groups[key].sink
                scales = pool.kv_scales(layer) if is_fp8(sub.dtype) else (1.0, 1.0)
                if is_fp8(sub.dtype):
                    kw.update(self._read_scales(layer, scales))  # kernels dequantize
                ad = self.adapters[self.kernel_of(fplan.groups[key].window, fplan.mode)]
                hkv, d = k_buf.shape[1], k_buf.shape[2]
                # a decode kernel that writes the step's K/V itself (not fp8: the store quantizes)
                fuse = getattr(ad, "fuses_writes", False) and not is_fp8(sub.dtype)
                plain = not is_fp8(sub.dtype) and not sub.check_mode and v_buf.dtype == k_buf.dtype
                entries[layer] = LayerEntry(key, k_buf, v_buf, sub, kw, (key, sub.pool_id), ad,
                                            scales, (key, sub.pool_id, "w"), hkv, d,
                                            is_fp8(sub.dtype), fuse, k_buf.device, k_buf.dtype,
                                            plain)
        self._entries = entries

    def _check_layer(self, layer_id: int, g, sub, pair: tuple[str, str]) -> None:
        """The typed-space checks of a layer's reads and writes, once per (group, sub-pool) per
        forward: every layer of the pair reads the same tables and writes the same rows."""
        if not sub.accepts(g.tables.kv_indices):
            raise SpaceError(f"layer {layer_id} reads {sub.pool_id!r} ({sub.space} space) but its "
                             f"plan holds {g.tables.kv_indices.space}-space locations of "
                             f"{g.tables.kv_indices.pool_id!r}")
        self._checked.add(pair)

    def _entry(self, layer_id: int) -> LayerEntry:
        try:
            return self._entries[layer_id]
        except (TypeError, KeyError):  # no plan yet (None), or a layer the plan does not hold
            self.plan  # noqa: B018 - raises before init_forward_metadata
            self._plan.group(layer_id)  # raises naming the plan's layers
            raise

    def write_kv(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write this forward's new tokens of one layer. k, v: [total_q, Hkv, D]."""
        self._store(layer_id, self._entry(layer_id), k, v, k.dtype, v.dtype)

    def _store(self, layer_id: int, e: LayerEntry, k, v, kd: torch.dtype, vd: torch.dtype,
               fused: bool = False):
        """The per-layer write (hot: about as much Python as the raw ``index_copy_`` pair).
        e: the layer's `LayerEntry`; kd, vd: k's and v's dtypes (read once, by the caller).
        fused: check only, and return the int64 slots for the kernel that writes them
        (`forward`)."""
        idx, n = self._writes[e.key]
        if idx is None:
            raise SpaceError(f"layer {layer_id}: this runner writes no KV (a read-only view)")
        # the pool's checks (typed space; bounds in check mode, on the device: `_defer`) once
        # per group and sub-pool; a graph's writes were checked at replay planning
        if self.guards and not self._graphed and e.wpair not in self._checked:
            self._defer(self._pool.check(layer_id, self._plan.groups[e.key].write_locs))
            self._checked.add(e.wpair)
        ks = k.shape
        if ks != (n, e.hkv, e.d) or v.shape != ks:
            raise ValueError(f"layer {layer_id}: k/v must be [{n}, {e.hkv}, {e.d}], got "
                             f"{list(k.shape)} / {list(v.shape)}")
        if fused:  # the adapter writes, leaving the dummy page as it was
            return idx
        if e.plain and kd is e.dtype and vd is e.dtype:  # store_rows's own path, inline
            e.k_buf.index_copy_(0, idx, k)
            e.v_buf.index_copy_(0, idx, v)
        elif e.sub.check_mode:  # the pool's own write keeps its dummy page poisoned
            return self._pool.write(layer_id, self._plan.groups[e.key].write_locs, k, v,
                                    checked=False)
        else:  # the pool's store rule (cast; fp8 quantized with the layer's cached scales)
            store_rows(e.k_buf, idx, k, e.scales[0])
            store_rows(e.v_buf, idx, v, e.scales[1])

    def layer_scale(self, layer_id: int) -> float:
        """The softmax scale of ``layer_id`` in this forward: ``model.softmax_scale``, else the
        head_dim^-0.5 of the buffers it reads (a frozen draft layer reads a target layer): the
        planned pool's, else (before the first plan) the view's active pool's."""
        return self._scale((self._pool or self.view.active_pool).sub_pool(layer_id))

    def _scale(self, sub) -> float:
        return self.cfg.model.softmax_scale or sub.head_dim ** -0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                layer_id: int, batch: ForwardBatch | None = None, save_kv: bool = True,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of one layer.

        q: [total_q, Hq, D]; k, v: [total_q, Hkv, D] (this forward's new tokens, written first
        when ``save_kv``); sinks: the layer's [Hq] fp32 sink logits, required when
        ``model.attention_sinks`` and refused otherwise (`layer_contract.sinks_error`). Scores
        are scaled by `layer_scale`. Returns [total_q, Hq, D] in q's dtype.
        ``batch`` is accepted for engines that pass it; the plan is the one of
        `init_forward_metadata`.
        """
        del batch
        e = self._entry(layer_id)
        key, k_buf, v_buf, kw, ad, d = e.key, e.k_buf, e.v_buf, e.kw, e.adapter, e.d
        g = self._plan.groups[key]
        kd = vd = None
        if self.guards:
            if e.pair not in self._checked:
                self._check_layer(layer_id, g, e.sub, e.pair)
            if (sinks is None) is self._sinks_rule:  # the model's sinks dropped, or added to one
                raise sinks_error(layer_id, self._plan.mode, self.cfg.model, self.q_heads, sinks,
                                  self._sinks_rule)
            # metadata only, each property read once (the store takes k's and v's dtypes from
            # here); `guards.forward_error` names what differs
            hq, dev = self.q_heads, e.device
            try:
                bad = (q.shape != (self._plan.total_q, hq, d) or q.dtype not in Q_DTYPES
                       or q.device != dev
                       or save_kv and ((kd := k.dtype) not in Q_DTYPES
                                       or (vd := v.dtype) not in Q_DTYPES
                                       or k.device != dev or v.device != dev)
                       or sinks is not None and (sinks.shape != (hq,)
                                                 or sinks.dtype not in Q_DTYPES
                                                 or sinks.device != dev))
            except AttributeError:  # not a tensor (a list, an array, None): named below
                bad = True
            if bad:
                raise forward_error(layer_id, self._plan.mode, self._plan.total_q, hq, e.hkv, d,
                                    dev, q, k, v, save_kv, sinks) or AssertionError(
                                        f"layer {layer_id}: a guard disagrees with its message")
        if not q.is_contiguous():  # q split from a fused qkv projection: kernels read it dense
            q = q.contiguous()  # (strided k and v: the store's index_copy_ and the fused
            # decode kernels' own writers take them as they are)
        # the scale follows the buffers actually read (a frozen draft layer reads a target layer)
        if save_kv:
            if kd is None:
                kd, vd = k.dtype, v.dtype
            if e.fuse and kd is e.dtype and vd is e.dtype and key in self._decode:
                new_kv = (k, v, self._store(layer_id, e, k, v, kd, vd, fused=True))  # it writes
                return ad.run(g.tables, q, k_buf, v_buf, sinks=sinks, lse=False, new_kv=new_kv,
                              **kw)[0]
            self._store(layer_id, e, k, v, kd, vd)
        elif self.guards and e.wpair not in self._checked:  # its own rows: written before?
            self._unsaved(layer_id, e)  # (`slot_guard.SlotGuards`: check mode)
        if g.cascade is not None:
            pre, exp = g.cascade
            o1, l1 = ad.run(pre, q, k_buf, v_buf, **kw)
            o2, l2 = ad.run(exp, q, k_buf, v_buf, **kw)
            return ad.merge(o1, l1, o2, l2, sinks)
        o, _ = ad.run(g.tables, q, k_buf, v_buf, sinks=sinks, lse=False, **kw)
        return o


def _rows(locs) -> tuple[torch.Tensor | None, int]:
    """A group's write `Locs` as the store's [n] int64 index (itself when it is one already:
    the planner's) and n; (None, 0) for a group that writes nothing."""
    if locs is None:
        return None, 0
    t = locs.tensor
    t = t if t.dtype is torch.int64 and t.dim() == 1 else t.reshape(-1).long()
    return t, t.shape[0]
