"""Planning a forward makes no host sync on CUDA: `init_forward_metadata` runs under
``torch.cuda.set_sync_debug_mode("error")``, which raises on any synchronizing call (a read back,
a blocking copy). Every mode's planning is vectorized over requests: decode, extend, chain and
tree verify, a DFlash block, and the cascade strategy's prefix/expand split of a tree.

FlashInfer's own ``plan`` runs here too. Its custom-mask prefill passes (every mode but decode)
get the mask packed by the adapter from host lengths (`packed_custom_mask`): FlashInfer 0.6.18
packing a bool mask itself reads the packed size back (``segment_packbits``)."""
from __future__ import annotations

import pytest
import torch

import swafactory
from swafactory.kvcache.factory import build_pools
from swafactory.kvcache.pool import ReqToToken
from swafactory.kvcache.requests import RequestSlots
from swafactory.metadata.batch import ForwardBatch, ReqForward

TREE8 = (-1, 0, 0, 1, 1, 2, 2, 3)
MODES = {"decode": ("decode", 1, {}), "verify_chain8": ("target_verify", 8, {}),
         "extend": ("extend", 16, {}), "verify_tree8": ("target_verify", 8, {"parents": TREE8}),
         "dflash_block": ("draft_decode", 8, {"block": True}),
         "verify_tree8_cascade": ("target_verify", 8, {"parents": TREE8})}


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flashinfer", "triton", "torch"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_planning_makes_no_host_sync(mode: str, backend: str) -> None:
    if backend == "flashinfer":  # masks go packed: FlashInfer's segment_packbits would read back
        pytest.importorskip("flashinfer")
    cfg = swafactory.validate(swafactory.compose(
        [f"backend={backend}", "spec=none", "model=gpt_oss_20b", "workload.device=cuda",
         f"backend.tree_mask={'cascade' if mode.endswith('cascade') else 'custom_mask'}"]))
    kind, nodes, shape = MODES[mode]
    bs, ctx, W = 16, 300, cfg.model.sliding_window
    pool, alloc = build_pools(cfg, bs * 512, bs * 512, "cuda")
    slots = RequestSlots(alloc, ReqToToken(bs, 512, "cuda"))
    for rid in range(bs):
        slots.open(rid)
        slots.extend(rid, ctx + nodes)
        slots.evict_out_of_window(rid, ctx, W)
    backend_ = swafactory.build_backend(cfg, pools=pool)
    batch = ForwardBatch.of(kind, [ReqForward(r, slots.reqs[r].row, ctx, nodes, **shape)
                                   for r in range(bs)], slots.req_to_token.table, alloc.full_id)
    backend_.init_forward_metadata(batch)  # first use: lazy imports, allocator warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        plan = backend_.init_forward_metadata(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert plan.group(0).tables.qo_host is not None  # host indptrs from host lengths


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flashinfer", "triton"])
def test_decode_graph_replay_planning_makes_no_host_sync(backend: str) -> None:
    """`init_forward_metadata_replay` of a decode bucket (the planner, then the refill of what
    the captured kernels read: FlashInfer's graph wrappers, triton's static tables) under
    ``set_sync_debug_mode("error")``, with a batch smaller than its bucket (padding)."""
    pytest.importorskip(backend)
    cfg = swafactory.validate(swafactory.compose(
        [f"backend={backend}", "spec=none", "model=gpt_oss_20b", "workload.device=cuda"]))
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
    backend_.guards = False  # the replay guard reads the padding rows back, on purpose
    backend_.init_forward_metadata_replay(batch, bucket, 1)  # first use: lazy imports
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        plan = backend_.init_forward_metadata_replay(batch, bucket, 1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert plan.total_q == bucket
