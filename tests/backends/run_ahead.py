"""A host that runs ahead, as an overlap scheduler's does: forwards planned before the earlier
ones have run, against the same forwards run serially.

Eight forwards of different batches (other requests, sizes and lengths each time) are planned
and launched through the public API (`build_pools`, `RequestSlots`, `build_backend`,
``init_forward_metadata``, ``forward`` per layer). Before each forward a long kernel
(``torch.cuda._sleep``) is queued on the stream, so a copy that planning enqueues runs well after
the host has planned the next ones; the host waits only for the forward ``ahead`` steps back (an
engine's one-step-late read back). The outputs must be bit-identical to the serial run's (a
device sync after each forward). A buffer the host rewrites while an earlier forward's copy from
it is still queued (FlashInfer's pinned plan workspace, a planner's pinned staging) makes the
kernels read another forward's plan: wrong outputs or an illegal memory access.

Run as a script (an illegal memory access ends the process, so `test_run_ahead_gpu.py` runs it
in a subprocess), printing one JSON line:

    python tests/backends/run_ahead.py --backend flashinfer --mode decode[,verify_tree…] [--guards]

It uses only the API every version of the embedding contract has, so it runs unchanged on an
older checkout (how the race was reproduced before the fix).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

import swafactory
from swafactory.kvcache.factory import build_pools
from swafactory.kvcache.pool import ReqToToken
from swafactory.kvcache.requests import RequestSlots
from swafactory.metadata.batch import ForwardBatch, ReqForward

__all__ = ["MODES", "run"]

TREE8 = (-1, 0, 0, 1, 1, 2, 2, 3)
MODES = {  # mode → (forward mode, nodes per request, ReqForward extras, save_kv)
    "decode": ("decode", 1, {}),
    "verify_chain": ("target_verify", 8, {}),
    "verify_tree": ("target_verify", 8, {"parents": TREE8}),
    "draft_extend": ("draft_extend", 4, {}),
}
BATCHES = (32, 5, 17, 1, 29, 8, 24, 12)
"""Requests of the eight forwards: each forward's batch differs from the one before."""


def _forwards(slots, alloc, mode: str, ctx: int, max_bs: int, seed: int):
    """The eight batches: request ids, prefix lengths and the ForwardBatch of each."""
    kind, nodes, extra = MODES[mode]
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, bs in enumerate(BATCHES):
        bs = min(bs, max_bs)
        rids = torch.randperm(max_bs, generator=g)[:bs].tolist()
        lens = torch.randint(ctx // 4, ctx, (bs,), generator=g).tolist()
        reqs = [ReqForward(r, slots.reqs[r].row, L, nodes, **extra) for r, L in zip(rids, lens)]
        out.append(ForwardBatch.of(kind, reqs, slots.req_to_token.table, alloc.full_id))
    return out


def fresh_flashinfer_staging() -> list:
    """A measurement, not a fix: every FlashInfer plan (``plan``, and the adapter's scheduler
    call where it has one) gets a pinned int workspace never used before, kept alive to the end.
    If the race goes with this alone, its cause is that buffer's reuse. Returns the keep-alive
    list."""
    import flashinfer

    kept: list = []

    def fresh(w) -> None:
        old = w._pin_memory_int_workspace_buffer
        kept.append(old)
        w._pin_memory_int_workspace_buffer = torch.empty_like(old, pin_memory=True)

    def wrap(fn):
        def planned(w, *a, **k):
            fresh(w)
            return fn(w, *a, **k)
        return planned

    for cls in (flashinfer.BatchDecodeWithPagedKVCacheWrapper,
                flashinfer.BatchPrefillWithPagedKVCacheWrapper):
        cls.plan = wrap(cls.plan)
    try:
        from swafactory.kernels import flashinfer_replan as rp
        rp.replan_decode = wrap(rp.replan_decode)
    except ImportError:
        pass
    return kept


def run(backend: str, mode: str, *, guards: bool, ahead: int, device: str = "cuda",
        model: str = "gpt_oss_20b", max_bs: int = 32, ctx: int = 4096, layers: int = 4,
        sleep_ms: float = 200.0, seed: int = 0, fresh_staging: bool = False) -> dict:
    """Serial and run-ahead outputs of the eight forwards; returns a summary dict.
    fresh_staging: `fresh_flashinfer_staging` first (the cause's measurement)."""
    kept = fresh_flashinfer_staging() if fresh_staging else None
    cfg = swafactory.validate(swafactory.compose(
        [f"backend={backend}", "spec=none", f"model={model}", f"workload.device={device}",
         f"model.num_layers={layers}"]))
    nodes = MODES[mode][1]
    per = ctx + nodes + 64
    pool, alloc = build_pools(cfg, max_bs * per, max_bs * per, device)
    slots = RequestSlots(alloc, ReqToToken(max_bs, per, device))
    torch.manual_seed(seed)
    for sub in pool.sub_pools:  # random K/V everywhere: every slot a read may reach
        for b in (*sub.k_bufs, *sub.v_bufs):
            b.copy_(torch.randn(b.shape, device=device).to(b.dtype))
    for rid in range(max_bs):
        slots.open(rid)
        slots.extend(rid, ctx + nodes)
    be = swafactory.build_backend(cfg, pools=pool, guards=guards)
    batches = _forwards(slots, alloc, mode, ctx, max_bs, seed)
    hq = be.q_heads
    lids = sorted(pool.layers_mapping)
    qs = [{lay: torch.randn(b.total_q, hq, pool.sub_pool(lay).head_dim, device=device,
                            dtype=torch.bfloat16) for lay in lids} for b in batches]

    def step(i: int) -> list[torch.Tensor]:
        be.init_forward_metadata(batches[i])
        return [be.forward(qs[i][lay], None, None, lay, save_kv=False) for lay in lids]

    cuda = device == "cuda"
    serial = []
    for i in range(len(batches)):  # serial: the device idles between forwards
        serial.append(step(i))
        if cuda:
            torch.cuda.synchronize()
    cycles = 0
    if cuda:  # the sleep's clock rate, measured once
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        torch.cuda._sleep(10_000_000)
        t1.record()
        torch.cuda.synchronize()
        cycles = int(10_000_000 * sleep_ms / max(t0.elapsed_time(t1), 1e-3))
    ran, done = [], []
    for i in range(len(batches)):
        if cuda:
            torch.cuda._sleep(cycles)  # the copies planning queues now run long after
            if i >= ahead:  # an engine's host waits for the forward `ahead` steps back only
                done[i - ahead].synchronize()
        ran.append(step(i))
        if cuda:
            ev = torch.cuda.Event()
            ev.record()
            done.append(ev)
    if cuda:
        torch.cuda.synchronize()
    diffs = []
    for i, (a, b) in enumerate(zip(serial, ran)):
        for lay, x, y in zip(lids, a, b):
            if not torch.equal(x, y):
                diffs.append({"forward": i, "layer": lay, "batch": batches[i].batch_size,
                              "max_abs": float((x.float() - y.float()).abs().max())})
    return {"backend": backend, "mode": mode, "guards": guards, "ahead": ahead,
            "fresh_staging": fresh_staging, "forwards": len(batches), "layers": len(lids),
            "mismatches": len(diffs), "first": diffs[:4],
            "staging_kept": None if kept is None else len(kept)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="flashinfer")
    ap.add_argument("--mode", default="decode",
                    help=f"one or more of {', '.join(sorted(MODES))}, comma-separated (one "
                         "process: an illegal memory access ends the modes after it)")
    ap.add_argument("--guards", action="store_true")
    ap.add_argument("--ahead", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="gpt_oss_20b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--sleep-ms", type=float, default=200.0)
    ap.add_argument("--fresh-staging", action="store_true",
                    help="give every FlashInfer plan a never-used pinned int workspace (a "
                         "measurement of the race's cause)")
    a = ap.parse_args(argv)
    modes = a.mode.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"--mode {','.join(bad)}: choose from {', '.join(sorted(MODES))}")
    failed = 0
    for i, mode in enumerate(modes):
        r = run(a.backend, mode, guards=a.guards, ahead=a.ahead, device=a.device,
                model=a.model, layers=a.layers, ctx=a.ctx, sleep_ms=a.sleep_ms,
                fresh_staging=a.fresh_staging and i == 0)  # the patch, once per process
        print(json.dumps(r), flush=True)
        failed += r["mismatches"] > 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
