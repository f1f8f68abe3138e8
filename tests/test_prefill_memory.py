"""Planning memory of a long prefill chunk stays bounded by its key lists, not by q_len × kv_len.

One 8192-token chunk over a 131072-token prefix, at Gemma 4's windows and layer pattern
(``model=gemma4``: W = 1024, five sliding layers per full one, two layer groups), is planned
by the planner and the FlashInfer adapter's host work (`Adapter.plan` without signatures: its
`_prepare` for every pass, no FlashInfer call). A custom mask of one bit per (query, key) would
take 8192 × 139264 bits plus its temporaries, gigabytes; plain chunks run FlashInfer's causal
rule instead, and everything planned here must stay under 64 MB.

The measure is the process's peak resident memory over the call (Linux ``VmHWM``, reset by
``/proc/self/clear_refs``), in a fresh interpreter with glibc told to map every allocation of
64 KB or more on its own and to return it on free, so a freed block is not reused unseen; every
tensor and numpy temporary counts. The address space is capped at 1 GiB above the set-up, so a
dense mask fails fast instead of taking the machine's memory. The pools are built with 1 KV head
of head_dim 8: planning reads slots and positions, never K/V, so the heads change nothing it
allocates.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

CHUNK, PREFIX = 8192, 131072
LIMIT_MB = 64
GEOMETRY = ("model.swa.num_kv_heads=1", "model.swa.head_dim=8", "model.full.num_kv_heads=1",
            "model.full.head_dim=8", "model.num_layers=6")


def _status(key: str) -> int:
    """A /proc/self/status field in bytes (``VmHWM``, ``VmRSS``, ``VmSize``)."""
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{key}:\s+(\d+) kB", text, re.M).group(1)) * 1024


def _world():
    """Gemma 4's config (small heads), its pools on CPU, and one request holding ``PREFIX``
    committed tokens plus a ``CHUNK``-token chunk, allocated chunk by chunk with the SWA slots
    behind the window evicted (as an engine prefills)."""
    import torch

    import swafactory
    from swafactory.kvcache.factory import build_pools
    from swafactory.kvcache.pool import ReqToToken
    from swafactory.kvcache.requests import RequestSlots
    from swafactory.kvcache.shares import size_pools
    from swafactory.metadata.batch import ForwardBatch, ReqForward

    cfg = swafactory.validate(swafactory.compose(
        ["model=gemma4", "backend=torch", "spec=none", "workload.device=cpu", *GEOMETRY]))
    W = cfg.model.sliding_window
    sizes = size_pools(cfg, 1, PREFIX + CHUNK, chunk=CHUNK)
    pool, alloc = build_pools(cfg, sizes.full, sizes.swa, "cpu")
    slots = RequestSlots(alloc, ReqToToken(sizes.max_requests, sizes.full_per_request, "cpu"))
    slots.open(0)
    done = 0
    while done < PREFIX + CHUNK:
        slots.extend(0, CHUNK)
        done += CHUNK
        slots.evict_out_of_window(0, min(done, PREFIX), W, 1)
    backend = swafactory.build_backend(cfg, pools=pool)  # its windows and resolver
    batch = ForwardBatch.of("extend", [ReqForward(0, slots.reqs[0].row, PREFIX, CHUNK)],
                            slots.req_to_token.table, alloc.full_id)
    small = ForwardBatch.of("extend", [ReqForward(0, slots.reqs[0].row, 64, 64)],
                            slots.req_to_token.table, alloc.full_id)
    del torch
    return backend, pool, batch, small


def measure() -> dict:
    """Peak bytes above the set-up while planning the chunk (planner + FlashInfer adapter)."""
    import gc
    import resource

    import torch

    from swafactory.kernels.flashinfer import Adapter
    from swafactory.metadata.plan import plan
    from swafactory.resolve.source import resolve_kv_source

    torch.set_num_threads(1)
    backend, pool, batch, small = _world()

    def plan_all(b):
        source = resolve_kv_source(backend.view, backend.cfg.backend.resolver)
        fplan = plan(b, pool.layers_mapping, backend.windows, source,
                     page_size=pool.sub_pools[0].page_size)
        adapter = Adapter()
        adapter.plan(fplan, pool)  # no signatures: _prepare of every pass, no FlashInfer call
        return fplan, adapter

    kept = plan_all(small)  # lazy imports and first-use caches are not the chunk's
    del kept
    gc.collect()
    gc.disable()
    cap = _status("VmSize") + 2**30
    resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    base = _status("VmRSS")
    try:
        fplan, adapter = plan_all(batch)
    except (MemoryError, RuntimeError) as err:  # the address-space cap: gigabytes were asked
        return dict(peak=None, error=f"{type(err).__name__}: {str(err)[:200]}")
    peak = _status("VmHWM") - base
    keys = {k: g.tables.kv_indices.tensor.numel() for k, g in fplan.groups.items()}
    return dict(peak=peak, keys=keys, groups=sorted(fplan.groups))


@pytest.mark.skipif(not sys.platform.startswith("linux") or
                    not os.access("/proc/self/clear_refs", os.W_OK),
                    reason="peak memory is read from Linux's /proc/self/status")
def test_long_chunk_plans_in_bounded_memory() -> None:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0",
               MALLOC_ARENA_MAX="1", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["peak"] is not None, (
        f"planning one {CHUNK}-token chunk over a {PREFIX}-token prefix asked for more than 1 GiB "
        f"({got['error']}): a dense per-(query, key) tensor")
    # both of Gemma 4's groups were planned: the full one lists every key, the SWA one W + chunk
    assert got["keys"]["full"] == PREFIX + CHUNK, got
    assert len(got["groups"]) == 2 and min(got["keys"].values()) < 2 * CHUNK, got
    assert got["peak"] < LIMIT_MB * 2**20, (
        f"planning took {got['peak'] / 2**20:.1f} MB at peak (limit {LIMIT_MB} MB): {got}")


if __name__ == "__main__":
    print(json.dumps(measure()))
