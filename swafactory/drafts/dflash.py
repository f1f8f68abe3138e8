"""The DFlash block drafter as sglang serves it (``DFlashDraftModel``): Qwen3 layers whose
context K/V are projected from the target's hidden states.

* Context: the target's hidden states at the ``dflash_config.target_layer_ids`` (each layer's
  output), concatenated, are fused to ``ctx = hidden_norm(fc(·))``. Every draft layer's K/V at a
  committed position is ``k_norm(k_proj(ctx))`` (RoPE at that position) and ``v_proj(ctx)``: the
  same ``ctx`` for every layer, no input norm. A ``draft_extend`` writes them.
* Block: the root, then mask tokens (``dflash_config.mask_token_id``), at positions L … L + B - 1,
  embedded with the target's embedding, run through the layers as usual (they see the context
  and each other); ``norm``, then the target's LM head. Row i predicts the token at block
  position i; `forward` returns row i + 1's logits at row i, the generator's convention (row i
  drafts node i + 1).

One forward serves both, row by row: the last feature column is 1 on a context row (whose
attention input is ``ctx``) and 0 on a block row (attention input ``input_layernorm(h)``), so one
CUDA graph bucket serves either pass. A context row's output is not a prediction; its attention
over the earlier context K/V is what the ``draft_logits`` check compares with the eager forward.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from swafactory.drafts.drafters import DraftOut, _FeatureDraft, _Layers
from swafactory.models.hf import (attention_modules, last_full_layer, require_transformers,
                                  sliding_geometry)

__all__ = ["DFlashDraft", "dflash_target_layers", "make_dflash_draft"]


def _type_masks(config, T: int, like: torch.Tensor) -> dict[str, torch.Tensor]:
    """Causal [1, 1, T, T] additive masks by layer type (a sliding type keeps its window)."""
    q = torch.arange(T, device=like.device)[:, None]
    k = torch.arange(T, device=like.device)[None, :]
    out = {}
    for t in set(config.layer_types):
        ok = (k <= q) & ((q - k < config.sliding_window) if t == "sliding_attention" else True)
        m = torch.zeros(T, T, device=like.device, dtype=like.dtype)
        out[t] = m.masked_fill(~ok, torch.finfo(like.dtype).min)[None, None]
    return out


def dflash_target_layers(num_target: int, num_draft: int) -> list[int]:
    """sglang's default ``target_layer_ids``: ``num_draft`` layers spread evenly from 1 to
    L - 3 (the middle one for a one-layer draft)."""
    if num_draft == 1:
        return [num_target // 2]
    lo, hi = 1, max(1, num_target - 3)
    return [round(lo + i * (hi - lo) / (num_draft - 1)) for i in range(num_draft)]


def _layer_config(config, layer_type: str):
    """The config one layer is built from: ``config``, or for a sliding layer a copy with
    ``config.sliding_geometry`` (``num_key_value_heads``, ``head_dim``), when the draft pool
    gives its sliding layers the target's SWA geometry (a split pool)."""
    geo = getattr(config, "sliding_geometry", None)
    if layer_type != "sliding_attention" or not geo:
        return config
    out = copy.copy(config)  # shallow: the layer reads plain fields
    out.num_key_value_heads, out.head_dim = int(geo["num_key_value_heads"]), int(geo["head_dim"])
    return out


class DFlashDraft(_FeatureDraft):
    """config: a transformers ``Qwen3Config`` plus ``block_size``, ``num_target_layers`` and
    ``dflash_config`` (``target_layer_ids``, ``mask_token_id``); on a split draft pool whose
    SWA geometry differs, ``sliding_geometry`` (the sliding layers' KV heads and head_dim).
    ``embed_tokens`` and ``lm_head`` are the target's (not saved: sglang borrows them)."""

    _supports_sdpa = True
    shifted = False  # a context row reads its own position's features

    def __init__(self, config, embed: torch.Tensor, head: torch.Tensor) -> None:
        super().__init__()
        tf = require_transformers()
        qwen3 = tf.models.qwen3.modeling_qwen3
        H, K = config.hidden_size, len(config.dflash_config["target_layer_ids"])
        self.config = config
        config._attn_implementation = "eager"  # until a runner or the trainer sets its own
        self.embed_tokens = nn.Embedding.from_pretrained(embed.detach().clone(), freeze=True)
        self.lm_head = nn.Linear(H, config.vocab_size, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(head)
        self.lm_head.weight.requires_grad_(False)
        self.fc = nn.Linear(K * config.num_target_hidden, H, bias=False)
        self.hidden_norm = qwen3.Qwen3RMSNorm(H, eps=config.rms_norm_eps)
        self._configs = [_layer_config(config, t) for t in config.layer_types]
        self.model = _Layers([qwen3.Qwen3DecoderLayer(c, i) for i, c in enumerate(self._configs)])
        self.norm = qwen3.Qwen3RMSNorm(H, eps=config.rms_norm_eps)
        self.rotary = qwen3.Qwen3RotaryEmbedding(config)
        # RoPE tables by head_dim: a sliding layer of another geometry rotates its own width
        self._rotaries = {c.head_dim: qwen3.Qwen3RotaryEmbedding(c) for c in self._configs
                          if c.head_dim != config.head_dim}

    def set_attn_implementation(self, name: str) -> None:
        for c in {id(c): c for c in [self.config, *self._configs]}.values():
            c._attn_implementation = name  # each layer reads its own config's

    @property
    def mask_token_id(self) -> int:
        return int(self.config.dflash_config["mask_token_id"])

    @property
    def feature_width(self) -> int:
        return self.config.hidden_size + 1  # ctx, then the context-row flag

    def taps(self) -> list[int | str]:
        return list(self.config.dflash_config["target_layer_ids"])

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """[T, K · target hidden] → [T, hidden + 1]: ctx, flagged as context rows."""
        ctx = self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))
        return torch.cat([ctx, torch.ones_like(ctx[..., :1])], dim=-1)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                features: torch.Tensor, attention_mask=None, use_cache: bool = False) -> DraftOut:
        """input_ids, position_ids: [B, T] int64; features: [B, T, hidden + 1] (`fuse`'s on
        context rows, zeros on block rows)."""
        del use_cache
        ctx, flag = features[..., :-1], features[..., -1:]
        h = self.embed_tokens(input_ids).to(ctx.dtype)
        if attention_mask is None and self.config._attn_implementation != "swafactory":
            attention_mask = _type_masks(self.config, input_ids.shape[1], h)
        cos_sin = {self.config.head_dim: self.rotary(h, position_ids)}
        cos_sin.update({d: r(h, position_ids) for d, r in self._rotaries.items()})
        for layer in self.model.layers:
            x = flag * ctx + (1 - flag) * layer.input_layernorm(h)
            mask = attention_mask[layer.self_attn.layer_type] \
                if isinstance(attention_mask, dict) else attention_mask
            a, _ = layer.self_attn(hidden_states=x, position_embeddings=cos_sin[layer.self_attn.head_dim],
                                   attention_mask=mask)
            h = h + a
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        logits = self.lm_head(self.norm(h))
        # a block row i returns row i + 1's logits (the next block position); a context row
        # its own (the packed roll crosses requests only at rows no one reads)
        logits = torch.where(flag.bool(), logits, torch.roll(logits, -1, dims=1))
        return DraftOut(logits, h)


def make_dflash_draft(target, layers: int, types: list[str], window: int | None, block: int,
                      mask_token: int, seed: int) -> DFlashDraft:
    """A fresh DFlash drafter for ``target`` (fp32): ``layers`` Qwen3 layers of the target's
    full-attention KV geometry (``types``: their layer types, ``window`` for sliding ones).
    Sliding layers take the target's sliding geometry where it differs: the split draft pool
    holds them in the target's SWA sub-pool (`kvcache.draft.split_draft_pool`)."""
    tf = require_transformers()
    torch.manual_seed(seed)
    tc = target.config
    full = attention_modules(target)[last_full_layer(target)]
    config = tf.Qwen3Config(
        vocab_size=tc.vocab_size, hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size, num_hidden_layers=layers,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=full.k_proj.out_features // full.head_dim, head_dim=full.head_dim,
        max_position_embeddings=getattr(tc, "max_position_embeddings", 8192), rms_norm_eps=1e-6,
        layer_types=list(types), sliding_window=window, tie_word_embeddings=False,
        use_sliding_window="sliding_attention" in types,  # else Qwen3Config drops the window
        architectures=["DFlashDraftModel"])
    swa = sliding_geometry(target)
    if "sliding_attention" in types and swa is not None and \
            swa != (config.num_key_value_heads, config.head_dim):
        config.sliding_geometry = {"num_key_value_heads": swa[0], "head_dim": swa[1]}
    config.block_size = block
    config.num_target_layers = tc.num_hidden_layers
    config.num_target_hidden = tc.hidden_size
    config.dflash_config = {"target_layer_ids": dflash_target_layers(tc.num_hidden_layers, layers),
                            "mask_token_id": mask_token}
    emb = target.get_input_embeddings().weight.float()
    head = target.get_output_embeddings().weight.float()
    return DFlashDraft(config, emb, head).float().to(emb.device)
