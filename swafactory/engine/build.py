"""Build a generator's parts: the serving config, then the serving core (`swafactory.serving`:
pools, slot books, draft pool and view, backends, the FROZEN_KV swap) wrapped in HF runners.

Drafts, per family (what each one is, and the pool it owns or reads):

* eagle, eagle3, nextn, standalone: a copy of the target's weights (self-speculation: a correct
  system accepts every drafted token on the greedy path). Its own pool holds all its layers with
  the target's windows and geometry: split, sharing the target's full→SWA mapping, when the
  target's pool is split; one full-space pool otherwise. Addressed by the target's full slots.
* frozen_kv_mtp: every target layer, read through the target's frozen view (the draft writes no
  K/V); step k queries position L + k over the target's keys 0 … L - 1, as an MTP head does.
  Its weights are the target's (its k/v projections go unused).
* dflash: ``spec.draft_num_layers`` layers of the target's architecture, full attention, in its
  own non-split pool (`kvcache.build_draft_pool`; with ``spec.draft_pool_split`` the target's
  last layer types in a split pool), weights copied from target layers of the same geometry.
  It drafts a block: the root, then mask tokens (id 0), which see each other.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from swafactory.config.schema import SwaFactoryConfig
from swafactory.engine.models import draft_copy, draft_from_layers, load_target, serving_model
from swafactory.engine.runner import Runner
from swafactory.kvcache.factory import compute_dtype
from swafactory.kvcache.requests import RequestSlots
from swafactory.kvcache.shares import size_pools
from swafactory.kvcache.sizing import step_nodes
from swafactory.layout import frozen_draft_binding
from swafactory.registry.device import DeviceInfo
from swafactory.registry.select import validate
from swafactory.serving import build_serving

__all__ = ["Parts", "build", "serving_config", "model_dtype", "OWN_COPY"]

OWN_COPY = ("eagle", "eagle3", "nextn", "standalone")
"""Families whose draft is a copy of the target's weights with its own pool."""


@dataclass
class Parts:
    """What the generator drives."""

    cfg: SwaFactoryConfig
    """The serving config: the model spec read from the HF model, the draft's layer count."""
    target: Runner
    draft: Runner | None
    pool: object
    alloc: object
    draft_pool: object | None
    slots: RequestSlots
    hf_config: dict
    draft_desc: str


def model_dtype(cfg: SwaFactoryConfig) -> torch.dtype:
    """The model's compute dtype: the KV dtype (bf16 for fp8 KV)."""
    return compute_dtype(cfg.backend.kv_dtype)


def serving_config(cfg: SwaFactoryConfig, model, device: DeviceInfo) -> SwaFactoryConfig:
    """``cfg`` with the model spec the HF model really has and, for drafts that mirror every
    target layer (own-pool copies, FROZEN_KV), ``spec.draft_num_layers`` = the layer count;
    validated again by the registry for ``device``."""
    spec = serving_model(model, cfg.model)
    data = cfg.model_dump()
    data["model"] = spec.model_dump()
    if cfg.spec.algorithm in OWN_COPY or cfg.spec.algorithm == "frozen_kv_mtp":
        data["spec"]["draft_num_layers"] = spec.num_layers
    return validate(SwaFactoryConfig.model_validate(data), device)


def build(cfg: SwaFactoryConfig, device: DeviceInfo, prompts: list[int], outs: list[int],
          *, model=None) -> Parts:
    """Everything for one generation run of ``cfg`` (validated). ``model``: reuse an already
    loaded target (the reference runs share its weights)."""
    dev = "cuda" if device.kind == "cuda" else "cpu"
    guards = cfg.run.guards
    graphs = cfg.backend.cuda_graph  # every forward but a prefill replays a captured model call
    if model is None:
        model, _ = load_target(cfg, model_dtype(cfg), dev)
    scfg = serving_config(cfg, model, device)
    m, s, P = scfg.model, scfg.spec, scfg.backend.page_size
    longest = max(p + o for p, o in zip(prompts, outs)) + step_nodes(s) + P
    chunk = min(scfg.workload.chunk_size, max(prompts))
    sizes = size_pools(scfg, scfg.workload.max_running_requests, longest, chunk=chunk)
    layout = "copy" if s.algorithm in OWN_COPY else "config"
    sv = build_serving(scfg, sizes.full, sizes.swa, sizes.max_requests, sizes.full_per_request,
                       dev, check_mode=guards, guards=guards, draft_layout=layout,
                       gen=torch.Generator().manual_seed(scfg.workload.seed))
    pool, alloc = sv.pool, sv.alloc
    target = Runner("target", model, sv.target, guards=guards, graphs=graphs,
                    max_context=longest)
    parts = Parts(scfg, target, None, pool, alloc, sv.draft_pool, sv.slots,
                  model.config.to_dict(), "-")
    if s.algorithm == "none":
        return parts
    n, types = m.num_layers, list(m.layer_types)
    if s.algorithm in OWN_COPY:
        parts.draft = Runner("draft", draft_copy(model), sv.draft, guards=guards, graphs=graphs,
                             max_context=longest)
        parts.draft_desc = (f"a copy of the target's {n} layers, own "
                            f"{'split ' if sv.draft_pool.is_split else ''}pool")
    elif s.algorithm == "frozen_kv_mtp":
        parts.draft = Runner("draft", draft_copy(model), sv.draft, writes=False, swap=sv.swap,
                             guards=guards, graphs=graphs, max_context=longest)
        parts.draft_desc = (f"the target's {len(frozen_draft_binding(scfg))} layers reading its "
                            "frozen K/V (writes none); step k queries position L+k over keys < L")
    else:  # dflash
        dpool = sv.draft_pool
        k = s.draft_num_layers
        dtypes = list(m.layer_types[-k:]) if dpool.is_split else ["full_attention"] * k
        sources = _sources(types, m, dtypes)
        model_d = draft_from_layers(model, sources, dtypes,
                                    m.sliding_window if dpool.is_split else None)
        parts.draft = Runner("draft", model_d, sv.draft, guards=guards, graphs=graphs,
                             max_context=longest)
        parts.draft_desc = (f"{k} {'target-typed' if dpool.is_split else 'full-attention'} "
                            f"layers (weights of target layers {sources}), own "
                            f"{'split ' if dpool.is_split else ''}pool; a block of "
                            f"{s.block_size} that sees itself")
    return parts

def _sources(types: list[str], m, dtypes: list[str]) -> list[int]:
    """For each draft layer type, a target layer with the same KV geometry: the target's last
    layers where they match, else the last target layer of that geometry."""
    n = len(types)
    out = []
    for j, t in enumerate(dtypes):
        mirror = n - len(dtypes) + j
        want = m.swa if t == "sliding_attention" and m.hybrid_pool else (m.full or m.swa)
        ok = [i for i in range(n) if m.geometry(i) == want]
        out.append(mirror if mirror >= 0 and mirror in ok else ok[-1])
    return out
