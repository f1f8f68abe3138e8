"""The `kv` check: the K/V rows a forward reads still hold what their request wrote.

The oracle compares attention outputs within a tolerance, so one overwritten key among a bf16
window of a thousand moves an output by less than bf16's own error and passes (a graph replay's
stale padding writes on gemma4, at 2c17a0c). This check compares the rows themselves, exactly:
for each request of a checked forward, the keys its plan lists for a layer (the pool's rows, in
the group's typed space) against the same slots of its logical history, dequantized for fp8
pools (bit-exact: the harness's fp8 scales are powers of two). A key list runs in slot order
from ``kv_end - n`` (a trimmed SWA window, a page floor), so list entry ``j`` is slot index
``kv_end - n + j``; slots the history has dropped (out of every future window) are skipped.

To bound its cost (the rows of a Gemma 4 window are megabytes per request) one layer per group
and one KV head of it are checked per forward, the next layer of the group and the next head each
time: a write that lands in the wrong row replaces all of its heads, a corrupted row stays
corrupted, and every layer of a group reads the same rows. Its error joins the forward's one sync
with the oracle's (`Worker.forward`).
"""
from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch

from swafactory.kvcache.quant import is_fp8
from swafactory.metadata.batch import ReqForward

__all__ = ["KVRead", "StaleKV", "kv_reads", "stale_key"]


class StaleKV(Exception):
    """A row a forward read holds other data than its request wrote there."""

    def __init__(self, worker: str, mode: str, layer: int, group: str, request: Hashable,
                 detail: str) -> None:
        self.worker, self.mode, self.layer, self.group = worker, mode, layer, group
        self.request, self.detail = request, detail
        super().__init__(f"{worker} {mode} layer {layer} ({group}): {detail}")


@dataclass(frozen=True)
class KVRead:
    """One checked layer: the largest |pool - history| over the keys it read (0-dim on the
    device, NaN when a read row is NaN but its history is not), and what `stale_key` needs."""

    layer: int
    group: str
    err: torch.Tensor
    pool_kv: torch.Tensor
    """[n, 2, D] fp32: the checked head's K and V of the rows read (dequantized), every request's
    checked keys in order."""
    hist_kv: torch.Tensor
    where: tuple[tuple[Hashable, int, int], ...]
    """(request, first slot index, keys) of each request's run in ``pool_kv``."""


def _rows(hist, layer: int, lo: int, hi: int, head: int) -> tuple[torch.Tensor, torch.Tensor]:
    _, k, v = hist.kv_from(layer, hi)
    start = hi - k.shape[0]
    return k[lo - start:, head], v[lo - start:, head]


def kv_reads(plan, pool, reqs: Sequence[ReqForward], histories: Mapping[Hashable, object],
             layers: Mapping[int, object], turn: int, kv_heads=None) -> list[KVRead]:
    """The `kv` check of one forward: for each layer group of ``layers`` (runner layer →
    `LayerSpec`), its ``turn``-th layer (mod the group's checked layers) compared with the
    requests' histories, at its ``turn``-th KV head. pool: the one the plan read
    (`AttentionBackend.planned_pool`); a row outside it counts as a failure, like a NaN row.
    kv_heads: ``num_kv -> slice`` of this rank's heads (tensor parallelism), or None."""
    by_group: dict[str, list[int]] = {}
    for layer in layers:
        by_group.setdefault(plan.layer_groups[layer], []).append(layer)
    out = []
    for group, members in by_group.items():
        layer = members[turn % len(members)]
        spec = layers[layer]
        t = plan.groups[group].tables
        k_buf, v_buf, sub = pool.get_kv(layer)
        # every (layer, head) pair in turn; the pool's head (of this rank's shard under tp)
        local = (turn // len(members)) % k_buf.shape[1]
        first_head = 0 if kv_heads is None else kv_heads(spec.num_kv_heads).start or 0
        head = first_head + local  # the same head in the history's full-head rows
        ptr = t.kv_host.tolist()  # host offsets: nothing is read back
        idx, hk, hv, where = [], [], [], []
        for b, r in enumerate(reqs):
            n = ptr[b + 1] - ptr[b]
            hist = histories[r.rid]
            if n == 0 or spec.history_layer not in hist.k:
                continue
            first = r.kv_end - n  # the list's first slot index
            kept = hist.k[spec.history_layer].start
            skip = max(0, kept - first)
            if skip >= n:
                continue
            idx.append(t.kv_indices.tensor[ptr[b] + skip:ptr[b + 1]])
            k, v = _rows(hist, spec.history_layer, first + skip, r.kv_end, head)
            hk.append(k)
            hv.append(v)
            where.append((r.rid, first + skip, n - skip))
        if not idx:
            continue
        rows = torch.cat(idx).long()
        oob = (rows < 0) | (rows >= k_buf.shape[0])  # a plan for another pool: no row there
        safe = rows.clamp(0, k_buf.shape[0] - 1)
        pk, pv = k_buf[safe, local].float(), v_buf[safe, local].float()
        if is_fp8(sub.dtype):  # the pool holds x / scale: what the request wrote is stored · scale
            ks, vs = pool.kv_scales(layer)
            pk, pv = pk * ks, pv * vs
        hk_all, hv_all = torch.cat(hk).float(), torch.cat(hv).float()
        err = torch.maximum((pk - hk_all).abs().amax(), (pv - hv_all).abs().amax())
        bad = (torch.isnan(pk) & ~torch.isnan(hk_all)).any() | \
            (torch.isnan(pv) & ~torch.isnan(hv_all)).any() | oob.any()
        err = torch.where(bad, torch.full_like(err, float("nan")), err)
        out.append(KVRead(layer, group, err, torch.stack([pk, pv], 1),
                          torch.stack([hk_all, hv_all], 1), tuple(where)))
    return out


def stale_key(read: KVRead, pool) -> tuple[Hashable, str]:
    """Where a failed `KVRead` first differs: (request, what its key at which slot index holds)."""
    diff = (read.pool_kv - read.hist_kv).abs().flatten(1).amax(1)
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
    j = int(torch.nonzero(diff > 0)[0]) if bool((diff > 0).any()) else 0
    at = 0
    for rid, first, n in read.where:
        if j < at + n:
            sub = pool.sub_pool(read.layer)
            return rid, (f"request {rid!r}'s key at slot index {first + j - at} (a row of "
                         f"{sub.pool_id!r}) holds other data than the request wrote there (max "
                         f"|difference| {float(diff[j]):.3g}): a write landed in a live row")
        at += n
    return "-", "a key differs from what its request wrote"
