"""Feature drafts: draft heads that read the target's hidden states, as sglang serves them.

* `Eagle3Draft` (``spec=eagle3``): sglang's ``LlamaForCausalLMEagle3``. The target's three aux
  hidden states (`features.eagle3_capture_ids`), concatenated, are fused by ``fc`` to the hidden
  size; the midlayer is a Llama decoder layer whose q/k/v read ``[input_layernorm(embed),
  hidden_norm(feature)]`` (2 × hidden wide), with the feature as its residual. Its pre-norm
  output is the feature of the next draft step; ``lm_head(norm(·))`` gives logits over the draft
  vocabulary, mapped to the target's by ``d2t`` (target id = draft id + d2t[draft id]).
* `EagleDraft` (``spec=eagle``): sglang's ``LlamaForCausalLMEagle`` (EAGLE-1/2):
  ``fc([embed, feature])`` (with bias, no norms), Llama decoder layers (the first without its
  input norm), no final norm; the output is the next step's feature and, through the target's
  LM head, the logits. The target's feature is its final (normed) hidden state.
* `MtpDraft` (``spec=nextn``): a NEXTN/MTP layer as sglang's ``DeepseekModelNextN`` runs it:
  ``eh_proj([enorm(embed), hnorm(feature)])``, one decoder layer of the target's architecture,
  ``shared_head.norm``; that normed hidden state is both the head's input and the next step's
  feature. The target's feature is its final (normed) hidden state.

Both attend through swafactory's backend like any HF model (their attention modules are HF
ones), and `forward(input_ids, position_ids, features)` returns `DraftOut` (logits over the
target's vocabulary, and the features for the next step). `formats` saves and loads them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from swafactory.drafts.features import FeatureTap, eagle3_capture_ids
from swafactory.models.hf import draft_from_layers, require_transformers

__all__ = ["DraftOut", "RMSNorm", "EagleDraft", "Eagle3Draft", "MtpDraft", "is_feature_draft",
           "make_feature_draft", "FEATURE_FAMILIES"]

FEATURE_FAMILIES = {"eagle": "eagle", "eagle3": "eagle3", "nextn": "mtp", "dflash": "dflash"}
"""spec.algorithm → the feature draft it takes with ``draft_weights`` random, distilled or a
saved directory."""


@dataclass
class DraftOut:
    logits: torch.Tensor
    """[1, T, vocab] over the target's vocabulary."""
    hidden: torch.Tensor
    """[1, T, hidden]: each row's feature for the draft step after it."""


class RMSNorm(nn.Module):
    """weight · x / rms(x), computed in fp32 (Llama's and DeepSeek's RMSNorm)."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


def is_feature_draft(model) -> bool:
    return bool(getattr(model, "reads_features", False))


class _FeatureDraft(nn.Module):
    """What every feature draft shares: the flag runners read, the target's hidden states it
    reads (its `FeatureTap`; the final normed one unless overridden) and their cast."""

    reads_features = True
    shifted = True
    """A row reads the feature of the position before it (EAGLE, EAGLE-3, MTP); False: its own
    position's (DFlash's context rows)."""

    @property
    def feature_width(self) -> int:
        """The width of a forward's ``features`` rows."""
        return self.config.hidden_size

    def taps(self) -> list[int | str]:
        return ["norm"]

    def target_tap(self, target) -> FeatureTap:
        return FeatureTap(target, self.taps())

    def fuse(self, feats: torch.Tensor) -> torch.Tensor:
        """[T, F] target features → [T, hidden] draft inputs."""
        return feats.to(next(self.parameters()).dtype)

    def set_attn_implementation(self, name: str) -> None:
        self.config._attn_implementation = name


class _Layers(nn.Module):
    """``.layers`` for `models.attention_modules` (the draft's attention geometry)."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)


def _causal(T: int, like: torch.Tensor) -> torch.Tensor:
    """[1, 1, T, T] additive causal mask in ``like``'s dtype (eager and SDPA attention)."""
    m = torch.full((T, T), torch.finfo(like.dtype).min, device=like.device, dtype=like.dtype)
    return m.triu(1)[None, None]


class Eagle3Draft(_FeatureDraft):
    """sglang's EAGLE-3 draft. config: a transformers ``LlamaConfig`` with ``draft_vocab_size``,
    ``target_hidden_size`` and ``eagle_config.eagle_aux_hidden_state_layer_ids``; vocab_size is
    the target's."""

    _supports_sdpa = True

    def __init__(self, config) -> None:
        super().__init__()
        tf = require_transformers()
        llama = tf.models.llama.modeling_llama
        H, Vd = config.hidden_size, config.draft_vocab_size
        self.config = config
        config._attn_implementation = "eager"  # until a runner or the trainer sets its own
        self.embed_tokens = nn.Embedding(config.vocab_size, H)
        self.fc = nn.Linear(3 * config.target_hidden_size, H, bias=False)
        mid = llama.LlamaDecoderLayer(config, layer_idx=0)
        heads, kv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        mid.self_attn.q_proj = nn.Linear(2 * H, heads * hd, bias=config.attention_bias)
        mid.self_attn.k_proj = nn.Linear(2 * H, kv * hd, bias=config.attention_bias)
        mid.self_attn.v_proj = nn.Linear(2 * H, kv * hd, bias=config.attention_bias)
        mid.hidden_norm = llama.LlamaRMSNorm(H, eps=config.rms_norm_eps)
        self.model = _Layers([mid])
        self.norm = llama.LlamaRMSNorm(H, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(H, Vd, bias=False)
        self.rotary = llama.LlamaRotaryEmbedding(config)
        self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))

    @property
    def midlayer(self) -> nn.Module:
        return self.model.layers[0]

    def taps(self) -> list[int | str]:
        return list(self.config.eagle_config["eagle_aux_hidden_state_layer_ids"])

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """[T, 3 · target hidden] aux hidden states → [T, hidden] features."""
        return self.fc(aux.to(self.fc.weight.dtype))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                features: torch.Tensor, attention_mask=None, use_cache: bool = False) -> DraftOut:
        """input_ids, position_ids: [B, T] int64; features: [B, T, hidden] (fused)."""
        del use_cache
        mid = self.midlayer
        embeds = self.embed_tokens(input_ids)
        if attention_mask is None and self.config._attn_implementation != "swafactory":
            attention_mask = _causal(input_ids.shape[1], embeds)  # swafactory's plan has its own
        residual = features
        x = torch.cat([mid.input_layernorm(embeds), mid.hidden_norm(features)], dim=-1)
        cos_sin = self.rotary(x, position_ids)
        attn, _ = mid.self_attn(hidden_states=x, position_embeddings=cos_sin,
                                attention_mask=attention_mask)
        residual = attn + residual
        residual = mid.mlp(mid.post_attention_layernorm(residual)) + residual
        logits = self.lm_head(self.norm(residual))
        return DraftOut(self._to_target(logits), residual)

    def _to_target(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., Vd] → the target's [..., V] (-inf off the draft's)."""
        V, Vd = self.config.vocab_size, self.config.draft_vocab_size
        if Vd == V and not bool(self.d2t.any()):  # the identity map (a full draft vocabulary)
            return logits
        out = logits.new_full((*logits.shape[:-1], V), float("-inf"))
        return out.index_copy_(-1, self.d2t + torch.arange(Vd, device=self.d2t.device), logits)


class EagleDraft(_FeatureDraft):
    """sglang's EAGLE draft. config: a transformers ``LlamaConfig`` (num_hidden_layers layers);
    ``lm_head`` is the target's (sglang serves it with the target's head)."""

    _supports_sdpa = True

    def __init__(self, config) -> None:
        super().__init__()
        tf = require_transformers()
        llama = tf.models.llama.modeling_llama
        H = config.hidden_size
        self.config = config
        config._attn_implementation = "eager"  # until a runner or the trainer sets its own
        self.embed_tokens = nn.Embedding(config.vocab_size, H)
        self.fc = nn.Linear(2 * H, H, bias=True)
        layers = [llama.LlamaDecoderLayer(config, layer_idx=i)
                  for i in range(config.num_hidden_layers)]
        layers[0].input_layernorm = nn.Identity()  # EAGLE's first layer reads fc's output as is
        self.model = _Layers(layers)
        self.lm_head = nn.Linear(H, config.vocab_size, bias=False)
        self.rotary = llama.LlamaRotaryEmbedding(config)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                features: torch.Tensor, attention_mask=None, use_cache: bool = False) -> DraftOut:
        """input_ids, position_ids: [B, T] int64; features: [B, T, hidden]."""
        del use_cache
        h = self.fc(torch.cat([self.embed_tokens(input_ids), features], dim=-1))
        if attention_mask is None and self.config._attn_implementation != "swafactory":
            attention_mask = _causal(input_ids.shape[1], h)
        cos_sin = self.rotary(h, position_ids)
        for layer in self.model.layers:
            h = layer(h, attention_mask=attention_mask, position_embeddings=cos_sin)
        return DraftOut(self.lm_head(h), h)


class MtpDraft(_FeatureDraft):
    """A NEXTN/MTP layer over a one-layer model of the target's architecture (``inner``: its
    decoder layer, final norm = ``shared_head.norm`` and LM head = ``shared_head.head``)."""

    def __init__(self, inner, embed_weight: torch.Tensor) -> None:
        super().__init__()
        H = inner.config.hidden_size
        self.inner = inner
        self.config = inner.config
        self.embed_tokens = nn.Embedding.from_pretrained(embed_weight.detach().clone(),
                                                         freeze=False)
        self.enorm, self.hnorm = RMSNorm(H), RMSNorm(H)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)

    @property
    def model(self) -> nn.Module:
        return self.inner.model

    @property
    def _supports_sdpa(self) -> bool:  # the inner architecture's
        return bool(getattr(self.inner, "_supports_sdpa", False))

    def set_attn_implementation(self, name: str) -> None:
        self.inner.set_attn_implementation(name)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                features: torch.Tensor, attention_mask=None, use_cache: bool = False) -> DraftOut:
        """input_ids, position_ids: [B, T] int64; features: [B, T, hidden]."""
        x = torch.cat([self.enorm(self.embed_tokens(input_ids)), self.hnorm(features)], dim=-1)
        hidden = self.inner.model(inputs_embeds=self.eh_proj(x), position_ids=position_ids,
                                  attention_mask=attention_mask,
                                  use_cache=use_cache).last_hidden_state  # shared_head.norm'd
        logits = self.inner.lm_head(hidden)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:  # the architecture's own head (Gemma)
            logits = torch.tanh(logits / cap) * cap
        return DraftOut(logits, hidden)


def make_feature_draft(kind: str, target, source: int, seed: int, random: bool,
                       layers: int = 1):
    """A fresh feature draft for ``target`` (fp32): ``mtp`` starts from target layer ``source``
    (made full attention), its embedding and head; ``eagle3`` and ``eagle`` (``layers``
    layers) from Llama layers of that layer's KV geometry, the target's embedding and head.
    ``random``: the architectures' own initialisation under ``seed`` instead of the target's
    weights."""
    torch.manual_seed(seed)
    emb = target.get_input_embeddings().weight
    if kind == "mtp":
        inner = draft_from_layers(target, [source], ["full_attention"], None).float()
        if random:
            tf = require_transformers()
            fresh = tf.AutoModelForCausalLM.from_config(inner.config, attn_implementation="eager",
                                                        dtype=torch.float32)
            inner.load_state_dict(fresh.state_dict())
        return MtpDraft(inner, emb.float())
    config = _llama_config(target, source, "LlamaForCausalLMEagle3" if kind == "eagle3"
                           else "LlamaForCausalLMEagle", layers)
    if kind == "eagle":  # its embedding and head are the target's, as sglang serves it
        draft = EagleDraft(config).float()
        with torch.no_grad():
            draft.embed_tokens.weight.copy_(emb.float())
            draft.lm_head.weight.copy_(target.get_output_embeddings().weight.float())
        return draft.to(emb.device)
    tc = target.config
    config.draft_vocab_size = tc.vocab_size
    config.target_hidden_size = tc.hidden_size
    config.eagle_config = {"eagle_aux_hidden_state_layer_ids":
                           eagle3_capture_ids(tc.num_hidden_layers)}
    draft = Eagle3Draft(config).float()
    if not random:
        with torch.no_grad():
            draft.embed_tokens.weight.copy_(emb.float())
            draft.lm_head.weight.copy_(target.get_output_embeddings().weight.float())
    return draft.to(emb.device)


def _llama_config(target, source: int, arch: str, layers: int):
    """A Llama config at the target's sizes with target layer ``source``'s KV geometry (the
    draft pool's: the target's full-attention geometry)."""
    from swafactory.models.hf import attention_modules

    tf = require_transformers()
    full = attention_modules(target)[source]
    tc = target.config
    return tf.LlamaConfig(
        vocab_size=tc.vocab_size, hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=full.k_proj.out_features // full.head_dim, head_dim=full.head_dim,
        max_position_embeddings=getattr(tc, "max_position_embeddings", 8192),
        rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
        architectures=[arch], num_hidden_layers=layers)
