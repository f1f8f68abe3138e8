"""Build a conformance run's parts from a validated config: pool sizes, then the serving core's
pools, slot books and backends (`serving.build_serving`) in `serving.Parts`, with a `Worker` per
runner (seeded Q/K/V, its layers' oracle specs, the logical histories it records).

The pools give rows to the layers the run attends only (`workload.layers=subset`: two per layer
group): every pool and index space is still driven, at the memory of a few layers, and
`pool_memory` says how much before anything is allocated."""
from __future__ import annotations

import random
from dataclasses import dataclass, replace

import torch

from swafactory.backend import model_windows
from swafactory.config.schema import KV_DTYPE_BYTES, SwaFactoryConfig
from swafactory.errors import CapacityError
from swafactory.fault_counts import FAULT_COUNTS
from swafactory.harness.kv_quant import set_harness_scales
from swafactory.harness.workers import LayerSpec, Worker
from swafactory.harness.world import target_layer_specs
from swafactory.kvcache.draft import draft_layer_types
from swafactory.kvcache.factory import compute_dtype
from swafactory.kvcache.pool import layers_mapping_for
from swafactory.kvcache.shares import PoolSizes, size_pools
from swafactory.kvcache.sizing import step_nodes
from swafactory.resolve.layout import frozen_draft_binding
from swafactory.metadata.plan import group_key
from swafactory.parallel import Shard, shard_config
from swafactory.serving.parts import Parts, build_serving
from swafactory.window import narrowed

__all__ = ["draws", "pool_sizes", "attended_layers", "PoolMemory", "pool_memory", "build_parts"]


def draws(cfg: SwaFactoryConfig) -> tuple[random.Random, list[int], list[int]]:
    """The run's seeded prompt and output lengths, and the rng the loop goes on with."""
    w, W = cfg.workload, cfg.model.sliding_window or 0
    rng = random.Random(w.seed)
    prompts = [W + rng.randint(*w.prompt_over_window) for _ in range(w.num_requests)]
    outs = [rng.randint(*w.output_len) for _ in range(w.num_requests)]
    return rng, prompts, outs


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


def attended_layers(cfg: SwaFactoryConfig) -> list[int]:
    """The target layers the run attends: all, or with `workload.layers=subset` the last two of
    each layer group (every geometry present) and the layers a FROZEN_KV draft reads."""
    if cfg.workload.layers == "all":
        return list(range(cfg.model.num_layers))
    extra = frozen_draft_binding(cfg) if cfg.spec.draft_kv == "target_pool" else ()
    windows = model_windows(cfg)
    groups: dict[str, list[int]] = {}
    for layer, (sub, _) in sorted(layers_mapping_for(cfg.model).items()):
        groups.setdefault(group_key(sub, windows[layer]), []).append(layer)
    return sorted({*(i for ids in groups.values() for i in ids[-2:]), *extra})


@dataclass(frozen=True)
class PoolMemory:
    """What a run's pools take, known before they are allocated (`pool_memory`)."""

    sizes: PoolSizes
    held_bytes: int
    """K + V bytes of the rows the run allocates: target, draft and a FROZEN_KV dummy pool."""
    every_layer_bytes: int
    """The same pools with rows for every layer (what an engine holds at these sizes)."""
    layers_held: int
    num_layers: int
    draft_slots: int
    """Slots of an own draft pool (0: none)."""

    def line(self) -> str:
        """The console's one line, printed before the pools are allocated."""
        s = self.sizes
        slots = ", ".join(f"{k} {v:,}" for k, v in (("full", s.full), ("swa", s.swa),
                                                    ("draft", self.draft_slots)) if v)
        rows = "" if self.layers_held == self.num_layers else (
            f" (K/V of the {self.layers_held} attended layers of {self.num_layers}; all "
            f"{self.num_layers}: {_gib(self.every_layer_bytes)})")
        return f"pools will take {_gib(self.held_bytes)}{rows}: {slots} slots"


def _gib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def pool_memory(cfg: SwaFactoryConfig) -> PoolMemory:
    """The bytes `build_parts` will allocate for a validated ``cfg``, computed, not allocated
    (all ranks together under tensor parallelism). Raises as `pool_sizes` does."""
    _, prompts, outs = draws(cfg)
    sizes = pool_sizes(cfg, prompts, outs)
    tp = cfg.parallel.tp
    m = (cfg if tp == 1 else shard_config(cfg, Shard(0, tp))).model  # one rank's heads
    s, P = cfg.spec, cfg.backend.page_size
    h = 0.5 if cfg.faults.no_draft_headroom else 1.0  # `build_parts`' headroom
    cap = lambda n: max(P, int(n * h) // P * P)  # noqa: E731 (`kvcache.draft`'s sizes)
    elt, held = KV_DTYPE_BYTES[cfg.backend.kv_dtype], set(attended_layers(cfg))
    split = bool(m.swa_layers and m.hybrid_pool)
    row = lambda geo: 2 * geo.num_kv_heads * geo.head_dim * elt  # noqa: E731
    every = mine = 0
    for i, (sub, _) in layers_mapping_for(m).items():
        geo = (m.swa if sub == "swa" else m.full) if split else (m.full or m.swa)
        n = row(geo) * ((sizes.swa if sub == "swa" else sizes.full) + P)
        every, mine = every + n, mine + n * (i in held)
    draft, dslots = 0, 0
    if s.draft_kv == "target_pool":  # the dummy pool a FROZEN_KV runner holds between swaps
        draft = len(frozen_draft_binding(cfg)) * row(m.full or m.swa) * (sizes.full + P)
    elif s.draft_kv == "own_pool":
        types = draft_layer_types(cfg)  # a window-retained draft: its SWA sub-pool alone
        dslots = cap(sizes.full) if not split or "full_attention" in types else cap(sizes.swa)
        for t in types:  # a split draft's sliding layers: the SWA sub-pool's
            swa = split and t == "sliding_attention"
            draft += row(m.swa if swa else m.full or m.swa) * (
                (cap(sizes.swa) if swa else dslots) + P)
    return PoolMemory(sizes, tp * (mine + draft), tp * (every + draft), len(held), m.num_layers,
                      dslots)


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
    layers = attended_layers(cfg)
    sv = build_serving(scfg, sizes, device, check_mode=True, draft_layout="config", gen=gen,
                       headroom=headroom, unsafe_undersized=f.no_draft_headroom,
                       on_pool=set_harness_scales,  # fp8 KV: per-layer scales, as a checkpoint
                       layers=None if len(layers) == m.num_layers else layers)
    kv = cfg.backend.kv_dtype
    q_dtype = compute_dtype(kv)
    sinks = {i: (torch.randn(m.num_attention_heads, generator=gen) * 2)
             for i in range(m.num_layers)} if m.attention_sinks else {}
    binding = frozen_draft_binding(cfg) if s.draft_kv == "target_pool" else ()
    specs = target_layer_specs(cfg)
    hist_t: dict = {}  # each request's logical history, beside the pools (the oracle's input)
    target = Worker("target", sv.target, {i: specs[i] for i in layers}, hist_t, writes=True,
                    q_dtype=q_dtype, device=device, gen=gen, sinks=sinks, shard=shard)
    parts = Parts.of(cfg, sizes, sv, target)
    if s.draft_kv == "own_pool":
        dpool = sv.draft_pool
        if f.no_draft_headroom and _short(dpool, sizes):
            FAULT_COUNTS.acted("no_draft_headroom")  # built short of the target's full space
        types = ["full_attention"] * s.draft_num_layers
        if dpool.is_split:  # split like the target's last layers, or all sliding (retention)
            types = (["sliding_attention"] * s.draft_num_layers
                     if s.draft_kv_retention == "window"
                     else list(m.layer_types[-s.draft_num_layers:]))
        # the oracle's windows, stated from the pool built and the spec's draft window; the
        # backend derives its own (swafactory.backend.runner_windows): the harness takes the
        # embedder's default path
        windows = {j: narrowed(m.sliding_window if t == "sliding_attention" else None,
                               s.draft_window) for j, t in enumerate(types)}
        dspecs = {}
        for j, t in enumerate(types):  # whole-model geometry: the oracle sees every head
            geo = (m.swa if t == "sliding_attention" else m.full) if dpool.is_split else (m.full or m.swa)
            dspecs[j] = LayerSpec(windows[j], m.num_attention_heads, geo.num_kv_heads, geo.head_dim,
                                  m.softmax_scale or geo.head_dim ** -0.5, m.logit_softcap, j,
                                  s.draft_sink if windows[j] is not None else 0)
        parts.draft = Worker("draft", sv.draft, dspecs, {}, writes=True,
                             q_dtype=q_dtype, device=device, gen=gen, sinks={}, shard=shard)
    elif s.draft_kv == "target_pool":
        # the FROZEN_KV runner's own pool is a dummy non-split pool; the engine swaps the target's
        # view in for each draft forward (sglang), which is what a cached resolver gets wrong
        dspecs = {j: replace(specs[t], window=narrowed(specs[t].window, s.draft_window),
                             sink=s.draft_sink) for j, t in enumerate(binding)}
        parts.draft = Worker("draft", sv.draft, dspecs, hist_t, writes=False,
                             q_dtype=q_dtype, device=device, gen=gen,
                             sinks={j: sinks[t] for j, t in enumerate(binding) if t in sinks},
                             shard=shard)
    if parts.draft_pool is not None and _short(parts.draft_pool, sizes) and \
            not f.no_draft_headroom:
        raise CapacityError("the draft pool is smaller than the target's full space")
    return parts


def _short(dpool, sizes: PoolSizes) -> bool:
    """A draft sub-pool smaller than the target's index space it is addressed in."""
    return any(p.size < (sizes.swa if p.space == "swa" else sizes.full) for p in dpool.sub_pools)
