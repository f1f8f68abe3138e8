"""Build a conformance run's parts from a validated config: pool sizes, then the serving core's
pools, slot books and backends (`serving.build_serving`) in `serving.Parts`, with a `Worker` per
runner (seeded Q/K/V, its layers' oracle specs, the logical histories it records)."""
from __future__ import annotations

import torch

from swafactory.backend import model_windows
from swafactory.config.schema import SwaFactoryConfig
from swafactory.errors import CapacityError
from swafactory.fault_counts import FAULT_COUNTS
from swafactory.harness.kv_quant import set_harness_scales
from swafactory.harness.workers import LayerSpec, Worker
from swafactory.harness.world import target_layer_specs
from swafactory.kvcache.factory import compute_dtype
from swafactory.kvcache.shares import PoolSizes, size_pools
from swafactory.kvcache.sizing import step_nodes
from swafactory.resolve.layout import frozen_draft_binding
from swafactory.metadata.plan import group_key
from swafactory.parallel import Shard, shard_config
from swafactory.serving.parts import Parts, build_serving

__all__ = ["pool_sizes", "build_parts"]


def pool_sizes(cfg: SwaFactoryConfig, prompts: list[int], outs: list[int]) -> PoolSizes:
    """The public `swafactory.kvcache.size_pools`, sized tight so SWA use peaks above 90%: its
    prefill chunk is one step's nodes plus 1/16 of the window (the scheduler clamps chunks to
    the SWA share), and two spare pages widen each request's full share. Raises `ConfigError`
    when ``workload.swa_full_tokens_ratio`` leaves a request less than its SWA need."""
    m, P = cfg.model, cfg.backend.page_size
    T, W = step_nodes(cfg.spec), m.sliding_window or 0
    longest = max(p + o for p, o in zip(prompts, outs))
    return size_pools(cfg, cfg.workload.max_running_requests, longest + 2 * P,
                      chunk=T + (W + T) // 16)


def _subset(cfg: SwaFactoryConfig, pool, extra: tuple[int, ...]) -> list[int]:
    """Two layers per layer group (the last two), every geometry present, plus ``extra``."""
    if cfg.workload.layers == "all":
        return list(range(cfg.model.num_layers))
    windows = model_windows(cfg)
    groups: dict[str, list[int]] = {}
    for layer, (sub, _) in sorted(pool.layers_mapping.items()):
        groups.setdefault(group_key(sub, windows[layer]), []).append(layer)
    return sorted({*(i for ids in groups.values() for i in ids[-2:]), *extra})


def build_parts(cfg: SwaFactoryConfig, prompts: list[int], outs: list[int], device: str,
                gen: torch.Generator, shard: Shard | None = None) -> Parts[Worker]:
    """Pools, allocator, backends and workers for a validated config.

    With a ``shard`` (tensor parallelism) the pools and backends hold this rank's heads only;
    the oracle's layer specs stay those of the whole model.
    """
    m, s, f = cfg.model, cfg.spec, cfg.faults
    scfg = cfg if shard is None else shard_config(cfg, shard)
    sizes = pool_sizes(cfg, prompts, outs)
    headroom = 0.5 if f.no_draft_headroom else 1.0
    sv = build_serving(scfg, sizes, device, check_mode=True, draft_layout="config", gen=gen,
                       headroom=headroom, unsafe_undersized=f.no_draft_headroom,
                       on_pool=set_harness_scales)  # fp8 KV: per-layer scales, as a checkpoint
    pool = sv.pool
    kv = cfg.backend.kv_dtype
    q_dtype = compute_dtype(kv)
    sinks = {i: (torch.randn(m.num_attention_heads, generator=gen) * 2)
             for i in range(m.num_layers)} if m.attention_sinks else {}
    binding = frozen_draft_binding(cfg) if s.draft_kv == "target_pool" else ()
    specs = target_layer_specs(cfg)
    hist_t: dict = {}  # each request's logical history, beside the pools (the oracle's input)
    layers = _subset(cfg, pool, tuple(binding))
    target = Worker("target", sv.target, {i: specs[i] for i in layers}, hist_t, writes=True,
                    q_dtype=q_dtype, device=device, gen=gen, sinks=sinks, shard=shard)
    parts = Parts.of(cfg, sizes, sv, target)
    if s.draft_kv == "own_pool":
        dpool = sv.draft_pool
        if f.no_draft_headroom and dpool.sub_pools[0].size < sizes.full:
            FAULT_COUNTS.acted("no_draft_headroom")  # built short of the target's full space
        types = ["full_attention"] * s.draft_num_layers
        if dpool.is_split:
            types = list(m.layer_types[-s.draft_num_layers:])
        # the oracle's windows, stated from the pool built; the backend derives its own
        # (swafactory.backend.runner_windows): the harness takes the embedder's default path
        windows = {j: (m.sliding_window if t == "sliding_attention" else None)
                   for j, t in enumerate(types)}
        dspecs = {}
        for j, t in enumerate(types):  # whole-model geometry: the oracle sees every head
            geo = (m.swa if t == "sliding_attention" else m.full) if dpool.is_split else (m.full or m.swa)
            dspecs[j] = LayerSpec(windows[j], m.num_attention_heads, geo.num_kv_heads, geo.head_dim,
                                  m.softmax_scale or geo.head_dim ** -0.5, m.logit_softcap, j)
        parts.draft = Worker("draft", sv.draft, dspecs, {}, writes=True,
                             q_dtype=q_dtype, device=device, gen=gen, sinks={}, shard=shard)
    elif s.draft_kv == "target_pool":
        # the FROZEN_KV runner's own pool is a dummy non-split pool; the engine swaps the target's
        # view in for each draft forward (sglang), which is what a cached resolver gets wrong
        dspecs = {j: specs[t] for j, t in enumerate(binding)}
        parts.draft = Worker("draft", sv.draft, dspecs, hist_t, writes=False,
                             q_dtype=q_dtype, device=device, gen=gen,
                             sinks={j: sinks[t] for j, t in enumerate(binding) if t in sinks},
                             shard=shard)
    if parts.draft_pool is not None and parts.draft_pool.sub_pools[0].size < sizes.full and \
            not f.no_draft_headroom:
        raise CapacityError("the draft pool is smaller than the target's full space")
    return parts
