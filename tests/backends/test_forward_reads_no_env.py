"""A layer's forward reads no ``os.environ``: the kernels' overrides (``TRITON_INTERPRET``, our
CUDA kernels' switches and tile knobs, `kernels.cuda.KernelEnv`) are read once, when the backend
is built, and each adapter runs its kernels under that snapshot.

``os.environ`` is swapped for a mapping that records every read whose caller is swafactory's
code (reads by torch or Triton themselves are theirs), around the planned step's per-layer
``forward`` calls of the triton backend (interpreted on CPU: decode, a tree verify, a cascade
merge) and the torch backend. A kernel function called directly, outside an adapter (a test, a
benchmark turning a knob between calls), still reads the environment at that call.
"""
from __future__ import annotations

import collections
import importlib.util
import os
import sys
from collections.abc import MutableMapping
from pathlib import Path

import pytest
import torch

import swafactory
from swafactory.kernels.cuda import CURRENT, KernelEnv, kernel_env
from swafactory.kvcache.factory import build_pools
from swafactory.kvcache.pool import ReqToToken
from swafactory.kvcache.requests import RequestSlots
from swafactory.metadata.batch import ForwardBatch, ReqForward

PKG = Path(swafactory.__file__).parent
TREE = (-1, 0, 0, 1)
STEPS = {"decode": ("decode", 1, {}), "verify_tree": ("target_verify", 4, {"parents": TREE})}


class _Watched(MutableMapping):
    """``os.environ`` that records (file:line) of each read made by swafactory's code."""

    def __init__(self, real) -> None:
        self.real, self.reads = real, collections.Counter()

    def _note(self) -> None:
        f = sys._getframe(2)
        while f is not None and f.f_code.co_filename in (__file__, os.__file__):
            f = f.f_back  # os.getenv and the mapping's own methods are not the caller
        path = Path(f.f_code.co_filename) if f is not None else None
        if path is not None and path.is_relative_to(PKG):
            self.reads[f"{path.relative_to(PKG)}:{f.f_lineno}"] += 1

    def __getitem__(self, key):
        self._note()
        return self.real[key]

    def get(self, key, default=None):
        self._note()
        return self.real.get(key, default)

    def __contains__(self, key) -> bool:
        self._note()
        return key in self.real

    def __iter__(self):
        self._note()
        return iter(self.real)

    def __len__(self) -> int:
        return len(self.real)

    def __setitem__(self, key, value) -> None:
        self.real[key] = value

    def __delitem__(self, key) -> None:
        del self.real[key]


def _world(backend: str, tree_mask: str):
    cfg = swafactory.validate(swafactory.compose(
        [f"backend={backend}", "spec=none", "model=tiny", "workload.device=cpu",
         "backend.kv_dtype=float32", f"backend.tree_mask={tree_mask}"]))
    bs, ctx, W = 2, 24, cfg.model.sliding_window
    pool, alloc = build_pools(cfg, bs * 64, bs * 64, "cpu")
    slots = RequestSlots(alloc, ReqToToken(bs, 64, "cpu"))
    for rid in range(bs):
        slots.open(rid)
        slots.extend(rid, ctx + 4)
        slots.evict_out_of_window(rid, ctx, W)
    return swafactory.build_backend(cfg, pools=pool), pool, slots, alloc, ctx


def _runnable(backend: str) -> bool:
    """The torch backend, and triton where its kernels run on CPU tensors (interpreted)."""
    return backend == "torch" or (importlib.util.find_spec("triton") is not None
                                  and os.environ.get("TRITON_INTERPRET") == "1")


@pytest.mark.parametrize("tree_mask", ["custom_mask", "cascade"])
@pytest.mark.parametrize("mode", sorted(STEPS))
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_layers_forward_reads_no_environment(monkeypatch, backend: str, mode: str,
                                               tree_mask: str) -> None:
    if not _runnable(backend):
        pytest.skip(f"{backend} kernels need TRITON_INTERPRET=1 on CPU")
    if mode == "decode" and tree_mask == "cascade":
        pytest.skip("a decode has no tree to split")
    be, pool, slots, alloc, ctx = _world(backend, tree_mask)
    kind, nodes, shape = STEPS[mode]
    batch = ForwardBatch.of(kind, [ReqForward(r, slots.reqs[r].row, ctx, nodes, **shape)
                                   for r in range(2)], slots.req_to_token.table, alloc.full_id)
    g = torch.Generator().manual_seed(0)
    inputs = []
    for layer in sorted(pool.layers_mapping):
        sub = pool.sub_pool(layer)
        q = torch.randn(batch.total_q, be.q_heads, sub.head_dim, generator=g)
        k = torch.randn(batch.total_q, sub.num_kv_heads, sub.head_dim, generator=g)
        inputs.append((layer, q, k, torch.randn_like(k)))
    be.init_forward_metadata(batch)
    watched = _Watched(os.environ)
    monkeypatch.setattr(os, "environ", watched)
    outs = [be.forward(q, k, v, layer) for layer, q, k, v in inputs]
    monkeypatch.undo()
    assert all(torch.isfinite(o).all() for o in outs)
    assert not watched.reads, f"a layer's forward read os.environ at {dict(watched.reads)}"


def test_the_watch_sees_an_environment_read_by_our_kernels(monkeypatch) -> None:
    """The check can fail: a Triton helper called outside an adapter reads the environment."""
    from swafactory.kernels.triton.merge import interpreting

    watched = _Watched(os.environ)
    monkeypatch.setattr(os, "environ", watched)
    interpreting()
    monkeypatch.undo()
    assert any(site.startswith("kernels/cuda/__init__.py") for site in watched.reads)


def test_the_backend_keeps_the_snapshot_of_its_build(monkeypatch) -> None:
    """Overrides are read when the backend is built: a knob changed later does not reach its
    kernels, while a kernel function called directly sees the environment of its call."""
    from swafactory.kernels.cuda.decode import tile
    from swafactory.kernels.cuda.decode_fp8 import fp8_tile
    from swafactory.kernels.cuda.verify import tile_config

    monkeypatch.setenv("SWAFACTORY_DECODE_TILE", "128x2x4")
    monkeypatch.setenv("SWAFACTORY_CUDA_DECODE", "0")
    be, *_ = _world("torch", "custom_mask")
    env = be.kernel_env
    assert env.decode_tile == "128x2x4" and not env.cuda_decode and env.cuda_kernels
    monkeypatch.setenv("SWAFACTORY_DECODE_TILE", "64x3")
    monkeypatch.setenv("SWAFACTORY_FP8_TILE", "64x2x2")
    monkeypatch.setenv("SWAFACTORY_VERIFY_TILE", "32x2")
    assert tile(1, 1) == (64, 3, 0) and fp8_tile(256) == (64, 2, 2)  # direct: read now
    token = CURRENT.set(env)  # as an adapter runs its kernels
    try:
        watched = _Watched(os.environ)
        monkeypatch.setattr(os, "environ", watched)
        assert tile(1, 1) == (128, 2, 4) and fp8_tile(256) == (64, 3, 0)
        assert kernel_env() is env and not watched.reads
    finally:
        monkeypatch.undo()
        CURRENT.reset(token)
    token = CURRENT.set(KernelEnv(verify_tile="32x2x1"))
    try:
        assert tile_config(torch.device("cpu")) == (32, 2, 1)
    finally:
        CURRENT.reset(token)


@pytest.mark.parametrize("which", ["decode_d64", "decode_fp8", "verify_d512"])
def test_whether_our_cuda_kernels_serve_is_decided_without_the_environment(monkeypatch,
                                                                           which: str) -> None:
    """`*_serves` under an adapter's snapshot: the switches come from it (here: off)."""
    from swafactory.kernels.cuda.decode import decode_d64_serves
    from swafactory.kernels.cuda.decode_fp8 import decode_fp8_serves
    from swafactory.kernels.cuda.verify import verify_d512_serves

    d = {"decode_d64": 64, "decode_fp8": 256, "verify_d512": 512}[which]
    q = torch.zeros(1, 8, d, dtype=torch.bfloat16)
    kv = torch.zeros(4, 1, d, dtype=torch.float8_e4m3fn if which == "decode_fp8" else
                     torch.bfloat16)
    call = {"decode_d64": lambda: decode_d64_serves(q, kv, kv, 8, None, False),
            "decode_fp8": lambda: decode_fp8_serves(q, kv, kv, 8, None),
            "verify_d512": lambda: verify_d512_serves(q, kv, kv, 8, 8)}[which]
    token = CURRENT.set(KernelEnv(cuda_kernels=False, cuda_decode=False))
    try:
        watched = _Watched(os.environ)
        monkeypatch.setattr(os, "environ", watched)
        assert call() is False
        monkeypatch.undo()
    finally:
        CURRENT.reset(token)
    assert not watched.reads, dict(watched.reads)
