"""What the GPU benchmarks share: real pools with requests in them, a batch, the step's inputs,
one engine-style step, and the clocks (device copy bandwidth, CUDA-graph replay, host wall time).

Every bench and probe builds its case the same way: `setup` (the model's pools, every layer, the
allocator's pages shuffled, ``bs`` requests of ``ctx`` committed tokens with their out-of-window
SWA slots evicted, K/V random), `batch_of` (the forward a mode runs), `step_inputs` (q/k/v per
layer) and `step_cycle` (``init_forward_metadata`` + ``forward`` over every layer). Nothing here
imports another bench module: the benches import this one, never each other.
"""
from __future__ import annotations

import gc
import json
import math
import sys
import time
from pathlib import Path

import torch

__all__ = ["MODES", "TREE8", "SPEC_OF", "LN2", "config_of", "setup", "batch_of", "step_inputs", "step_cycle",
           "kv_bytes_read", "copy_bandwidth", "capture", "device_ms", "host_ms", "graph_case",
           "variant_rows", "table_head", "probe_cases", "case_args", "card_tag"]

MODES = {"decode": 1, "verify_chain8": 8, "verify_tree8": 8, "draft_block8": 8}
"""Step tokens per request of each mode. ``draft_block8`` is a DFlash draft step: 8 queries that
see each other and the prefix (a ``draft_decode`` forward with a block mask)."""
TREE8 = (-1, 0, 0, 1, 1, 2, 2, 3)
SPEC_OF = {"verify_chain8": ("spec=eagle", "spec.num_steps=7", "spec.num_draft_tokens=8"),
           "verify_tree8": ("spec=eagle3", "spec.topk=2", "spec.num_steps=4",
                            "spec.num_draft_tokens=8")}
"""The spec whose step a mode is (compose overrides; other modes run under spec=none): a chain
spec's graph buckets are captured as eager runs chains (causal), a tree spec's masked."""
LN2 = math.log(2.0)


def card_tag(device: str) -> str:
    """A record's name for the device it ran on (``torch.cuda.get_device_name()``, or ``cpu``):
    h200, h100, cpu, else gpu. A record names its card: one made on an H100 is never h200."""
    return next((t.lower() for t in ("H200", "H100") if t in device),
                "cpu" if device == "cpu" else "gpu")


def config_of(model: str, backend_name: str, device: str = "cuda", overrides: tuple = ()):
    """The validated config of ``model`` on ``backend_name`` (spec none), plus ``overrides``."""
    import swafactory

    return swafactory.validate(swafactory.compose(
        [f"model={model}", f"backend={backend_name}", "spec=none", "workload=smoke",
         f"workload.device={device}",
         *overrides]))


def setup(model: str, bs: int, ctx: int, nodes: int, seed: int = 0, backend_name: str =
          "flashinfer", device: str = "cuda", overrides: tuple[str, ...] = ()):
    """Config, pools, slots and backend with ``bs`` requests of ``ctx`` committed tokens plus
    ``nodes`` step tokens (SWA slots allocated 64 at a time and evicted as they leave the window:
    the SWA pool holds the windows, not the contexts). overrides: more compose overrides."""
    import swafactory
    from swafactory.kvcache.factory import build_pools
    from swafactory.kvcache.pool import ReqToToken
    from swafactory.kvcache.requests import RequestSlots
    from swafactory.kvcache.shares import size_pools

    cfg = config_of(model, backend_name, device, overrides)
    W = cfg.model.sliding_window
    chunk = 64
    sizes = size_pools(cfg, bs, ctx + nodes, chunk=chunk)
    pool, alloc = build_pools(cfg, sizes.full, sizes.swa, device)
    alloc.shuffle(torch.Generator().manual_seed(seed))
    slots = RequestSlots(alloc, ReqToToken(sizes.max_requests, sizes.full_per_request, device))
    split = bool(cfg.model.swa_layers and cfg.model.hybrid_pool)
    for rid in range(bs):
        slots.open(rid)
        done = 0
        while done < ctx + nodes:
            n = min(chunk, ctx + nodes - done)
            slots.extend(rid, n)
            done += n
            if split:
                slots.evict_out_of_window(rid, min(done, ctx), W, 1)
    g = torch.Generator(device=device).manual_seed(seed)
    for sub in pool.sub_pools:
        for buf in (*sub.k_bufs, *sub.v_bufs):
            if buf.dtype.itemsize == 1:  # fp8: no normal_ kernel; drawn in bf16 and cast
                buf.copy_(torch.randn(buf.shape, generator=g, device=device,
                                      dtype=torch.bfloat16))
            else:
                buf.normal_(generator=g)
    backend = swafactory.build_backend(cfg, pools=pool)
    return cfg, pool, alloc, slots, backend


def batch_of(mode: str, slots, alloc, bs: int, ctx: int):
    """The forward ``mode`` (a `MODES` key) runs over the ``bs`` requests `setup` opened."""
    from swafactory.metadata.batch import ForwardBatch, ReqForward

    n = MODES[mode]
    parents = TREE8 if mode == "verify_tree8" else None
    block = mode == "draft_block8"
    reqs = [ReqForward(r, slots.reqs[r].row, ctx, n, parents=parents, block=block)
            for r in range(bs)]
    kind = "decode" if n == 1 else "draft_decode" if block else "target_verify"
    return ForwardBatch.of(kind, reqs, slots.req_to_token.table, alloc.full_id)


def step_inputs(cfg, pool, total_q: int, seed: int = 1):
    """Per layer q [total_q, Hq, D], k and v [total_q, Hkv, D] (bf16, on the GPU), and the sinks
    [Hq] fp32 of a model that has them (else None)."""
    m = cfg.model
    g = torch.Generator(device="cuda").manual_seed(seed)
    qs, ks, vs = [], [], []
    for layer in range(m.num_layers):
        sub = pool.sub_pool(layer)
        qs.append(torch.randn(total_q, m.num_attention_heads, sub.head_dim, device="cuda",
                              dtype=torch.bfloat16, generator=g))
        ks.append(torch.randn(total_q, sub.num_kv_heads, sub.head_dim, device="cuda",
                              dtype=torch.bfloat16, generator=g))
        vs.append(torch.randn_like(ks[-1]))
    sinks = (torch.randn(m.num_attention_heads, device="cuda") if m.attention_sinks else None)
    return qs, ks, vs, sinks


def step_cycle(backend, batch, qs, ks, vs, sinks):
    """One step as an engine runs it: ``init_forward_metadata`` + ``forward`` (K/V write and
    attention) over every layer; returns the callable (it returns the last layer's output)."""
    def cycle():
        backend.init_forward_metadata(batch)
        for layer in range(len(qs)):
            out = backend.forward(qs[layer], ks[layer], vs[layer], layer, sinks=sinks)
        return out
    return cycle


def kv_bytes_read(plan, pool) -> int:
    """K/V bytes one step reads: every group's key list (an SWA layer's only its window) × the
    row bytes of its sub-pool (K and V, the pool's dtype) × the group's layers."""
    total = 0
    for key, gp in plan.groups.items():
        layers = [lay for lay, k in plan.layer_groups.items() if k == key]
        sub = pool.sub_pool(layers[0])
        row = 2 * sub.num_kv_heads * sub.head_dim * sub.k_bufs[0].element_size()
        total += gp.tables.kv_indices.tensor.numel() * row * len(layers)
    return total


def copy_bandwidth(do_bench) -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy."""
    src = torch.empty(2**28, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * src.numel() * 4 / (ms * 1e-3)


def capture(fn):
    """``fn`` run once on a side stream (its first use: allocations, compiles), then captured in
    a CUDA graph, as an engine captures its step; returns (graph, what the captured call
    returned)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def device_ms(fn, do_bench) -> tuple[float, str]:
    """The device time of ``fn``'s kernels without its host launch time: ``fn`` captured once in
    a CUDA graph and replayed (do_bench median), or, where it cannot be captured, the kernels'
    own time from the torch profiler (mean over 20 calls). Returns (ms, "graph" | "profiler")."""
    try:
        g, _ = capture(fn)
        ms = do_bench(g.replay, warmup=10, rep=100, return_mode="median")
        del g
        return ms, "graph"
    except Exception:  # noqa: BLE001 - a library that cannot be captured: its kernels' time
        torch.cuda.synchronize()
        from torch.profiler import ProfilerActivity, profile

        n = 20
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                fn()
            torch.cuda.synchronize()
        us = sum(e.self_device_time_total for e in prof.key_averages())
        return us / n / 1e3, "profiler"


def host_ms(fn, n: int) -> float:
    """Median wall ms of ``fn`` between two device synchronizations (its host work and the
    device work it queued)."""
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def graph_case(backend, batch, qs, ks, vs, sinks, factory, do_bench) -> dict:
    """The same step captured as an engine captures its own (K/V writes and attention of every
    layer inside one CUDA graph, through the backend's graph contract): replay time alone, and
    the graph cycle (`init_forward_metadata_replay` + replay)."""
    bs, tokens = batch.batch_size, max(r.q_len for r in batch.reqs)
    L = len(qs)

    def step():
        for layer in range(L):
            out = backend.forward(qs[layer], ks[layer], vs[layer], layer, sinks=sinks)
        return out

    try:
        # buffers sized by what the batch reads (its longest request), not by the pool
        backend.init_cuda_graph_state(bs, tokens, max(r.prefix_len + r.nodes for r in batch.reqs))
        backend.init_forward_metadata_capture(bs, tokens, batch.mode)
        g, out = capture(step)
        backend.init_forward_metadata_replay(batch, bs, tokens)
        g.replay()
        diff = float((out.float() - factory().float()).abs().max())

        def cycle():
            backend.init_forward_metadata_replay(batch, bs, tokens)
            g.replay()

        backend.init_forward_metadata_replay(batch, bs, tokens)
        t_rep = do_bench(g.replay, warmup=5, rep=40, return_mode="median")
        t_cyc = do_bench(cycle, warmup=5, rep=40, return_mode="median")
        del g
        return dict(replay_ms=t_rep, graph_cycle_ms=t_cyc, graph_diff=diff)
    except Exception as e:  # noqa: BLE001 - a bench row records what failed
        return dict(graph_error=f"{type(e).__name__}: {e}"[:200])


def variant_rows(a, backends: str, variants, run_one) -> tuple[list[dict], float]:
    """One row per (model in ``a.models``, backend in ``backends``, bs in ``a.bs``), holding one
    entry per variant: ``run_one(model, backend, bs, variant, do_bench, bw)``, or the case's
    error, or "not run: deadline" past ``a.deadline`` s. Returns (rows, copy bandwidth)."""
    from triton.testing import do_bench

    t0 = time.perf_counter()
    bw = copy_bandwidth(do_bench)
    rows = []
    for model in a.models.split(","):
        for backend_name in backends.split(","):
            for bs in (int(x) for x in a.bs.split(",")):
                r = dict(model=model, backend=backend_name, bs=bs, ctx=a.ctx)
                for var in variants:
                    if time.perf_counter() - t0 > a.deadline:
                        r[str(var)] = {"error": "not run: deadline"}
                        continue
                    try:
                        r[str(var)] = run_one(model, backend_name, bs, var, do_bench, bw)
                    except Exception as exc:  # noqa: BLE001 - a case's failure is a row
                        r[str(var)] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                        gc.unfreeze()
                        gc.collect()
                        torch.cuda.empty_cache()
                rows.append(r)
                print(json.dumps(r), flush=True)
    return rows, bw


def table_head(title: str, meta: dict) -> list[str]:
    """The first lines of a bench table: title, run facts, the command."""
    return [f"# {title}", "",
            f"Commit `{meta['commit']}`; {meta['gpu']}; torch {meta['torch']}; copy bandwidth "
            f"{meta['copy_tbs']:.2f} TB/s; ctx {meta['ctx']}; every layer of the model.", "",
            f"    {meta['command']}", ""]


def probe_cases(case, defaults: list[str], file_name: str, shown=lambda row: row) -> None:
    """A probe's command line ``OUT [model:bs ...]``: ``case(model, bs)`` per case (``defaults``
    when none is given); each row printed as JSON (``shown(row)``: what to print of it) and all
    rows rewritten to OUT/``file_name`` after each case, so a cut run keeps what it measured.
    No OUT, or -h / --help: the probe's docstring, and nothing made."""
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        print(sys.modules["__main__"].__doc__)
        sys.exit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for c in sys.argv[2:] or defaults:
        model, bs = c.split(":")
        rows.append(case(model, int(bs)))
        print(json.dumps(shown(rows[-1])), flush=True)
        (out_dir / file_name).write_text(json.dumps(rows, indent=1))


def case_args(ap, models: str, bs: str) -> None:
    """The options every per-case bench takes (``variant_rows`` reads them)."""
    ap.add_argument("--out", required=True, help="folder for the .md, .json and .png")
    ap.add_argument("--models", default=models)
    ap.add_argument("--bs", default=bs, help="batch sizes, comma-separated")
    ap.add_argument("--ctx", type=int, default=8192, help="committed tokens per request")
    ap.add_argument("--commit", default="unknown", help="the commit the record names")
    ap.add_argument("--deadline", type=float, default=420.0, help="seconds: no case starts later")


if __name__ == "__main__":  # a module, not a bench: say what it holds
    print(__doc__)
