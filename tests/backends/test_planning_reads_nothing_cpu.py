"""Planning reads nothing back, checked on CPU: the flash_attn and flex adapters plan every mode
over planner tables whose device tensors are wrapped so that any host read of them, or of
anything computed from them, raises (``.item()``, ``bool``/``int``, ``.tolist()``, ``nonzero``,
a boolean index, a ``repeat_interleave`` without its output size: each a sync on a GPU).

The tables come from the torch backend's planner on CPU; their host indptrs (``qo_host``,
``kv_host``) stay plain, as on a GPU they are host memory. flex's per-layer ``run`` goes through
the same check. The GPU counterpart, under ``torch.cuda.set_sync_debug_mode("error")``, is
``test_planning_no_sync.py``.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import swafactory
from swafactory.kernels import flash_attn, flex
from swafactory.kvcache.factory import build_pools
from swafactory.kvcache.pool import ReqToToken
from swafactory.kvcache.requests import RequestSlots
from swafactory.metadata.batch import ForwardBatch, ReqForward
from test_planning_no_sync import MODES

HOST_READS = {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__",
              "__array__", "nonzero", "argwhere", "masked_select", "unique",
              "unique_consecutive"}


class HostRead(AssertionError):
    """A device tensor read on the host during planning."""


def _bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class _OnDevice(torch.Tensor):
    """A planner table on the device: reading it (or what is computed from it) on the host
    raises, as would every op that needs its values on the host to size its output."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            raise HostRead(f"{name} of a device table")
        if name == "__getitem__" and _bool_index(args[1]):
            raise HostRead("a boolean index (nonzero) into a device table")
        if name == "repeat_interleave" and kwargs.get("output_size") is None and \
                any(isinstance(a, torch.Tensor) for a in args[1:]):
            raise HostRead("repeat_interleave by device counts without output_size")
        if name == "to" and any(str(a) == "cpu" for a in (*args[1:], *kwargs.values())):
            raise HostRead("a device table copied to the host")
        return super().__torch_function__(func, types, args, kwargs)


def _dev(t):
    return None if t is None else t.as_subclass(_OnDevice)


def _on_device(t):
    """``t`` (`AttnTables`) with its device tensors wrapped, its host indptrs plain."""
    return replace(t, qo_indptr=_dev(t.qo_indptr), kv_indptr=_dev(t.kv_indptr),
                   kv_indices=replace(t.kv_indices, tensor=_dev(t.kv_indices.tensor)),
                   q_pos=_dev(t.q_pos), kv_pos=_dev(t.kv_pos), mask=_dev(t.mask),
                   mask_indptr=_dev(t.mask_indptr), kv_indices_i32=_dev(t.kv_indices_i32))


def _planned(mode: str, page: int):
    """(the torch backend's plan of ``mode`` with every pass's tables wrapped, the pool)."""
    cfg = swafactory.validate(swafactory.compose(
        ["backend=torch", "spec=none", "model=tiny", "workload.device=cpu",
         "backend.kv_dtype=float32", f"backend.page_size={page}",
         f"backend.tree_mask={'cascade' if mode.endswith('cascade') else 'custom_mask'}"]))
    kind, nodes, shape = MODES[mode]
    bs, ctx, W = 3, 40, cfg.model.sliding_window
    pool, alloc = build_pools(cfg, bs * 128, bs * 128, "cpu")
    slots = RequestSlots(alloc, ReqToToken(bs, 128, "cpu"))
    for rid in range(bs):
        slots.open(rid)
        slots.extend(rid, ctx + rid + nodes)
        slots.evict_out_of_window(rid, ctx + rid, W)
    be = swafactory.build_backend(cfg, pools=pool)
    batch = ForwardBatch.of(kind, [ReqForward(r, slots.reqs[r].row, ctx + r, nodes, **shape)
                                   for r in range(bs)], slots.req_to_token.table, alloc.full_id)
    plan = be.init_forward_metadata(batch)
    groups = {k: replace(g, tables=_on_device(g.tables), cascade=None if g.cascade is None else
                         tuple(_on_device(t) for t in g.cascade))
              for k, g in plan.groups.items()}
    return replace(plan, groups=groups), pool, be


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_flash_attn_plans_without_reading_back(mode: str, page: int) -> None:
    plan, pool, _ = _planned(mode, page)
    ad = flash_attn.Adapter()
    ad.plan(plan, pool)
    for g in plan.groups.values():
        for _, t in g.passes:
            p = ad._passes.of(t)
            assert p.natural == t.natural and isinstance(p.max_seqlen_q, int)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_flex_plans_and_runs_without_reading_back(mode: str) -> None:
    plan, pool, be = _planned(mode, 1)
    ad = flex.Adapter()
    ad.plan(plan, pool)
    g = torch.Generator().manual_seed(0)
    for layer, key in plan.layer_groups.items():
        grp, sub = plan.groups[key], pool.sub_pool(layer)
        q = torch.randn(plan.total_q, be.q_heads, sub.head_dim, generator=g)
        k_buf, v_buf = (torch.randn(sub.k_bufs[0].shape, generator=g) for _ in range(2))
        for _, t in grp.passes:
            o, lse = ad.run(t, q, k_buf, v_buf, window=grp.window, scale=0.25)
            assert o.shape == q.shape and lse.shape == q.shape[:2]


def test_the_check_catches_a_read_back() -> None:
    """The wrapper raises where the old planners read back (a length's max, a boolean index)."""
    plan, _, _ = _planned("verify_tree8", 1)
    t = next(iter(plan.groups.values())).tables
    with pytest.raises(HostRead, match="__int__"):
        int((t.qo_indptr[1:] - t.qo_indptr[:-1]).max())
    with pytest.raises(HostRead, match="boolean index"):
        t.kv_pos[t.kv_pos > 0]
    with pytest.raises(HostRead, match="__bool__"):
        bool((t.q_pos >= 0).all())
    with pytest.raises(HostRead, match="output_size"):
        torch.arange(3).repeat_interleave(t.qo_indptr[1:] - t.qo_indptr[:-1])
