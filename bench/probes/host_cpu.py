"""How much host work does a GPU forward's planning cost? Measured on a CPU (no GPU needed).

``init_forward_metadata`` on a GPU takes the fused key-list path (`metadata.keys_triton`) and the
flashinfer adapter's plan. This runs the same Python on CPU tensors: the planner is forced onto
the fused path with its one Triton launch replaced by a stub that zero-fills the outputs, and
FlashInfer is the test suite's CPU fake (`tests/backends/flashinfer_fake.py`) with its ``plan``
made a no-op (FlashInfer's own plan is paid by a raw engine too). What is timed is then the host work an engine's step pays around
the one launch and FlashInfer's own plan: the per-request numbers, the pack, the plan objects,
the typed-space wrapping and the adapter's per-pass preparation.

    python bench/probes/host_cpu.py [--cases gpt_oss_20b:8,gemma4:64] [--reps 200] [--profile]

Prints the median and 10th percentile per case (a shared machine's timings are noisy: compare
the low percentiles of interleaved runs): ``init_forward_metadata`` (ms) and the host time of one layer's
``forward`` (µs: the K/V write, the typed-space bookkeeping, the adapter's ``run`` around
FlashInfer's, which is stubbed to return preallocated outputs; the sink epilogue, one Triton
launch on a GPU, is stubbed too), and,
with ``--profile``, a cProfile of the planning. The
GPU host's CPU differs from this one: compare before/after pairs of one machine, not figures
across machines.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "backends"))


class _StubLaunch:
    """Stands in for the compiled ``build_keys`` kernel: ``kernel[grid](*args)`` zero-fills
    the two output buffers (args 5 and 6), so every downstream check sees valid slot 0."""

    def __getitem__(self, grid):
        def launch(*args, **kw):
            args[5].zero_()
            args[6].zero_()
        return launch


_OUT: dict = {}


def _stub_run(self, q, paged_kv_cache, return_lse=False, **kw):
    """FlashInfer's ``run`` as a constant: preallocated (o, base-2 lse) of q's shape."""
    key = (tuple(q.shape), q.dtype)
    if key not in _OUT:
        _OUT[key] = (torch.zeros_like(q), torch.zeros(q.shape[:2]))
    o, lse = _OUT[key]
    return (o, lse) if return_lse else o


def world(model: str, bs: int, ctx: int):
    """`common.setup` on CPU (small head geometry: planning never reads K/V), with the
    flashinfer adapter over the CPU fake."""
    import common
    from bench_planning import GEOMETRY
    from swafactory.backend import AttentionBackend, TargetView, model_windows
    from swafactory.kernels.flashinfer import Adapter

    cfg, pool, alloc, slots, _ = common.setup(model, bs, ctx, 1, backend_name="torch",
                                                     device="cpu", overrides=GEOMETRY)
    # guards off: the stubbed key-list launch zero-fills the tables, which the guards' slot
    # check would rightly refuse (every read would be the dummy row)
    backend = AttentionBackend(cfg, Adapter(), TargetView(pool), model_windows(cfg), guards=False)
    return cfg, alloc, slots, backend


def inputs(cfg, backend, total_q: int):
    """Per layer q [total_q, Hq, D], k and v [total_q, Hkv, D] in the pool's dtype (CPU), and
    the sinks [Hq] where the model has them."""
    m, pool = cfg.model, backend.view.active_pool
    qs, ks, vs = [], [], []
    for layer in range(m.num_layers):
        sub = pool.sub_pool(layer)
        qs.append(torch.randn(total_q, m.num_attention_heads, sub.head_dim).to(sub.dtype))
        ks.append(torch.randn(total_q, sub.num_kv_heads, sub.head_dim).to(sub.dtype))
        vs.append(torch.randn_like(ks[-1]))
    sinks = torch.randn(m.num_attention_heads) if m.attention_sinks else None
    return qs, ks, vs, sinks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="gpt_oss_20b:8,gpt_oss_20b:64,gemma4:8,gemma4:64")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    from flashinfer_fake import module as fake_flashinfer
    fi = sys.modules["flashinfer"] = fake_flashinfer()
    for w in (fi.BatchDecodeWithPagedKVCacheWrapper, fi.BatchPrefillWithPagedKVCacheWrapper):
        w.plan = lambda self, *args, **kw: None  # FlashInfer's own plan: raw pays it too
        w.run = _stub_run  # FlashInfer's run: the layer loop times only what is around it
    fi.decode.fast_decode_plan = lambda *args, **kw: None  # its fast plan, as raw's plan
    import common
    import importlib

    from swafactory.metadata import keys_triton

    plan_mod = importlib.import_module("swafactory.metadata.plan")  # the package shadows it

    keys_triton._kernel = lambda interpret: _StubLaunch()  # noqa: ARG005
    from swafactory.kernels import flashinfer as fi_adapter
    fi_adapter.sink_output = lambda o, lse, sinks, **kw: o  # on a GPU: one Triton launch
    real = plan_mod._plan_vector
    plan_mod._plan_vector = lambda *args, **kw: real(*args[:5], "triton", *args[6:], **kw)
    rows = []
    for case in a.cases.split(","):
        model, bs = case.split(":")
        cfg, alloc, slots, backend = world(model, int(bs), a.ctx)
        batch = common.batch_of("decode", slots, alloc, int(bs), a.ctx)
        for _ in range(20):
            backend.init_forward_metadata(batch)
        ts = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            backend.init_forward_metadata(batch)
            ts.append((time.perf_counter() - t0) * 1e3)
        qs, ks, vs, sinks = inputs(cfg, backend, batch.total_q)

        def layers():
            for layer in range(cfg.model.num_layers):
                backend.forward(qs[layer], ks[layer], vs[layer], layer, sinks=sinks)
        layers()
        tl = []
        for _ in range(max(20, a.reps // 4)):
            t0 = time.perf_counter()
            layers()
            tl.append((time.perf_counter() - t0) * 1e3)
        ts.sort()
        tl.sort()
        rows.append(dict(case=case, planning_ms=statistics.median(ts),
                         p10_ms=ts[len(ts) // 10], min_ms=ts[0],
                         layer_us=statistics.median(tl) / cfg.model.num_layers * 1e3,
                         layer_p10_us=tl[len(tl) // 10] / cfg.model.num_layers * 1e3))
        print(json.dumps(rows[-1]), flush=True)
        if a.profile:
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(a.reps):
                backend.init_forward_metadata(batch)
            pr.disable()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats(__import__("os").environ.get("SORT","tottime")).print_stats(30)
            print(s.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
