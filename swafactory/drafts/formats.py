"""Feature drafts on disk, in the formats sglang loads (`drafters`).

* EAGLE-3 (``LlamaForCausalLMEagle3``): ``config.json`` is a Llama config with
  ``architectures: ["LlamaForCausalLMEagle3"]``, ``num_hidden_layers: 1``, ``draft_vocab_size``,
  ``target_hidden_size`` and ``eagle_config.eagle_aux_hidden_state_layer_ids``;
  ``model.safetensors`` holds ``fc.weight`` [H, 3·Ht], ``midlayer.*`` (q/k/v_proj 2·H wide,
  ``hidden_norm``), ``norm.weight``, ``lm_head.weight`` [draft vocab, H], ``d2t`` (int64, target
  id = draft id + d2t[draft id]), ``t2d`` (bool [vocab]) and ``embed_tokens.weight`` (the
  target's; sglang borrows the target's own when the hidden sizes agree).
* EAGLE (``LlamaForCausalLMEagle``): a Llama config; ``fc.weight`` [H, 2·H] and ``fc.bias``,
  ``layers.{i}.*`` (no ``input_layernorm`` on layer 0), ``embed_tokens.weight``; no final norm
  and no LM head (sglang serves it with the target's).
* DFlash (``DFlashDraftModel``, z-lab's published layout): a Qwen3 config with
  ``block_size``, ``num_target_layers`` and ``dflash_config`` (``target_layer_ids``,
  ``mask_token_id``); ``fc.weight`` [H, K·Ht], ``hidden_norm``, ``layers.{i}.*`` (with
  ``q_norm``/``k_norm``), ``norm``; no embedding and no LM head (the target's).
* NEXTN/MTP (DeepSeek's layout): ``config.json`` is the target's config with
  ``num_nextn_predict_layers: 1``; the layer's weights sit at ``model.layers.{N}.*`` with N the
  target's layer count: ``enorm``, ``hnorm``, ``eh_proj`` [H, 2·H], ``shared_head.norm``,
  ``shared_head.head``, ``embed_tokens`` and the decoder layer's own keys.

`save_feature_draft` writes either; `load_feature_draft` reads a directory in either format
(None: not a feature-draft format, so an HF model directory) and `check_feature_draft` refuses
one that does not fit the target, every reason at once, before anything is allocated.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from swafactory.drafts.dflash import DFlashDraft
from swafactory.drafts.drafters import EagleDraft, Eagle3Draft, MtpDraft
from swafactory.models.hf import (attention_modules, draft_from_layers, last_full_layer,
                                      require_transformers, sliding_geometry)
from swafactory.errors import ConfigError, Reason

__all__ = ["save_feature_draft", "load_feature_draft", "check_feature_draft", "format_of"]

EAGLE3_ARCH = "LlamaForCausalLMEagle3"
EAGLE_ARCH = "LlamaForCausalLMEagle"
DFLASH_ARCH = "DFlashDraftModel"


def _nextn_index(config: dict) -> int:
    """sglang's NEXTN layer index: the target's layer count (0 for a one-layer model)."""
    n = int(config["num_hidden_layers"])
    return 0 if n == 1 else n


def format_of(path: str | Path) -> str | None:
    """``eagle3``, ``mtp`` or None (no feature-draft format) from ``path/config.json``."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if EAGLE3_ARCH in (config.get("architectures") or []):
        return "eagle3"
    if EAGLE_ARCH in (config.get("architectures") or []):
        return "eagle"
    if DFLASH_ARCH in (config.get("architectures") or []):
        return "dflash"
    if config.get("num_nextn_predict_layers"):
        return "mtp"
    return None


def save_feature_draft(draft, path: str | Path, target_config=None) -> None:
    """Write ``draft`` to the directory ``path`` in its sglang format. target_config: the
    target's transformers config (an MTP layer's ``config.json`` is the target's)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in draft.state_dict().items()}
    if isinstance(draft, (EagleDraft, DFlashDraft)):
        config = draft.config.to_dict()
        config.pop("_attn_implementation_autoset", None)
        config["architectures"] = [EAGLE_ARCH if isinstance(draft, EagleDraft) else DFLASH_ARCH]
        skip = ("rotary.", "lm_head.") + (("embed_tokens.",) if isinstance(draft, DFlashDraft)
                                          else ())
        out = {k.removeprefix("model."): v for k, v in state.items() if not k.startswith(skip)}
    elif isinstance(draft, Eagle3Draft):
        config = draft.config.to_dict()
        config.pop("_attn_implementation_autoset", None)
        config["architectures"] = [EAGLE3_ARCH]
        out = {k.replace("model.layers.0.", "midlayer."): v for k, v in state.items()
               if not k.startswith("rotary.")}
    elif isinstance(draft, MtpDraft):
        config = (target_config or draft.config).to_dict()
        config["num_nextn_predict_layers"] = 1
        pre = f"model.layers.{_nextn_index(config)}."
        out = {}
        for k, v in state.items():
            if k.startswith("inner.model.layers.0."):
                out[pre + k[len("inner.model.layers.0."):]] = v
            elif k == "inner.model.norm.weight":
                out[pre + "shared_head.norm.weight"] = v
            elif k == "inner.lm_head.weight":
                out[pre + "shared_head.head.weight"] = v
            elif k.split(".")[0] in ("enorm", "hnorm", "eh_proj", "embed_tokens"):
                out[pre + k] = v
    else:
        raise TypeError(f"not a feature draft: {type(draft).__name__}")
    for k in ("dtype", "torch_dtype"):
        config.pop(k, None)
    config["dtype"] = str(next(draft.parameters()).dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(config, indent=1, default=str))
    save_file(out, str(path / "model.safetensors"))


def _refuse(path, reasons: list[tuple[str, str]]) -> ConfigError:
    return ConfigError([Reason("spec", "spec.draft_weights", f"{path}: {msg}", fix,
                               rule="draft weights") for msg, fix in reasons],
                       headline="swafactory cannot serve this draft:")


def load_feature_draft(path: str | Path, target, device, expect=None
                       ) -> torch.nn.Module | None:
    """The feature draft saved at ``path`` (fp32, on ``device``), or None when ``path`` holds
    no feature-draft format. Raises ConfigError for a draft that does not fit ``target`` or
    ``expect`` (a DFlash drafter's ``block_size`` and ``layer_types``, the spec's: a dict, or
    a function of the drafter's layer count that gives one)."""
    from safetensors.torch import load_file

    kind = format_of(path)
    if kind is None:
        return None
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    state = load_file(str(path / "model.safetensors"))
    if callable(expect):  # by the drafter's layer count
        expect = expect(int(config.get("num_hidden_layers") or 0))
    check_feature_draft(kind, config, state, target, path, expect or {})
    if kind == "dflash":
        tf = require_transformers()
        cfg = tf.Qwen3Config.from_dict({k: v for k, v in config.items() if k != "dtype"})
        K = len(cfg.dflash_config["target_layer_ids"])
        cfg.num_target_hidden = state["fc.weight"].shape[1] // K
        draft = DFlashDraft(cfg, target.get_input_embeddings().weight.float(),
                            target.get_output_embeddings().weight.float())
        mine = {("" if k.startswith(("fc.", "hidden_norm.", "norm.")) else "model.") +
                k.removeprefix("model."): v.float() for k, v in state.items()}
        ours = draft.state_dict()
        mine.update({k: ours[k] for k in ("embed_tokens.weight", "lm_head.weight")})
        draft.load_state_dict(mine, strict=True)
        return draft.to(device).eval()
    if kind == "eagle":
        tf = require_transformers()
        draft = EagleDraft(tf.LlamaConfig.from_dict({k: v for k, v in config.items()
                                                     if k != "dtype"}))
        mine = {("" if k.startswith(("embed_tokens.", "fc.")) else "model.") +
                k.removeprefix("model."): v for k, v in state.items()
                if "lm_head" not in k and "layers.0.input_layernorm" not in k}  # sglang skips
        mine.setdefault("embed_tokens.weight", target.get_input_embeddings().weight.detach())
        mine["lm_head.weight"] = target.get_output_embeddings().weight.detach()  # sglang's way
        draft.load_state_dict({k: v.float() for k, v in mine.items()}, strict=True)
        return draft.to(device).eval()
    if kind == "eagle3":
        tf = require_transformers()
        cfg = tf.LlamaConfig.from_dict({k: v for k, v in config.items() if k != "dtype"})
        draft = Eagle3Draft(cfg)
        mine = {}
        for k, v in state.items():
            k = k.removeprefix("model.")
            mine[k.replace("midlayer.", "model.layers.0.")] = v
        if "embed_tokens.weight" not in mine:  # borrowed from the target, as sglang does
            mine["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().float()
        if "t2d" not in mine:  # sglang reads d2t alone
            mine["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
        draft.load_state_dict({k: v.float() if v.is_floating_point() else v
                               for k, v in mine.items()}, strict=True)
        return draft.to(device).eval()
    pre = f"model.layers.{_nextn_index(config)}."
    inner = draft_from_layers(target, [last_full_layer(target)], ["full_attention"], None).float()
    mine = {}
    for k, v in state.items():
        if not k.startswith(pre):
            continue
        k = k[len(pre):]
        if k.split(".")[0] in ("enorm", "hnorm", "eh_proj", "embed_tokens"):
            mine[k] = v
        elif k == "shared_head.norm.weight":
            mine["inner.model.norm.weight"] = v
        elif k == "shared_head.head.weight":
            mine["inner.lm_head.weight"] = v
        else:
            mine["inner.model.layers.0." + k] = v
    emb = target.get_input_embeddings().weight
    draft = MtpDraft(inner, emb.detach().float())
    ours = draft.state_dict()
    for k in ours:  # sglang takes the embedding and head from the target (the inner model's
        # own embedding is unused: the layer reads eh_proj's output)
        if k not in mine and (k in ("embed_tokens.weight", "inner.lm_head.weight")
                              or k.startswith("inner.model.embed_tokens")):
            mine[k] = ours[k]
    missing = sorted(set(ours) - set(mine))
    if missing:
        raise _refuse(path, [(f"the MTP layer lacks {missing[:4]}", "save it with its decoder "
                              "layer's weights (model.layers.{N}.*)")])
    draft.load_state_dict({k: v.float() if v.is_floating_point() else v
                           for k, v in mine.items()}, strict=True)
    return draft.to(device).eval()


def check_feature_draft(kind: str, config: dict, state: dict, target, path,
                        expect: dict | None = None) -> None:
    """Refuse a saved feature draft that ``target`` cannot feed or the draft pool cannot hold,
    every reason at once: vocabulary, hidden size, aux layers, KV geometry (the target's
    full-attention geometry: the draft pool's); a DFlash drafter's block size and layer types
    against ``expect`` (the spec's)."""
    expect = expect or {}
    tc = target.config
    full = attention_modules(target)[last_full_layer(target)]
    kv = (full.k_proj.out_features // full.head_dim, full.head_dim)
    reasons = []
    if config.get("vocab_size") != tc.vocab_size:
        reasons.append((f"vocabulary {config.get('vocab_size')}, the target's {tc.vocab_size}",
                        f"a draft with vocab_size={tc.vocab_size}"))
    if kind in ("eagle", "eagle3", "dflash"):
        if config.get("num_attention_heads") != tc.num_attention_heads:
            reasons.append((f"{config.get('num_attention_heads')} query heads; the target's "
                            f"{tc.num_attention_heads} (the draft's backend plans the target's)",
                            f"num_attention_heads={tc.num_attention_heads}"))
        hd = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        mine = (config.get("num_key_value_heads"), hd)
    if kind == "eagle":
        if config.get("hidden_size") != tc.hidden_size:
            reasons.append((f"hidden size {config.get('hidden_size')}; its fc reads the target's "
                            f"{tc.hidden_size}-wide hidden state", f"hidden_size={tc.hidden_size}"))
    elif kind == "dflash":
        ids = (config.get("dflash_config") or {}).get("target_layer_ids") or []
        fc = state.get("fc.weight")
        if not ids or not all(0 <= i < tc.num_hidden_layers for i in ids):
            reasons.append((f"dflash_config.target_layer_ids is {ids or None}; the target has "
                            f"{tc.num_hidden_layers} layers", "layer ids of the target"))
        elif fc is None or fc.shape[1] != len(ids) * tc.hidden_size:
            reasons.append((f"its fc reads {None if fc is None else fc.shape[1]} features; "
                            f"{len(ids)} target layers of hidden size {tc.hidden_size} give "
                            f"{len(ids) * tc.hidden_size}", "a drafter for this target"))
        if "mask_token_id" not in (config.get("dflash_config") or {}):
            reasons.append(("dflash_config has no mask_token_id", "write the mask token's id"))
        for key in ("block_size", "layer_types"):
            if key in expect and config.get(key) != expect[key]:
                field = "spec.block_size" if key == "block_size" else "spec.draft_pool_split"
                reasons.append((f"{key} {config.get(key)}; the spec's is {expect[key]}",
                                f"{field} to match the drafter ({config.get(key)})"))
    elif kind == "eagle3":
        th = config.get("target_hidden_size") or config.get("hidden_size")
        if th != tc.hidden_size:
            reasons.append((f"its fc reads 3 × {th} aux features; the target's hidden size is "
                            f"{tc.hidden_size}", f"target_hidden_size={tc.hidden_size}"))
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if ids is None or len(ids) != 3 or not all(0 <= i < tc.num_hidden_layers for i in ids):
            reasons.append((f"eagle_config.eagle_aux_hidden_state_layer_ids is {ids}; the target "
                            f"has {tc.num_hidden_layers} layers", "three layer ids of the target"))
        if config.get("num_hidden_layers") != 1:
            reasons.append((f"{config.get('num_hidden_layers')} layers; an EAGLE-3 draft has one "
                            "midlayer", "num_hidden_layers=1"))
        if "draft_vocab_size" not in config:
            reasons.append(("config.json has no draft_vocab_size", "write draft_vocab_size"))
    else:
        if config.get("model_type") != tc.model_type:
            reasons.append((f"an MTP layer of a {config.get('model_type')} model; the target is a "
                            f"{tc.model_type}", f"an MTP layer saved from a {tc.model_type}"))
        if config.get("hidden_size") != tc.hidden_size:
            reasons.append((f"hidden size {config.get('hidden_size')}, the target's "
                            f"{tc.hidden_size}", f"hidden_size={tc.hidden_size}"))
        pre = f"model.layers.{_nextn_index(config)}."
        k = state.get(pre + "self_attn.k_proj.weight")
        hd = kv[1]
        mine = (None if k is None else k.shape[0] // hd, hd)
        if not any(key.startswith(pre + "eh_proj") for key in state):
            reasons.append((f"no {pre}eh_proj weight", "an MTP layer saved at layer index "
                            f"{_nextn_index(config)}"))
    if kind == "dflash" and "sliding_attention" in (expect.get("layer_types") or ()):
        geo = config.get("sliding_geometry") or {}
        have = (geo.get("num_key_value_heads", mine[0]), geo.get("head_dim", mine[1]))
        want = sliding_geometry(target) or kv
        if have != want:
            reasons.append((f"sliding layers of {have[0]} KV heads × {have[1]}; the split draft "
                            f"pool holds them in the target's SWA geometry {want[0]} × {want[1]}",
                            "sliding_geometry of the target's sliding layers, or "
                            "spec.draft_pool_split=false"))
    if mine != kv:
        reasons.append((f"KV heads × head_dim {mine[0]} × {mine[1]}; the draft pool holds the "
                        f"target's full-attention {kv[0]} × {kv[1]}",
                        "a draft with the target's full-attention KV geometry"))
    if reasons:
        raise _refuse(path, reasons)
