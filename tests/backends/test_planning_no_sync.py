"""Planning a forward makes no host sync on CUDA: `init_forward_metadata` runs under
``torch.cuda.set_sync_debug_mode("error")``, which raises on any synchronizing call (a read back,
a blocking copy). Every mode's planning is vectorized over requests: decode, extend, chain and
tree verify, a DFlash block, and the cascade strategy's prefix/expand split of a tree.

The backends are every one the registry lists for CUDA (`CUDA_BACKENDS`, from the capabilities'
devices), so a new backend is checked by registering; one whose kernel package is missing here
is skipped with the package to install, one the registry refuses for this device with its
reasons. flash_attn's planning needs no flash-attn-4, so it is also planned through its adapter
alone (`test_adapter_planning_makes_no_host_sync`). The CPU counterpart of these checks (device
tables that raise when read on the host) is ``test_planning_reads_nothing_cpu.py``.

FlashInfer's own ``plan`` runs here too. Its custom-mask prefill passes (every mode but decode)
get the mask packed by the adapter from host lengths (`packed_custom_mask`): FlashInfer 0.6.18
packing a bool mask itself reads the packed size back (``segment_packbits``).

The guards (on by default) add no host sync either: their device checks (missing slots, a graph
bucket's padding rows, write bounds in check mode) are copied behind an event and raised at
``backend.raise_pending()``, the engine's own sync point; so a whole step (planning and every
layer's ``forward``) with guards on, in check mode or not, reads nothing back."""
from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

from swafactory.backend.faulty import with_faults
import swafactory
from swafactory.errors import CapacityError, SpaceError
from swafactory.kvcache.factory import build_pools
from swafactory.kvcache.locs import Locs
from swafactory.kvcache.pool import ReqToToken
from swafactory.kvcache.requests import RequestSlots
from swafactory.metadata.batch import ForwardBatch, ReqForward
from swafactory.registry.table import backend_module, get_capabilities, has_adapter, list_backends

TREE8 = (-1, 0, 0, 1, 1, 2, 2, 3)
MODES = {"decode": ("decode", 1, {}), "verify_chain8": ("target_verify", 8, {}),
         "extend": ("extend", 16, {}), "verify_tree8": ("target_verify", 8, {"parents": TREE8}),
         "dflash_block": ("draft_decode", 8, {"block": True}),
         "verify_tree8_cascade": ("target_verify", 8, {"parents": TREE8})}


def cuda_backends(graphs: bool = False) -> list:
    """Every registered backend that runs on CUDA (its capabilities' devices), in table order;
    one that declares capabilities but has no adapter yet is listed, skipped with that reason.
    graphs: only those that capture CUDA graphs (``cuda_graph``)."""
    out = []
    for name in list_backends():
        caps = get_capabilities(name)
        if "cuda" not in caps.devices or (graphs and not caps.cuda_graph):
            continue
        marks = [] if has_adapter(name) else [pytest.mark.skip(
            reason=f"{name} declares its capabilities but has no adapter yet")]
        out.append(pytest.param(name, marks=marks))
    return out


CUDA_BACKENDS = cuda_backends()
GRAPH_BACKENDS = cuda_backends(graphs=True)


def cuda_config(backend: str, *overrides: str):
    """``backend``'s validated config on this GPU (gpt_oss_20b, spec=none); skipped where its
    kernel package is missing (naming the extra to install) or the registry refuses it here."""
    for module, extra in get_capabilities(backend).requires:
        pytest.importorskip(module, reason=f"backend={backend} needs {module} "
                                           f"(pip install '{extra}')")
    cfg = swafactory.compose([f"backend={backend}", "spec=none", "model=gpt_oss_20b",
                              "workload.device=cuda", *overrides])
    reasons = swafactory.check(cfg)
    if reasons:
        pytest.skip(f"the registry refuses backend={backend} here: "
                    + "; ".join(r.message for r in reasons))
    return swafactory.validate(cfg)


def _mode_world(cfg, mode: str, bs: int = 16, ctx: int = 300):
    """Pools of ``cfg`` on CUDA with ``bs`` requests of ``ctx`` tokens (SWA evicted) and the
    batch of ``mode``: (pool, batch)."""
    kind, nodes, shape = MODES[mode]
    W = cfg.model.sliding_window
    pool, alloc = build_pools(cfg, bs * 512, bs * 512, "cuda")
    slots = RequestSlots(alloc, ReqToToken(bs, 512, "cuda"))
    for rid in range(bs):
        slots.open(rid)
        slots.extend(rid, ctx + nodes)
        slots.evict_out_of_window(rid, ctx, W)
    batch = ForwardBatch.of(kind, [ReqForward(r, slots.reqs[r].row, ctx, nodes, **shape)
                                   for r in range(bs)], slots.req_to_token.table, alloc.full_id)
    return pool, batch


def _tree_mask(mode: str) -> str:
    return f"backend.tree_mask={'cascade' if mode.endswith('cascade') else 'custom_mask'}"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_planning_makes_no_host_sync(mode: str, backend: str) -> None:
    """FlashInfer's masks go packed (its segment_packbits would read back); flash_attn and flex
    size their padded passes from the host indptrs."""
    cfg = cuda_config(backend, _tree_mask(mode))
    pool, batch = _mode_world(cfg, mode)
    backend_ = swafactory.build_backend(cfg, pools=pool)
    backend_.init_forward_metadata(batch)  # first use: lazy imports, allocator warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        plan = backend_.init_forward_metadata(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert plan.group(0).tables.qo_host is not None  # host indptrs from host lengths


@pytest.mark.gpu
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_adapter_planning_makes_no_host_sync(mode: str, backend: str) -> None:
    """Each adapter's ``plan`` alone, over the torch backend's planner tables: an adapter whose
    plan calls no kernel library (flash_attn's, flex's) is checked on a GPU where its package is
    missing (flash-attn-4 is not on every GPU host)."""
    cfg = swafactory.validate(swafactory.compose(
        ["backend=torch", "spec=none", "model=gpt_oss_20b", "workload.device=cuda",
         _tree_mask(mode)]))
    pool, batch = _mode_world(cfg, mode)
    plan = swafactory.build_backend(cfg, pools=pool).init_forward_metadata(batch)
    try:
        adapter = backend_module(backend).Adapter()
        adapter.plan(plan, pool)  # first use: lazy imports
    except ImportError as exc:
        pytest.skip(f"{backend}'s adapter plans through its library, not installed here: {exc}")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        adapter.plan(plan, pool)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_decode_graph_replay_planning_makes_no_host_sync(backend: str) -> None:
    """`init_forward_metadata_replay` of a decode bucket (the planner, then the refill of what
    the captured kernels read: FlashInfer's graph wrappers, triton's static tables) under
    ``set_sync_debug_mode("error")``, with a batch smaller than its bucket (padding)."""
    cfg = cuda_config(backend)
    bs, bucket, ctx, W = 5, 8, 300, cfg.model.sliding_window
    pool, alloc = build_pools(cfg, bucket * 512, bucket * 512, "cuda")
    slots = RequestSlots(alloc, ReqToToken(bucket, 512, "cuda"))
    for rid in range(bs):
        slots.open(rid)
        slots.extend(rid, ctx + 1)
        slots.evict_out_of_window(rid, ctx, W)
    backend_ = swafactory.build_backend(cfg, pools=pool)
    backend_.init_cuda_graph_state(bucket, 1)
    backend_.init_forward_metadata_capture(bucket, 1, "decode")
    batch = ForwardBatch.of("decode", [ReqForward(r, slots.reqs[r].row, ctx, 1)
                                       for r in range(bs)], slots.req_to_token.table,
                            alloc.full_id)
    assert backend_.guards  # the default: the replay guards (padding, bounds) read nothing back
    backend_.init_forward_metadata_replay(batch, bucket, 1)  # first use: lazy imports
    backend_.raise_pending()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        plan = backend_.init_forward_metadata_replay(batch, bucket, 1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert plan.total_q == bucket
    backend_.raise_pending()  # a clean replay: its padding rows write the dummy row


STEPS = {"decode": ("decode", 1), "verify_chain8": ("target_verify", 8)}
PKG = Path(swafactory.__file__).parent
KERNEL_READS = {"torch_ref.py"}  # the fp32 reference (backend=torch) reads its indptrs back


def _step_world(backend: str, check_mode: bool, mode: str):
    """gpt_oss_20b pools (SWA and full layers, sinks) on CUDA, 8 requests of 300 tokens, the
    step's inputs per layer, and the backend (guards on: the default)."""
    cfg = cuda_config(backend)
    kind, nodes = STEPS[mode]
    bs, ctx, W, m = 8, 300, cfg.model.sliding_window, cfg.model
    pool, alloc = build_pools(cfg, bs * 512, bs * 512, "cuda", check_mode=check_mode)
    slots = RequestSlots(alloc, ReqToToken(bs, 512, "cuda"))
    for rid in range(bs):
        slots.open(rid)
        slots.extend(rid, ctx + nodes)
        slots.evict_out_of_window(rid, ctx, W)
    backend_ = swafactory.build_backend(cfg, pools=pool)
    assert backend_.guards
    batch = ForwardBatch.of(kind, [ReqForward(r, slots.reqs[r].row, ctx, nodes)
                                   for r in range(bs)], slots.req_to_token.table, alloc.full_id)
    g = torch.Generator(device="cuda").manual_seed(0)
    inputs = []
    for layer in range(m.num_layers):
        sub = pool.sub_pool(layer)
        q = torch.randn(bs * nodes, backend_.q_heads, sub.head_dim, device="cuda",
                        dtype=torch.bfloat16, generator=g)
        k = torch.randn(bs * nodes, sub.num_kv_heads, sub.head_dim, device="cuda",
                        dtype=torch.bfloat16, generator=g)
        inputs.append((q, k, torch.randn_like(k)))
    sinks = (torch.randn(backend_.q_heads, device="cuda") if m.attention_sinks else None)
    return backend_, batch, inputs, sinks, pool


@pytest.mark.gpu
@pytest.mark.parametrize("check_mode", [False, True], ids=["plain", "check_mode"])
@pytest.mark.parametrize("mode", sorted(STEPS))
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
def test_a_step_with_guards_makes_no_host_sync(backend: str, mode: str,
                                                check_mode: bool) -> None:
    """`init_forward_metadata` + `forward` of every layer (K/V write and attention), guards on:
    under ``set_sync_debug_mode("warn")`` no synchronizing call comes from swafactory (the
    guards, the planner, the pool's store, the adapters), the fp32 reference kernel of
    backend=torch excepted (it reads its indptrs by design); every other backend's step makes
    none at all (``"error"``). Check mode's bounds checks are on the device too."""
    backend_, batch, inputs, sinks, _ = _step_world(backend, check_mode, mode)

    def step():
        backend_.init_forward_metadata(batch)
        for layer, (q, k, v) in enumerate(inputs):
            backend_.forward(q, k, v, layer, sinks=sinks)

    step()  # first use: lazy imports, kernel builds, the pinned blocks the checks reuse
    backend_.raise_pending()
    torch.cuda.synchronize()
    strict = backend != "torch"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("error" if strict else "warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    ours = sorted({f"{Path(w.filename).relative_to(PKG)}:{w.lineno}" for w in caught
                   if "synchroniz" in str(w.message) and Path(w.filename).is_relative_to(PKG)
                   and Path(w.filename).name not in KERNEL_READS})
    assert not ours, f"swafactory syncs the device in a guarded step: {ours}"
    backend_.raise_pending()  # a clean step: every position has a slot, every slot in bounds


@pytest.mark.gpu
def test_check_mode_bounds_are_deferred_on_cuda() -> None:
    """`HybridSWAPool.check` in check mode: the bounds reduced on the device (no read back),
    the error read from the word later (`AttentionBackend.raise_pending` reads it)."""
    _, _, _, _, pool = _step_world("torch", True, "decode")
    bad = Locs("full", pool.full.pool_id, torch.tensor([0, 5, pool.full.rows + 3],
                                                        device="cuda"))
    layer = next(l for l, (sub, _) in pool.layers_mapping.items() if sub == "full")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        check = pool.check(layer, bad)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert check is not None and check.deferred
    err = check.error()
    assert isinstance(err, CapacityError) and f"max {pool.full.rows + 3}" in str(err)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_stale_padding_is_raised_at_raise_pending_on_cuda(backend: str) -> None:
    """FAULT graph_pad_stale_swa_loc with guards on: the replay of a shrunk batch (its SWA
    padding rows still hold the slots a full replay wrote) plans without a read back, and
    `raise_pending` names the group, the rows and the live slots."""
    cfg = cuda_config(backend)
    bucket, ctx, W = 8, 300, cfg.model.sliding_window
    pool, alloc = build_pools(cfg, bucket * 512, bucket * 512, "cuda")
    slots = RequestSlots(alloc, ReqToToken(bucket, 512, "cuda"))
    for rid in range(bucket):
        slots.open(rid)
        slots.extend(rid, ctx + 1)
        slots.evict_out_of_window(rid, ctx, W)
    backend_ = swafactory.build_backend(cfg, pools=pool)
    with_faults(backend_, graph_pad_stale_swa_loc=True)
    backend_.init_cuda_graph_state(bucket, 1)
    backend_.init_forward_metadata_capture(bucket, 1, "decode")

    def batch(n: int) -> ForwardBatch:
        return ForwardBatch.of("decode", [ReqForward(r, slots.reqs[r].row, ctx, 1)
                                          for r in range(n)], slots.req_to_token.table,
                               alloc.full_id)
    backend_.init_forward_metadata_replay(batch(bucket), bucket, 1)  # every row a request's
    backend_.raise_pending()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        plan = backend_.init_forward_metadata_replay(batch(5), bucket, 1)  # raises nothing yet
    finally:
        torch.cuda.set_sync_debug_mode("default")
    swa = next(k for k, g in plan.groups.items() if g.window is not None)
    live = [s for s in plan.groups[swa].write_locs.tensor.tolist()[5:] if s]
    assert live, "the fault left no live slot in the padding rows"
    with pytest.raises(SpaceError, match=re.escape(
            f"group {swa}'s padding rows (past the batch's 5) write live slots (the largest {max(live)}) of")):
        backend_.raise_pending()
    backend_.raise_pending()  # drained: nothing left
