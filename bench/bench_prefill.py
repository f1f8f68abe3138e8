"""Long prefill chunks: the factory against raw FlashInfer causal prefill on the same pools.

For each model (its window, heads and head dims; a few layers: Gemma 4 one ``SSSSSF`` period,
5 sliding + 1 full, GPT-OSS ``SF``), each prefix and each chunk it builds real bf16 pools on the
GPU, opens ``bs`` requests of ``prefix`` committed tokens (SWA slots evicted as they leave the
window, as an engine does), allocates a ``chunk``-token extend and times three things:

* **factory step**: ``backend.forward(q, k, v, layer)`` for every layer after one
  ``init_forward_metadata`` (K/V write + attention: plain chunks run FlashInfer's
  ``causal=True, window_left=W-1`` prefill, no mask);
* **raw step**: one ``BatchPrefillWithPagedKVCacheWrapper`` per layer group, planned with
  ``causal=True, window_left=W-1`` on the factory's own indices (the same pools, the same
  trimmed SWA lists), then per layer the K/V write (``index_put``) and ``wrapper.run``; sinks
  (GPT-OSS) by the same one-kernel LSE epilogue the factory uses;
* **planning**: host wall time of ``init_forward_metadata`` (planner + FlashInfer's plan) and of
  the raw wrappers' ``plan`` calls, each between two device synchronizations.

Steps are CUDA-event medians after warm-up, factory and raw interleaved round by round. Each row
checks the factory's output against raw's (relative error, every group's last layer) and against
an fp32 attention computed from ``req_to_token`` and the pool alone (sampled queries at both ends
of every request's chunk: keys ``p-W+1 … p`` by position, translated to the SWA space through
the allocator's mapping), which shares nothing with the planner. Target: factory tokens/s ≥ 0.95
× raw's.

    python bench/bench_prefill.py --out OUT [--models gemma4,gpt_oss_20b] [--chunks 2048,4096,8192]
        [--prefixes 16384,65536] [--bs 2]

Prints a table and writes OUT/prefill-h200.md, .json and .png (when matplotlib imports).
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from common import LN2, host_ms

LAYERS = {"gemma4": 6, "gpt_oss_20b": 2}
"""Layers benched per model: one period of its layer pattern (every group, few layers)."""
TARGET = 0.95
WORKSPACE_BYTES = 512 * 2**20
"""Raw FlashInfer's float workspace (the factory adapter's size)."""
DEV = "cuda"
"""Where pools and inputs live (a CPU smoke run with a FlashInfer stand-in sets "cpu")."""


def config_of(model: str, layers: int):
    import swafactory

    return swafactory.validate(swafactory.compose(
        [f"model={model}", "backend=flashinfer", "spec=none", "workload=smoke", f"workload.device={DEV}",
         f"model.num_layers={layers}"]))


def input_std(cfg, head_dim: int) -> float:
    """Std of q and k entries that makes the scaled scores about unit variance (Gemma 4 does
    not scale its scores, so raw N(0, 1) inputs would make every softmax a near one-hot)."""
    scale = cfg.model.softmax_scale or head_dim ** -0.5
    return (scale * math.sqrt(head_dim)) ** -0.5


class World:
    """Pools, allocator, slots and the factory backend for one model and prefix: ``bs``
    requests of ``prefix`` committed tokens, room for a chunk of up to ``max_chunk``."""

    def __init__(self, model: str, bs: int, prefix: int, max_chunk: int, seed: int = 0) -> None:
        import swafactory
        from swafactory.kvcache.factory import build_pools
        from swafactory.kvcache.pool import ReqToToken
        from swafactory.kvcache.requests import RequestSlots
        from swafactory.kvcache.shares import size_pools

        self.cfg = cfg = config_of(model, LAYERS.get(model, 2))
        m = cfg.model
        self.W = W = m.sliding_window
        sizes = size_pools(cfg, bs, prefix + max_chunk, chunk=max_chunk)
        self.pool, self.alloc = build_pools(cfg, sizes.full, sizes.swa, DEV)
        self.alloc.shuffle(torch.Generator().manual_seed(seed))
        self.slots = RequestSlots(self.alloc, ReqToToken(sizes.max_requests,
                                                         sizes.full_per_request, DEV))
        split = bool(m.swa_layers and m.hybrid_pool)
        for rid in range(bs):
            self.slots.open(rid)
            done = 0
            while done < prefix:
                n = min(max_chunk, prefix - done)
                self.slots.extend(rid, n)
                done += n
                if split:
                    self.slots.evict_out_of_window(rid, done, W, 1)
        g = torch.Generator(device=DEV).manual_seed(seed)
        for sub in self.pool.sub_pools:
            std = input_std(cfg, sub.head_dim)
            for buf in sub.k_bufs:
                buf.normal_(generator=g).mul_(std)
            for buf in sub.v_bufs:
                buf.normal_(generator=g)
        self.backend = swafactory.build_backend(cfg, pools=self.pool)
        self.bs, self.prefix = bs, prefix
        self.sinks = (torch.randn(m.num_attention_heads, device=DEV, generator=g)
                      if m.attention_sinks else None)

    def batch(self, chunk: int):
        from swafactory.metadata.batch import ForwardBatch, ReqForward

        for rid in range(self.bs):
            self.slots.extend(rid, chunk)
        reqs = [ReqForward(r, self.slots.reqs[r].row, self.prefix, chunk) for r in range(self.bs)]
        return ForwardBatch.of("extend", reqs, self.slots.req_to_token.table, self.alloc.full_id)

    def release(self) -> None:
        for rid in range(self.bs):
            self.slots.truncate(rid, self.prefix)


def step_inputs(world: World, plan, total_q: int, seed: int = 1) -> dict:
    """Per layer group: q [total_q, Hq, D], k and v [total_q, Hkv, D] (bf16), shared by the
    group's layers (attention reads them the same way in every layer)."""
    m = world.cfg.model
    g = torch.Generator(device=DEV).manual_seed(seed)
    out = {}
    for layer, key in sorted(plan.layer_groups.items()):
        if key in out:
            continue
        sub = world.pool.sub_pool(layer)
        std = input_std(world.cfg, sub.head_dim)
        mk = lambda h: torch.randn(total_q, h, sub.head_dim, device=DEV,  # noqa: E731
                                   dtype=torch.bfloat16, generator=g)
        out[key] = (mk(m.num_attention_heads) * std, mk(sub.num_kv_heads) * std,
                    mk(sub.num_kv_heads))
    return out


class Raw:
    """FlashInfer as an engine would call it: one causal prefill wrapper per layer group,
    planned from the factory's tables (host indptrs, int32 indices), page size 1."""

    def __init__(self, world: World, plan) -> None:
        import flashinfer

        self.ws = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=DEV)
        self.world, self.plan, self.groups = world, plan, {}
        for key, gp in plan.groups.items():
            t = gp.tables
            self.groups[key] = dict(
                w=flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.ws, "NHD"),
                window=gp.window, qo=t.qo_host.clone(), kv=t.kv_host.clone(),
                idx=t.kv_indices.tensor.to(torch.int32),
                last=torch.ones(t.qo_host.numel() - 1, dtype=torch.int32),
                write=gp.write_locs.tensor.long())

    def plan_all(self) -> None:
        m = self.world.cfg.model
        for key, g in self.groups.items():
            layer = next(j for j, k in self.plan.layer_groups.items() if k == key)
            sub = self.world.pool.sub_pool(layer)
            g["w"].plan(g["qo"], g["kv"], g["idx"], g["last"], m.num_attention_heads,
                        sub.num_kv_heads, sub.head_dim, 1, causal=True,
                        window_left=-1 if g["window"] is None else g["window"] - 1,
                        q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
                        sm_scale=m.softmax_scale or sub.head_dim ** -0.5,
                        logits_soft_cap=m.logit_softcap)

    def layer(self, layer: int, q, k, v, sinks=None):
        from swafactory.kernels.triton.sinks import sink_epilogue

        g = self.groups[self.plan.layer_groups[layer]]
        k_buf, v_buf, _ = self.world.pool.get_kv(layer)
        k_buf[g["write"]] = k
        v_buf[g["write"]] = v
        cache = (k_buf.unsqueeze(1), v_buf.unsqueeze(1))
        if sinks is None:
            return g["w"].run(q, cache)
        o, lse = g["w"].run(q, cache, return_lse=True)
        return sink_epilogue(o, lse, sinks, lse_scale=LN2)


def oracle_error(world: World, plan, inputs: dict, outs: dict, chunk: int,
                 sample: int = 16) -> float:
    """Largest relative error (max |o - ref| / max |ref|) of the factory's last layer of each
    group against fp32 attention from ``req_to_token`` and the pool alone, on the first and
    last ``sample`` queries of each request's chunk (query at position p: keys at p-W+1 … p)."""
    m = world.cfg.model
    table = world.slots.req_to_token.table
    mapping = world.alloc.mapping.table if world.pool.is_split else None
    idx = torch.tensor([*range(sample), *range(chunk - sample, chunk)], device=DEV)
    worst = 0.0
    for key, gp in plan.groups.items():
        layer = max(j for j, k in plan.layer_groups.items() if k == key)
        sub = world.pool.sub_pool(layer)
        k_buf, v_buf, _ = world.pool.get_kv(layer)
        hkv, d = sub.num_kv_heads, sub.head_dim
        g = m.num_attention_heads // hkv
        scale = m.softmax_scale or d ** -0.5
        for b in range(world.bs):
            row = world.slots.reqs[b].row
            pos = world.prefix + idx  # [S] positions of the sampled queries
            lo = 0 if gp.window is None else max(0, world.prefix - gp.window + 1)
            kpos = torch.arange(lo, world.prefix + chunk, device=DEV)
            slots = table[row, lo:world.prefix + chunk].long()
            if gp.sub_pool == "swa":  # the allocator's full -> SWA mapping, not the planner's
                slots = mapping[slots].long()
            kk, vv = k_buf[slots].float(), v_buf[slots].float()  # [n, Hkv, D]
            qq = inputs[key][0][b * chunk + idx].float().view(-1, hkv, g, d)
            s = torch.einsum("skgd,nkd->skgn", qq, kk) * scale
            if m.logit_softcap:
                s = m.logit_softcap * torch.tanh(s / m.logit_softcap)
            seen = kpos[None, :] <= pos[:, None]
            if gp.window is not None:
                seen &= pos[:, None] - kpos[None, :] < gp.window
            s = s.masked_fill(~seen[:, None, None, :], -math.inf)
            full = s
            if world.sinks is not None:
                sk = world.sinks.float().view(hkv, g)[None, :, :, None].expand(s.shape[0], -1,
                                                                             -1, 1)
                full = torch.cat([s, sk], -1)
            lse = torch.logsumexp(full, -1, keepdim=True)
            ref = torch.einsum("skgn,nkd->skgd", torch.exp(s - lse), vv).reshape(len(idx), -1, d)
            got = outs[key][b * chunk + idx].float()
            worst = max(worst, float((got - ref).abs().max() / ref.abs().max()))
    return worst


def events_ms(fn, reps: int) -> list[float]:
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return ts


def one_row(world: World, chunk: int, rounds: int) -> dict:
    batch = world.batch(chunk)
    backend = world.backend
    plan = backend.init_forward_metadata(batch)
    layers = sorted(plan.layer_groups)
    total_q = batch.total_q
    inputs = step_inputs(world, plan, total_q)
    sinks = world.sinks
    raw = Raw(world, plan)
    raw.plan_all()
    last = {key: max(j for j, k in plan.layer_groups.items() if k == key) for key in inputs}

    def factory_step() -> dict:
        outs = {}
        for layer in layers:
            key = plan.layer_groups[layer]
            o = backend.forward(*inputs[key], layer, sinks=sinks)
            if layer == last[key]:
                outs[key] = o
        return outs

    def raw_step() -> dict:
        outs = {}
        for layer in layers:
            key = plan.layer_groups[layer]
            o = raw.layer(layer, *inputs[key], sinks)
            if layer == last[key]:
                outs[key] = o
        return outs

    fo, ro = factory_step(), raw_step()  # warm-up (JIT on the first row) and the outputs
    rel = max(float((fo[k].float() - ro[k].float()).norm() / ro[k].float().norm()) for k in fo)
    ref_err = oracle_error(world, plan, inputs, fo, chunk)
    del ro
    est = statistics.median(events_ms(factory_step, 2))
    reps = max(3, min(20, int(600 / max(est, 1e-3))))
    f_ms, r_ms = [], []
    for _ in range(rounds):  # interleaved: drift falls on both alike
        f_ms += events_ms(factory_step, reps)
        r_ms += events_ms(raw_step, reps)
    t_f, t_r = statistics.median(f_ms), statistics.median(r_ms)
    plan_f = host_ms(lambda: backend.init_forward_metadata(batch), 10)
    plan_r = host_ms(raw.plan_all, 10)
    tokens = batch.total_q
    keys = {k: g.tables.kv_indices.tensor.numel() for k, g in plan.groups.items()}
    del raw, inputs, fo
    world.release()
    if DEV == "cuda":
        torch.cuda.empty_cache()
    m = world.cfg.model
    return dict(model=m.name, prefix=world.prefix, chunk=chunk, bs=world.bs, layers=len(layers),
                window=world.W, keys=keys, factory_ms=t_f, raw_ms=t_r,
                factory_tok_s=tokens / (t_f * 1e-3), raw_tok_s=tokens / (t_r * 1e-3),
                speed=t_r / t_f, plan_factory_ms=plan_f, plan_raw_ms=plan_r,
                rel_err_vs_raw=rel, rel_err_vs_fp32=ref_err, reps=reps * rounds,
                ok=t_r / t_f >= TARGET and rel < 1e-2 and ref_err < 3e-2)


def render(rows: list[dict], meta: dict) -> str:
    head = ("| model | prefix | chunk | bs | factory ms | raw ms | factory tok/s | raw tok/s | "
            "factory/raw tok/s | plan factory ms | plan raw ms | rel err vs raw | "
            "rel err vs fp32 | ok |")
    lines = [f"Prefill chunks on {meta['gpu']} (torch {meta['torch']}, flashinfer "
             f"{meta['flashinfer']}), bf16, page size 1; layers per model: "
             f"{', '.join(f'{k} {v}' for k, v in LAYERS.items())}; step = every layer's K/V "
             "write + attention, CUDA-event median; target factory/raw tok/s ≥ "
             f"{TARGET}.", "", head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['prefix']} | {r['chunk']} | {r['bs']} | {r['factory_ms']:.2f} | "
            f"{r['raw_ms']:.2f} | {r['factory_tok_s']:.0f} | {r['raw_tok_s']:.0f} | "
            f"{r['speed']:.3f} | {r['plan_factory_ms']:.2f} | {r['plan_raw_ms']:.2f} | "
            f"{r['rel_err_vs_raw']:.1e} | {r['rel_err_vs_fp32']:.1e} | "
            f"{'yes' if r['ok'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
    kib = lambda n: f"{n // 1024}K" if n % 1024 == 0 else str(n)  # noqa: E731
    for model, prefix in sorted({(r["model"], r["prefix"]) for r in rows}):
        rs = sorted((r for r in rows if (r["model"], r["prefix"]) == (model, prefix)),
                    key=lambda r: r["chunk"])
        x = [r["chunk"] for r in rs]
        line, = a.plot(x, [r["factory_tok_s"] for r in rs], marker="o",
                       label=f"{model} prefix {kib(prefix)} factory")
        a.plot(x, [r["raw_tok_s"] for r in rs], marker="x", ls="--", color=line.get_color(),
               label=f"{model} prefix {kib(prefix)} raw")
        b.plot(x, [r["speed"] for r in rs], marker="o", color=line.get_color(),
               label=f"{model} prefix {kib(prefix)}")
    b.axhline(TARGET, color="grey", ls=":")
    for ax, yl in ((a, "tokens/s (step)"), (b, "factory / raw tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("chunk tokens per request")
        ax.set_ylabel(yl)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="See the module docstring for what each column means.")
    ap.add_argument("--out", required=True, help="folder for prefill-h200.{md,json,png}")
    ap.add_argument("--models", default="gemma4,gpt_oss_20b")
    ap.add_argument("--chunks", default="2048,4096,8192")
    ap.add_argument("--prefixes", default="16384,65536")
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved factory/raw rounds")
    a = ap.parse_args()
    if DEV == "cuda" and not torch.cuda.is_available():
        print("bench_prefill.py needs a CUDA device", file=sys.stderr)
        return 2
    import flashinfer

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    chunks = [int(c) for c in a.chunks.split(",")]
    meta = dict(gpu=torch.cuda.get_device_name() if DEV == "cuda" else DEV, torch=torch.__version__,
                flashinfer=getattr(flashinfer, "__version__", "?"), host=platform.node(),
                bs=a.bs, rounds=a.rounds, started=time.strftime("%Y-%m-%d %H:%M:%S"))
    rows: list[dict] = []
    t0 = time.perf_counter()
    for model in a.models.split(","):
        for prefix in (int(p) for p in a.prefixes.split(",")):
            world = World(model, a.bs, prefix, max(chunks))
            for chunk in chunks:
                rows.append(one_row(world, chunk, a.rounds))
                r = rows[-1]
                print(f"{model} prefix {prefix} chunk {chunk}: factory {r['factory_ms']:.2f} ms, "
                      f"raw {r['raw_ms']:.2f} ms ({r['speed']:.3f}), plan {r['plan_factory_ms']:.2f}"
                      f" / {r['plan_raw_ms']:.2f} ms, err {r['rel_err_vs_raw']:.1e} / "
                      f"{r['rel_err_vs_fp32']:.1e} [{time.perf_counter() - t0:.0f} s]", flush=True)
                (out / "prefill-h200.json").write_text(json.dumps(dict(meta=meta, rows=rows),
                                                                  indent=1))
            del world
            if DEV == "cuda":
                torch.cuda.empty_cache()
    meta["seconds"] = time.perf_counter() - t0
    (out / "prefill-h200.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    text = render(rows, meta)
    (out / "prefill-h200.md").write_text(text)
    plot(rows, out / "prefill-h200.png")
    print(text)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
