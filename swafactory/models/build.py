"""Build a generator's parts: the serving config, then the serving core (`swafactory.serving.parts`:
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

from types import SimpleNamespace

import torch

from swafactory.config.schema import SwaFactoryConfig
from swafactory.config.specs import DRAFT_WEIGHTS
from swafactory.drafts.distill import (MASK_TOKEN, check_draft, distill, load_draft, make_draft,
                                       weights_key)
from swafactory.drafts.distill_features import distill_features
from swafactory.drafts.drafters import (FEATURE_FAMILIES, EagleDraft, Eagle3Draft,
                                        is_feature_draft, make_feature_draft)
from swafactory.drafts.dflash import DFlashDraft, make_dflash_draft
from swafactory.drafts.formats import load_feature_draft
from swafactory.errors import ConfigError, Reason
from swafactory.models.hf import (config_key, draft_copy, draft_from_layers,
                                      last_full_layer, load_target, serving_model)
from swafactory.models.transformers import window_draft
from swafactory.engine.runner import Runner
from swafactory.kvcache.draft import draft_layer_types
from swafactory.kvcache.factory import compute_dtype
from swafactory.kvcache.shares import size_pools
from swafactory.kvcache.sizing import step_nodes
from swafactory.resolve.layout import frozen_draft_binding
from swafactory.registry.device import DeviceInfo
from swafactory.registry.select import validate
from swafactory.serving.parts import Parts, build_serving

__all__ = ["Parts", "build", "serving_config", "model_dtype", "OWN_COPY", "copies"]

OWN_COPY = ("eagle", "eagle3", "nextn", "standalone")
"""Families whose draft is a copy of the target's weights with its own pool."""


def model_dtype(cfg: SwaFactoryConfig) -> torch.dtype:
    """The model's compute dtype: the KV dtype (bf16 for fp8 KV)."""
    return compute_dtype(cfg.backend.kv_dtype)


def serving_config(cfg: SwaFactoryConfig, model, device: DeviceInfo,
                   draft=None) -> SwaFactoryConfig:
    """``cfg`` with the model spec the HF model really has and ``spec.draft_num_layers`` = the
    layer count of a draft that mirrors every target layer (own-pool copies, FROZEN_KV) or of a
    loaded ``draft``; validated again by the registry for ``device``."""
    spec = serving_model(model, cfg.model)
    data = cfg.model_dump()
    data["model"] = spec.model_dump()
    if draft is not None:
        data["spec"]["draft_num_layers"] = len(draft.model.layers)
    elif copies(cfg.spec) or cfg.spec.algorithm == "frozen_kv_mtp":
        data["spec"]["draft_num_layers"] = spec.num_layers
    return validate(SwaFactoryConfig.model_validate(data), device)


def copies(spec) -> bool:
    """True when the draft is a copy of every target layer in an own pool (the ``copy`` layout)."""
    return spec.algorithm in OWN_COPY and spec.draft_weights == "target"


def build(cfg: SwaFactoryConfig, device: DeviceInfo, prompts: list[int], outs: list[int],
          *, model=None, progress=None) -> Parts[Runner]:
    """Everything for one generation run of ``cfg`` (validated). ``model``: reuse an already
    loaded target (the reference runs share its weights). ``progress``: where a distillation's
    progress lines go."""
    dev = "cuda" if device.kind == "cuda" else "cpu"
    guards = cfg.run.guards
    graphs = cfg.backend.cuda_graph  # every forward but a prefill replays a captured model call
    if model is None:
        model, _, _ = load_target(cfg, model_dtype(cfg), dev)
    w = cfg.spec.draft_weights
    loaded = None
    if w not in DRAFT_WEIGHTS:  # a saved draft: one of sglang's feature formats, or an HF model
        loaded = load_feature_draft(w, model, dev, _expect(cfg, model)) or load_draft(w, dev)
    scfg = serving_config(cfg, model, device, loaded)
    m, s, P = scfg.model, scfg.spec, scfg.backend.page_size
    longest = max(p + o for p, o in zip(prompts, outs)) + step_nodes(s) + P
    chunk = min(scfg.workload.chunk_size, max(prompts))
    sizes = size_pools(scfg, scfg.workload.max_running_requests, longest, chunk=chunk)
    if loaded is not None and not is_feature_draft(loaded):  # refused before allocation
        check_draft(loaded, model, draft_layer_types(scfg), m.full or m.swa, w)
    feature = FEATURE_FAMILIES.get(s.algorithm) if (
        s.draft_weights != "target" and (loaded is None or is_feature_draft(loaded))) else None
    if loaded is not None and is_feature_draft(loaded) and feature != _kind(loaded):
        raise ConfigError([Reason("spec", "spec.draft_weights", f"{w} holds an "
                                  f"{_kind(loaded)} draft; spec={s.algorithm} runs "
                                  f"{feature or 'a draft model of the target architecture'}",
                                  f"spec={_FAMILY_OF[_kind(loaded)]}", rule="draft weights")])
    layout = "copy" if copies(s) else "config"
    # EAGLE heads are Llama layers, DFlash's Qwen3 ones: the draft's backend serves their scale
    dmodel = _llama_spec(scfg.model) if feature in ("eagle", "eagle3", "dflash") else None
    sv = build_serving(scfg, sizes, dev, check_mode=guards, guards=guards, draft_layout=layout,
                       gen=torch.Generator().manual_seed(scfg.workload.seed), draft_model=dmodel)
    target = Runner("target", model, sv.target, guards=guards, graphs=graphs,
                    max_context=longest)
    parts = Parts.of(scfg, sizes, sv, target)  # the draft's runner is set below
    if s.algorithm == "none":
        return parts
    n = m.num_layers
    if feature is not None:
        model_d, parts.draft_desc, parts.draft_training = _feature_draft(
            scfg, feature, model, loaded, dev, progress)
        parts.draft = Runner("draft", model_d, sv.draft, guards=guards, graphs=graphs,
                             max_context=longest)
        target.tap = model_d.target_tap(model)  # the hidden states the draft reads
    elif s.draft_weights != "target" or s.algorithm == "dflash":
        model_d, parts.draft_desc, parts.draft_training = _layered_draft(
            scfg, model, sv.draft_pool, loaded, dev, progress)
        parts.draft = Runner("draft", model_d, sv.draft, guards=guards, graphs=graphs,
                             max_context=longest)
    elif s.algorithm in OWN_COPY:
        parts.draft = Runner("draft", draft_copy(model), sv.draft, guards=guards, graphs=graphs,
                             max_context=longest)
        parts.draft_desc = (f"a copy of the target's {n} layers, own "
                            f"{'split ' if sv.draft_pool.is_split else ''}pool")
    elif s.algorithm == "frozen_kv_mtp":
        parts.draft = Runner("draft", draft_copy(model), sv.draft, writes=False, swap=sv.swap,
                             guards=guards, graphs=graphs, max_context=longest)
        parts.draft_desc = (f"the target's {len(frozen_draft_binding(scfg))} layers reading its "
                            "frozen K/V (writes none); step k queries position L+k over keys < L")
    if parts.draft is not None and s.draft_window is not None:
        window_draft(parts.draft.model, s.draft_window, s.draft_sink)
        parts.draft_desc += f"; draft window {s.draft_window}" + (
            f" + {s.draft_sink} sink keys" if s.draft_sink else "")
    return parts


def _layered_draft(scfg: SwaFactoryConfig, model, dpool, loaded, dev: str, progress):
    """(model, description, training) of a draft in the ``config`` layout: loaded, or the
    target's layers (DFlash's ``target`` weights), freshly initialised, or distilled."""
    s, m = scfg.spec, scfg.model
    k, dtypes = s.draft_num_layers, draft_layer_types(scfg)
    window = m.sliding_window if dpool.is_split else None
    where = f"own {'split ' if dpool.is_split else ''}pool"
    block = f"; a block of {s.block_size} that sees itself" if s.algorithm == "dflash" else ""
    dtype = next(model.parameters()).dtype
    if loaded is not None:
        return (loaded.to(dtype).eval(), f"{k} layers loaded from {s.draft_weights}, {where}"
                f"{block}", None)
    sources = _sources(list(m.layer_types), m, dtypes)
    kind = "target-typed" if dpool.is_split else "full-attention"
    if s.draft_weights == "target":
        draft = draft_from_layers(model, sources, dtypes, window)
        return draft, (f"{k} {kind} layers (weights of target layers {sources}), {where}"
                       f"{block}"), None
    draft = make_draft(model, sources, dtypes, window, s.draft_weights, scfg.workload.seed)
    trained = None
    if s.draft_weights == "distilled":
        # chain and tree families of one architecture learn the same thing: they share a draft
        fields = {"target": weights_key(model), "draft": config_key(draft),
                  "objective": "block" if s.algorithm == "dflash" else "chain",
                  "block": getattr(s, "block_size", 1), "seed": scfg.workload.seed, "device": dev}
        trained = distill(model, draft, family=s.algorithm, block=getattr(s, "block_size", 1),
                          window=m.sliding_window or 0, seed=scfg.workload.seed, fields=fields,
                          progress=progress)
    how = "distilled from the target" if trained else "random"
    return (draft.to(dtype).eval(), f"{k} {kind} layers of the target's architecture, {how}, "
            f"{where}{block}", trained)


_FAMILY_OF = {"eagle": "eagle", "eagle3": "eagle3", "mtp": "nextn", "dflash": "dflash"}


def _kind(draft) -> str:
    return {EagleDraft: "eagle", Eagle3Draft: "eagle3", DFlashDraft: "dflash"}.get(
        type(draft), "mtp")


def _expect(cfg: SwaFactoryConfig, model):
    """What a saved DFlash drafter must match, by its layer count: the spec's block size and
    the layer types of the draft pool the spec builds for it."""
    m = serving_model(model, cfg.model)

    def of(n: int) -> dict:
        spec = SimpleNamespace(draft_num_layers=n,
                               draft_pool_split=getattr(cfg.spec, "draft_pool_split", False),
                               draft_kv_retention=cfg.spec.draft_kv_retention)
        return {"block_size": getattr(cfg.spec, "block_size", None),
                "layer_types": draft_layer_types(SimpleNamespace(spec=spec, model=m))}
    return of


def _llama_spec(m):
    """The target's spec with a Llama layer's attention: head_dim^-0.5, no sinks, no soft-cap."""
    return m.model_copy(update={"softmax_scale": None, "attention_sinks": False,
                                "logit_softcap": None})


def _feature_draft(scfg: SwaFactoryConfig, kind: str, model, loaded, dev: str, progress):
    """(model, description, training) of an EAGLE-3 or MTP draft: loaded, random or
    distilled on the target's hidden states (`distill_features`)."""
    s, m = scfg.spec, scfg.model
    dtype = next(model.parameters()).dtype
    what = {"eagle": f"an EAGLE head ({s.draft_num_layers} Llama layer(s) over fc of the "
                     "embedding and the target's last hidden state)",
            "eagle3": "an EAGLE-3 head (Llama midlayer over the target's aux hidden states "
                      "fused by fc)",
            "dflash": f"a DFlash drafter ({s.draft_num_layers} Qwen3 layers; context K/V "
                      "projected from the target's hidden states; a block of "
                      f"{getattr(s, 'block_size', 0)} that sees itself)", "mtp": "an MTP layer of the target's architecture (enorm, "
                      "hnorm, eh_proj over the target's last hidden state)"}[kind]
    if loaded is not None:
        return loaded.to(dtype).eval(), f"{what}, loaded from {s.draft_weights}, own pool", None
    if kind == "dflash":
        draft = make_dflash_draft(model, s.draft_num_layers, draft_layer_types(scfg),
                                  m.sliding_window, s.block_size, MASK_TOKEN, scfg.workload.seed)
    else:
        draft = make_feature_draft(kind, model, last_full_layer(model), scfg.workload.seed,
                                   random=s.draft_weights == "random", layers=s.draft_num_layers)
    trained = None
    if s.draft_weights == "distilled":
        fields = {"target": weights_key(model), "draft": kind, "config": config_key(draft),
                  "seed": scfg.workload.seed, "device": dev}
        draft, trained = distill_features(model, draft, family=s.algorithm,
                                          window=m.sliding_window or 0,
                                          seed=scfg.workload.seed, fields=fields,
                                          progress=progress)
    how = "distilled from the target" if trained else "random"
    return draft.to(dtype).eval(), f"{what}, {how}, own pool", trained


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
