"""`backend=auto` tuned on this GPU: each candidate's passes timed at the run's geometry, the
fastest kept (`registry.tuning` holds the candidates, the choice and the on-disk cache).

`autotuned(cfg, device)` is what the drivers call before validating: on a CUDA device, with
`backend=auto` and ``backend.autotune`` on, it returns the tuned config and its `Tuning` (the
choices with their times, for `run=plan` and report.json); otherwise the config unchanged and
None, and `validate` keeps the fixed preference order.

`measure_pass` times one pass of one layer of a group: a model cut to the first layers that hold
both groups, ``workload.max_running_requests`` requests (at most 64) of ``workload.context_len``
committed tokens (at most 32K), SWA slots evicted as a serving engine does, random K/V; the plan
is made once, then the layer's ``forward`` is timed with CUDA events, `BACK_TO_BACK` forwards
between the events as a step runs its layers (median of ``reps`` after ``warmup``); with
``backend.cuda_graph`` on, decode and verify are timed as one layer's graph replay, captured
through the backend's graph contract. The step's planning is timed too (wall ms, the device
drained: ``init_forward_metadata``, or a replay's planning), with the other group's pass on our
kernels so that a library's host planning counts where it is chosen. The pools of a pass are
built once per tuning and shared by every candidate (they differ in kernels only). Decode is one
query per request, verify the spec's ``num_draft_tokens`` as a chain, extend a
``workload.chunk_size`` chunk (at most 2048) of up to 4 requests.
"""
from __future__ import annotations

import statistics

from swafactory.config.schema import SwaFactoryConfig, hands_to_ours
from swafactory.registry.tuning import TuneCache, Tuning, tune
from swafactory.registry.device import DeviceInfo

__all__ = ["autotuned", "measure_pass"]


def _cut(cfg: SwaFactoryConfig) -> SwaFactoryConfig:
    """``cfg`` with the model cut to its first layers holding a layer of each group."""
    m = cfg.model
    firsts = [ls[0] for ls in (m.swa_layers, m.full_layers) if ls]
    n = max(firsts) + 1
    data = m.model_dump()
    data.update(num_layers=n, layer_types=list(m.layer_types[:n]), layer_pattern=None)
    return cfg.model_copy(update={"model": type(m).model_validate(data)})


_WORLDS: dict[tuple, tuple] = {}
"""A tuning's pools, one per (pass, geometry), shared by every candidate timed on them (they
differ in kernels, not in pools); emptied when the tuning ends (`autotuned`)."""


def _geometry(cfg: SwaFactoryConfig, pass_: str) -> tuple:
    """What a pass's pools and batch depend on: everything but the kernel choices."""
    b = cfg.backend
    rest = cfg.model_copy(update={"backend": b.model_copy(update={
        "name": "auto", "groups": type(b.groups)(), "kernels": type(b.kernels)()})})
    return pass_, rest.model_dump_json()


def _world(cfg: SwaFactoryConfig, pass_: str, device: str = "cuda") -> tuple:
    """(pool, the batch of ``pass_``) for ``cfg`` (a model already cut): ``bs`` requests of
    ``ctx`` committed tokens plus the pass's nodes, SWA slots evicted as a serving engine does,
    random K/V. Built once per (pass, geometry) in a tuning (`_WORLDS`)."""
    import torch

    from swafactory.kvcache.factory import build_pools
    from swafactory.kvcache.pool import ReqToToken
    from swafactory.kvcache.requests import RequestSlots
    from swafactory.kvcache.shares import size_pools
    from swafactory.metadata import ForwardBatch, ReqForward

    key = _geometry(cfg, pass_)
    got = _WORLDS.get(key)
    if got is not None:
        return got
    m, w = cfg.model, cfg.workload
    bs, ctx = min(64, w.max_running_requests), min(32768, w.context_len)
    nodes = {"decode": 1, "verify": max(2, cfg.spec.num_draft_tokens),
             "extend": min(2048, w.chunk_size)}[pass_]
    if pass_ == "extend":
        bs = min(bs, 4)
    sizes = size_pools(cfg, bs, ctx + nodes, chunk=max(64, nodes))
    pool, alloc = build_pools(cfg, sizes.full, sizes.swa, device)
    slots = RequestSlots(alloc, ReqToToken(sizes.max_requests, sizes.full_per_request, device))
    split = bool(m.swa_layers and m.hybrid_pool)
    for rid in range(bs):
        slots.open(rid)
        done = 0
        while done < ctx + nodes:
            n = min(max(64, nodes), ctx + nodes - done)
            slots.extend(rid, n)
            done += n
            if split:
                slots.evict_out_of_window(rid, min(done, ctx), m.sliding_window, 1)
    for sub in pool.sub_pools:
        for buf in (*sub.k_bufs, *sub.v_bufs):
            if buf.dtype.itemsize == 1:  # fp8: no normal_ kernel; drawn in bf16, cast in place
                buf.copy_(torch.randn(buf.shape, device=device, dtype=torch.bfloat16))
            else:
                buf.normal_()
    mode = {"decode": "decode", "verify": "target_verify", "extend": "extend"}[pass_]
    reqs = [ReqForward(r, slots.reqs[r].row, ctx, nodes) for r in range(bs)]
    batch = ForwardBatch.of(mode, reqs, slots.req_to_token.table, alloc.full_id)
    got = _WORLDS[key] = (pool, batch, (slots, alloc))  # the books keep the batch's rows
    return got


def _quiet(cfg: SwaFactoryConfig, group: str, pass_: str) -> SwaFactoryConfig:
    """``cfg`` with the other group's ``pass_`` handed to our kernels where a library family
    would plan it on the host: the planning timed is then this group's candidate's, plus what
    every candidate shares (the planner's tables)."""
    other = "full" if group == "swa" else "swa"
    b = cfg.backend
    if not hands_to_ours(b.kernel_for(other == "swa"), pass_, "triton"):
        return cfg
    kc = getattr(b.kernels, other).model_copy(update={pass_: "triton"})
    return cfg.model_copy(update={"backend": b.model_copy(update={
        "kernels": b.kernels.model_copy(update={other: kc})})})


def _plan_ms(plan, reps: int = 10) -> float:
    """Median wall ms of ``plan()`` (a step's planning), the device drained before and after."""
    import time

    import torch

    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        plan()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure_pass(cfg: SwaFactoryConfig, group: str, pass_: str, *, reps: int = 20,
                 warmup: int = 3) -> tuple[float, float] | None:
    """(median device ms of one ``pass_`` forward of one ``group`` layer, median wall ms of the
    step's planning) under ``cfg`` (a candidate: its family and kernel choices set) on the
    current CUDA device; None when the candidate fails to build or run there (it is then no
    candidate). The planning is timed with the other group's pass on our kernels (`_quiet`)."""
    import torch

    from swafactory.backend.build import build_backend
    from swafactory.errors import ConfigError
    from swafactory.kvcache.factory import compute_dtype

    cfg = _cut(cfg)
    m = cfg.model
    layer = (m.swa_layers if group == "swa" else m.full_layers)[0]
    try:
        pool, batch, _ = _world(cfg, pass_)
        try:
            backend = build_backend(_quiet(cfg, group, pass_), pools=pool, guards=False)
        except ConfigError:  # the other group cannot run on ours: planned as it is
            backend = build_backend(cfg, pools=pool, guards=False)
        sub = pool.sub_pool(layer)
        dt = compute_dtype(cfg.backend.kv_dtype)
        n = batch.total_q
        q = torch.randn(n, m.num_attention_heads, sub.head_dim, device="cuda", dtype=dt)
        k = torch.randn(n, sub.num_kv_heads, sub.head_dim, device="cuda", dtype=dt)
        sinks = (torch.zeros(m.num_attention_heads, device="cuda")
                 if m.attention_sinks else None)
        graphed = cfg.backend.cuda_graph and pass_ in GRAPHED
        run, plan = _replay(backend, batch, lambda: backend.forward(q, k, k, layer, sinks=sinks),
                            q.device) if graphed else (None, None)
        if run is None:  # eager: planned once, the layer's forward timed
            plan = lambda: backend.init_forward_metadata(batch)  # noqa: E731
            plan()
            run = lambda: backend.forward(q, k, k, layer, sinks=sinks)  # noqa: E731
        for _ in range(warmup):
            run()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(BACK_TO_BACK):
                run()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / BACK_TO_BACK)
        return statistics.median(times), _plan_ms(plan)
    except (RuntimeError, ValueError):  # a kernel that cannot run here: no candidate
        return None


BACK_TO_BACK = 8
"""Forwards of the layer between a timing's two events: a step runs its layers back to back,
the host launching one while the device runs the one before, so a layer costs what it costs
in such a run, not one forward's latency from an idle device. Timed one at a time (H100,
`eb4b6c6`), GPT-OSS-20b's tree verify at bs 64 summed to 10.2 ms over its 24 layers against a
5.94 ms step, and auto took a library path whose step ran 1.75× the best fixed backend's."""

GRAPHED = ("decode", "verify")
"""Passes an engine replays from CUDA graphs when ``backend.cuda_graph`` is on (prefill and
extend chunks run eagerly): these are timed as replays, since a library's graph kernels may not
be its eager ones (FlashInfer splits KV in every graph-planned prefill)."""


def _replay(backend, batch, forward, device):
    """``forward`` captured for ``batch``'s bucket as the drivers capture (`graphs.capture_step`,
    after sizing the graph state for the batch) and planned for ``batch``: (a function that
    replays it, one that plans a replay); (None, None) where the candidate cannot be captured
    (it is then timed eagerly, as it would run)."""
    from swafactory.graphs.replay import capture_step

    bs, tokens = batch.batch_size, max(r.q_len for r in batch.reqs)
    try:
        backend.init_cuda_graph_state(bs, tokens, max(r.prefix_len + r.nodes for r in batch.reqs))
        graph, _ = capture_step(backend, bs, tokens, batch.mode, forward, device)
        backend.init_forward_metadata_replay(batch, bs, tokens)
    except (RuntimeError, ValueError):
        return None, None
    return graph.replay, lambda: backend.init_forward_metadata_replay(batch, bs, tokens)


def autotuned(cfg: SwaFactoryConfig, device: DeviceInfo, cache: TuneCache | None = None
              ) -> tuple[SwaFactoryConfig, Tuning | None]:
    """``cfg`` tuned for ``device`` when it asks for `backend=auto` with ``backend.autotune`` on
    a CUDA device (the tuning cached on disk); else ``cfg`` and None."""
    b = cfg.backend
    if b.name != "auto" or not b.autotune or device.kind != "cuda":
        return cfg, None
    try:
        return tune(cfg, device, measure_pass, cache)
    finally:  # the tuning's pools go with it
        _WORLDS.clear()
        import torch

        torch.cuda.empty_cache()
