"""HF model definitions for the generator: configs from `conf/model/<key>.yaml`, drafts, and the
attention geometry read back from the model code.

The target is built from the model file's attention geometry (layer types, query and KV heads per
group, head dims, window) scaled down by ``run.*`` (hidden size, layer count, experts, vocab), with
random weights (``torch.manual_seed(seed)`` then ``from_config``), or loaded from
``model.checkpoint``. The serving `ModelSpec` is then read back from the attention modules
themselves (`serving_model`): the scale, sinks and windows are what the model code does, so the
backend cannot disagree with it. transformers is imported lazily: the rest of swafactory works
without it.
"""
from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TextIO

import torch

from swafactory.config.schema import Geometry, ModelSpec, SwaFactoryConfig
from swafactory.errors import ConfigError, Reason

__all__ = ["ARCHITECTURES", "require_transformers", "target_config", "post_init", "load_target",
           "serving_model", "attention_modules", "last_full_layer", "sliding_geometry",
           "draft_copy",
           "draft_from_layers", "config_key"]

ARCHITECTURES = {"gemma4": "Gemma4ForCausalLM", "gemma4_moe": "Gemma4ForCausalLM",
                 "gpt_oss": "GptOssForCausalLM", "mistral": "MistralForCausalLM",
                 "gemma3": "Gemma3ForCausalLM"}
"""`model.architecture` key → the transformers class the generator builds."""


def require_transformers():
    """The transformers module, or a ConfigError (exit 2) naming the extra to install."""
    try:
        import transformers
    except ImportError:
        raise ConfigError([Reason("run", "run.mode", "run=generate runs HF model definitions and "
                                  "needs transformers 5.x, which is not installed",
                                  "pip install 'swafactory[models]'", rule="models extra")]) from None
    major = int(transformers.__version__.split(".")[0])
    if major != 5:
        raise ConfigError([Reason("run", "run.mode", f"run=generate needs transformers 5.x (the "
                                  f"AttentionInterface of 5.17+); found {transformers.__version__}",
                                  "pip install 'transformers>=5.17,<6'", rule="models extra")])
    return transformers


def _refuse(field: str, message: str, fix: str) -> ConfigError:
    return ConfigError([Reason("model" if field.startswith("model") else "run", field, message, fix,
                               rule="generate")])


def target_config(cfg: SwaFactoryConfig):
    """The transformers config of the target: the model file's attention geometry, ``run.*``
    sizes. Raises ConfigError when the model has no HF definition here or its geometry does
    not fit the architecture."""
    tf = require_transformers()
    m, r = cfg.model, cfg.run
    if m.architecture is None:
        raise _refuse("model.architecture", f"model={m.name} names no HF architecture, so "
                      "run=generate cannot build it",
                      f"set model.architecture to one of {', '.join(ARCHITECTURES)}")
    n = r.num_layers or m.num_layers
    types = list(m.layer_types[:n])
    swa, full = m.swa or m.full, m.full or m.swa
    common = dict(vocab_size=r.vocab_size, hidden_size=r.hidden_size,
                  intermediate_size=r.intermediate_size, num_hidden_layers=n,
                  num_attention_heads=m.num_attention_heads, initializer_range=r.init_std,
                  max_position_embeddings=r.max_position_embeddings,
                  tie_word_embeddings=False)  # a tied head favours repeating the input token
    W = m.sliding_window
    if m.architecture in ("gemma4", "gemma4_moe"):
        moe = m.architecture == "gemma4_moe"
        return tf.Gemma4TextConfig(
            **common, num_key_value_heads=swa.num_kv_heads, head_dim=swa.head_dim,
            global_head_dim=full.head_dim, num_global_key_value_heads=full.num_kv_heads,
            attention_k_eq_v=True, sliding_window=W or r.max_position_embeddings,
            layer_types=types, hidden_size_per_layer_input=0, vocab_size_per_layer_input=r.vocab_size,
            num_kv_shared_layers=0, enable_moe_block=moe,
            num_experts=r.num_experts if moe else None,
            top_k_experts=r.experts_per_token if moe else None,
            moe_intermediate_size=r.intermediate_size if moe else None)
    if m.architecture == "gpt_oss":
        if swa != full:
            raise _refuse("model.full", "GPT-OSS has one KV geometry for every layer; "
                          f"model={m.name} gives sliding {swa} and full {full}", "model=gpt_oss_20b")
        common.pop("max_position_embeddings")  # its YaRN defaults are consistent with its own
        return tf.GptOssConfig(**common, num_key_value_heads=swa.num_kv_heads, head_dim=swa.head_dim,
                               sliding_window=W, layer_types=types,
                               num_local_experts=r.num_experts,
                               num_experts_per_tok=r.experts_per_token)
    if m.architecture == "mistral":
        if m.full_layers:
            raise _refuse("model.layer_types", "Mistral slides on every layer; "
                          f"model={m.name} has full layers {m.full_layers}", "model=mistral_7b")
        return tf.MistralConfig(**common, num_key_value_heads=swa.num_kv_heads,
                                head_dim=swa.head_dim, sliding_window=W)
    if swa != full:
        raise _refuse("model.full", "Gemma 3 has one KV geometry for every layer; "
                      f"model={m.name} gives sliding {swa} and full {full}", "model=gemma3_4b")
    scale = m.softmax_scale or swa.head_dim ** -0.5
    return tf.Gemma3TextConfig(**common, num_key_value_heads=swa.num_kv_heads,
                               head_dim=swa.head_dim, sliding_window=W or r.max_position_embeddings,
                               layer_types=types, query_pre_attn_scalar=round(scale ** -2),
                               attn_logit_softcapping=m.logit_softcap)


def post_init(model, architecture: str | None) -> dict[str, float]:
    """Parameters a random model sets to a constant after ``from_config``, by name (report.json's
    ``post_init``; rebuild with ``model.get_parameter(name).data.fill_(value)``).

    Gemma 4 attends with scale 1.0 over QK-normed q and k whose norm weights start at one: the
    scores of random weights then have a standard deviation of √head_dim (16 and 23 at its real
    head dims), attention is near one-hot, and HF's own bf16 forward was 100 % off its fp64
    forward on the H200 (617dbe1). Its q_norm and k_norm weights are set to head_dim^-1/4, which
    gives unit-variance scores, as trained norms do."""
    if architecture not in ("gemma4", "gemma4_moe"):
        return {}
    out = {}
    for i, attn in enumerate(attention_modules(model)):
        for norm in ("q_norm", "k_norm"):
            if getattr(getattr(attn, norm, None), "weight", None) is not None:
                out[f"model.layers.{i}.self_attn.{norm}.weight"] = attn.head_dim ** -0.25
    return out


def load_target(cfg: SwaFactoryConfig, dtype: torch.dtype, device: str,
                progress: TextIO | None = None):
    """(model, post_init, training): random weights from `target_config` under
    ``torch.manual_seed(seed)`` then `post_init`, trained on the built-in language first with
    ``run.target_weights=pretrained`` (`language.pretrain`; training: its `Trained` record, else
    None); or ``from_pretrained(model.checkpoint, local_files_only=True)`` (no post_init: {}).
    Eager attention."""
    tf = require_transformers()
    trained = None
    if cfg.model.checkpoint:
        try:
            model = tf.AutoModelForCausalLM.from_pretrained(
                cfg.model.checkpoint, local_files_only=True, dtype=dtype,
                attn_implementation="eager")
        except (OSError, ValueError) as exc:
            raise _refuse("model.checkpoint", f"cannot load {cfg.model.checkpoint!r}: {exc}",
                          "model.checkpoint=<a directory written by save_pretrained>") from exc
    else:
        config = target_config(cfg)
        torch.manual_seed(cfg.workload.seed)
        pre = cfg.run.target_weights == "pretrained"
        model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                    dtype=torch.float32 if pre else dtype)
    recipe = {} if cfg.model.checkpoint else post_init(model, cfg.model.architecture)
    with torch.no_grad():
        for name, value in recipe.items():
            model.get_parameter(name).fill_(value)
    model = model.to(device)
    if not cfg.model.checkpoint and cfg.run.target_weights == "pretrained":
        from swafactory.drafts.language import pretrain

        key = {"config": config_key(model), "post_init": recipe, "device": device}
        trained = pretrain(model, cfg.model.sliding_window, cfg.workload.seed, key, progress)
        model = model.to(dtype)
    return model.eval(), recipe, trained


def config_key(model) -> dict:
    """The model config's fields that decide its weights (not transformers' bookkeeping)."""
    d = model.config.to_dict()
    for k in ("transformers_version", "_attn_implementation_autoset", "dtype", "torch_dtype",
              "_name_or_path", "architectures"):
        d.pop(k, None)
    return d


def attention_modules(model) -> list[torch.nn.Module]:
    """The decoder layers' attention modules, in layer order."""
    return [layer.self_attn for layer in model.model.layers]


def _window(attn, config) -> int | None:
    if hasattr(attn, "sliding_window"):
        return attn.sliding_window
    return getattr(config, "sliding_window", None)  # Mistral: every layer slides (or none)


def last_full_layer(model) -> int:
    """The last decoder layer of full attention (the last layer if every one slides): the
    geometry a draft's own full-attention pool holds."""
    mods = attention_modules(model)
    full = [i for i, a in enumerate(mods) if not _window(a, model.config)]
    return full[-1] if full else len(mods) - 1


def sliding_geometry(model) -> tuple[int, int] | None:
    """(KV heads, head_dim) of the model's first sliding-window layer; None: none slides."""
    a = next((a for a in attention_modules(model) if _window(a, model.config)), None)
    return None if a is None else (a.k_proj.out_features // a.head_dim, a.head_dim)


def serving_model(model, base: ModelSpec) -> ModelSpec:
    """The `ModelSpec` the backend serves: read from the model's attention modules (layer types,
    each group's KV heads and head_dim, window, scale, sinks), so the backend's plan and the
    model code agree by construction. No soft-cap: none of these architectures hands one to the
    attention function in transformers 5 (Gemma 3's ``attn_logit_softcapping`` stays unused), and
    `swafactory_attention` refuses a call whose soft-cap differs from the backend's. Raises
    ConfigError for geometry swafactory cannot hold."""
    mods = attention_modules(model)
    types, geos, scales = [], {}, set()
    windows = set()
    for attn in mods:
        w = _window(attn, model.config)
        kind = "sliding_attention" if w else "full_attention"
        types.append(kind)
        if w:
            windows.add(int(w))
        geo = Geometry(num_kv_heads=attn.k_proj.out_features // attn.head_dim,
                       head_dim=attn.head_dim)
        if geos.setdefault(kind, geo) != geo:
            raise _refuse("model.checkpoint", f"{kind} layers of the model differ in KV geometry "
                          f"({geos[kind]} and {geo}); swafactory serves one geometry per group",
                          "use a model whose layers of a type share their geometry")
        scales.add((float(attn.scaling), attn.head_dim))
    if len(windows) > 1:
        raise _refuse("model.sliding_window", f"the model's sliding layers use windows {windows}",
                      "one window per model")
    if all(abs(sc - d ** -0.5) < 1e-9 for sc, d in scales):
        scale = None  # head_dim^-0.5 on every group: the schema's default
    elif len({sc for sc, _ in scales}) == 1:
        scale = next(iter(scales))[0]
    else:
        raise _refuse("model.softmax_scale", f"the model's layers scale scores by {sorted(scales)}",
                      "one scale, or head_dim^-0.5 per group")
    sinks = any(isinstance(getattr(a, "sinks", None), torch.nn.Parameter) for a in mods)
    data = base.model_dump()
    data.update(num_layers=len(mods), num_attention_heads=model.config.num_attention_heads,
                layer_types=types, layer_pattern=None,
                sliding_window=windows.pop() if windows else None,
                swa=geos.get("sliding_attention"), full=geos.get("full_attention"),
                attention_sinks=sinks, logit_softcap=None,
                softmax_scale=scale)
    for key in ("swa", "full"):
        if isinstance(data[key], Geometry):
            data[key] = data[key].model_dump()
    return ModelSpec.model_validate(data)


def draft_copy(target) -> torch.nn.Module:
    """A self-speculating draft: the target's weights, copied (its own pool holds its K/V)."""
    return copy.deepcopy(target)


def draft_from_layers(target, sources: Sequence[int], types: Sequence[str],
                      sliding_window: int | None) -> torch.nn.Module:
    """A draft of ``len(sources)`` decoder layers of the target's architecture: layer j takes
    type ``types[j]`` and the weights of target layer ``sources[j]`` (same geometry); the
    embedding, final norm and LM head are the target's. Mistral's window is model-wide:
    ``sliding_window`` (None = full attention)."""
    tf = require_transformers()
    d = target.config.to_dict()
    d.pop("per_layer_config", None)  # transformers ≥ 5.23 derives it from layer_types
    d["num_hidden_layers"] = len(sources)
    if d.get("layer_types") is not None:
        d["layer_types"] = list(types)
    if d.get("model_type") == "mistral":
        d["sliding_window"] = sliding_window
    if d.get("model_type") == "gemma4_text":
        full = [a for a in attention_modules(target) if not _window(a, target.config)]
        d["global_head_dim"] = full[0].head_dim
        d["num_global_key_value_heads"] = full[0].k_proj.out_features // full[0].head_dim
    config = type(target.config).from_dict(d)
    param = next(target.parameters())
    draft = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                dtype=param.dtype).to(param.device)
    state = target.state_dict()
    mine = {}
    for key in draft.state_dict():
        src = key
        if key.startswith("model.layers."):
            j, rest = key[len("model.layers."):].split(".", 1)
            src = f"model.layers.{sources[int(j)]}.{rest}"
        mine[key] = state[src]
    draft.load_state_dict(mine, strict=True)
    return draft.eval()
