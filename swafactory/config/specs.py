"""Speculative-decoding configs: one pydantic model per algorithm, discriminated by `algorithm`.

Each says who owns the draft KV (`draft_kv`): nobody, its own pool, or the target's pool.
"""
from __future__ import annotations

from typing import Annotated, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from swafactory.errors import FieldError

__all__ = ["SpecConfig", "NoSpec", "EagleSpec", "Eagle3Spec", "NextNSpec", "FrozenKVMTPSpec",
           "DFlashSpec", "StandaloneSpec", "SPEC_ALGORITHMS", "DraftKV", "DRAFT_WEIGHTS"]


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


DraftKV = Literal["none", "own_pool", "target_pool"]
DRAFT_WEIGHTS = ("target", "random", "distilled")
"""The keywords of ``spec.draft_weights`` (anything else is a saved draft's directory)."""


class _SpecBase(_Frozen):
    name: str
    """Config-group key (the YAML file's stem)."""
    num_steps: int = Field(default=1, ge=1)
    """Draft forwards per step (tree depth)."""
    topk: int = Field(default=1, ge=1)
    """Branches per draft step; > 1 makes a tree verified with a tree mask."""
    num_draft_tokens: int = Field(default=2, ge=2)
    """Tokens verified per request per step, the verified root included."""
    draft_num_layers: int = Field(default=1, ge=1)
    """Attention layers of the draft model."""
    draft_weights: str = "target"
    """`generate`: where the draft's weights come from. ``target``: the target's own (a copy of
    every layer for eagle, eagle3, nextn, standalone and frozen_kv_mtp, which then self-speculate;
    DFlash: ``draft_num_layers`` of its layers). ``random``: a draft of ``draft_num_layers``
    full-attention layers of the target's architecture, freshly initialised. ``distilled``: that
    draft, trained on the target's greedy continuations of random prompts (cached on disk).
    Otherwise a directory holding a saved draft (``config.json`` and safetensors)."""
    draft_window: int | None = Field(default=None, ge=1)
    """The attention window of every draft layer, in keys (HF ``sliding_window``: the current
    token included). It narrows a layer's own window, never widens it. None: each draft layer
    reads what its layer type reads (a full-attention draft layer: the whole context)."""
    draft_sink: int = Field(default=0, ge=0)
    """Keys at the start of each request a windowed draft layer reads besides its window
    (sink tokens, as sglang's windowed draft decode keeps). Needs ``draft_window``."""
    draft_kv_retention: Literal["full", "window"] = "full"
    """``full``: the draft keeps every token's K/V, and ``draft_window`` bounds attention only
    (vLLM's ``draft_attention_window``). ``window``: the draft's K/V lives on the SWA side of the
    target's allocator, indexed by the target's SWA slots and freed with them (sglang's
    ``--speculative-draft-kv-ratio``): it needs a split target whose window covers
    ``draft_window``."""

    @model_validator(mode="after")
    def _draft_window(self) -> _SpecBase:
        algo = getattr(self, "algorithm", "this spec")
        if self.draft_window is None:
            self._need(not self.draft_sink, "draft_sink", f"draft_sink={self.draft_sink} keeps "
                       "keys beside a draft window, but spec.draft_window is not set; set "
                       "spec.draft_window=<W> or spec.draft_sink=0")
            self._need(self.draft_kv_retention == "full", "draft_kv_retention",
                       "draft_kv_retention=window keeps the draft's K/V for its window, but "
                       "spec.draft_window is not set; set spec.draft_window=<W> or "
                       "spec.draft_kv_retention=full")
        block = getattr(self, "block_size", None)
        if block is not None and self.draft_window is not None:
            self._need(self.draft_window >= block, "draft_window",
                       f"a {algo} block of {block} tokens attends to itself, so its draft window "
                       f"must hold it: draft_window >= block_size={block}, got "
                       f"{self.draft_window}; set spec.draft_window={block} or more")
        if self.draft_kv == "target_pool":
            self._need(self.draft_kv_retention == "full", "draft_kv_retention",
                       f"{algo} reads the target's K/V and writes none of its own, so there is "
                       "no draft K/V to retain by window; set spec.draft_kv_retention=full")
        self._need(not (self.draft_sink and self.draft_kv_retention == "window"), "draft_sink",
                   f"draft_kv_retention=window frees the draft's K/V outside its window, the "
                   f"sink's {self.draft_sink} keys included; set spec.draft_kv_retention=full "
                   "or spec.draft_sink=0")
        return self

    @model_validator(mode="after")
    def _weights(self) -> _SpecBase:
        w = self.draft_weights
        if w in DRAFT_WEIGHTS:
            if w != "target" and self.draft_kv == "target_pool":
                raise FieldError("draft_weights", f"{self.algorithm} reads the target's K/V "
                                 f"through the target's own layers, so its weights are the "
                                 f"target's; got draft_weights={w!r}. Use draft_weights=target")
            return self
        if not w or "/" not in w and not w.startswith("."):
            raise FieldError("draft_weights", f"{w!r} is neither one of {', '.join(DRAFT_WEIGHTS)} "
                             "nor a directory path; pass one of those, or a saved draft's "
                             "directory (e.g. ./drafts/eagle)")
        return self

    @property
    def is_tree(self) -> bool:
        """True when verify needs a tree mask (topk > 1)."""
        return self.topk > 1

    @property
    def draft_tokens_per_step(self) -> int:
        """KV slots a request may hold beyond its accepted tokens in one step."""
        return max(self.num_steps * self.topk, self.num_draft_tokens)

    def _need(self, ok: bool, field: str, msg: str) -> None:
        if not ok:
            raise FieldError(field, msg)

    def _chain(self, hint: str = "") -> None:
        """A chain: topk 1, and the verified root plus one token per draft step."""
        algo = getattr(self, "algorithm", "this spec")
        self._need(self.topk == 1, "topk", f"{algo} drafts a chain: topk must be 1, got "
                                           f"{self.topk}{hint}")
        self._need(self.num_draft_tokens == self.num_steps + 1, "num_draft_tokens",
                   f"a chain verifies num_steps + 1 = {self.num_steps + 1} tokens, "
                   f"got num_draft_tokens={self.num_draft_tokens}")

    def _tree(self) -> None:
        """A tree of num_steps levels × topk holds at most topk·num_steps + 1 tokens."""
        most = self.topk * self.num_steps + 1
        self._need(self.num_draft_tokens <= most, "num_draft_tokens",
                   f"a tree of {self.num_steps} steps × topk {self.topk} has at most {most} "
                   f"tokens, got num_draft_tokens={self.num_draft_tokens}")
        if self.topk == 1:
            self._chain()


class NoSpec(_Frozen):
    """No speculative decoding: extend and decode only."""

    name: str
    """Config-group key (the YAML file's stem)."""
    algorithm: Literal["none"]
    """Spec algorithm key."""
    draft_kv: Literal["none"] = "none"
    """No draft worker, so no draft KV."""
    is_tree: ClassVar[bool] = False
    draft_tokens_per_step: ClassVar[int] = 0
    topk: ClassVar[int] = 1
    num_steps: ClassVar[int] = 0
    num_draft_tokens: ClassVar[int] = 0
    draft_num_layers: ClassVar[int] = 0
    draft_weights: ClassVar[str] = "target"
    draft_window: ClassVar[int | None] = None
    draft_sink: ClassVar[int] = 0
    draft_kv_retention: ClassVar[str] = "full"


class EagleSpec(_SpecBase):
    """EAGLE, chain drafts (topk 1); the draft owns a full-index-space pool."""

    algorithm: Literal["eagle"]
    """Spec algorithm key."""
    draft_kv: Literal["own_pool"] = "own_pool"
    """EAGLE drafts write their own, non-SWA pool, indexed with the target's full slots."""

    @model_validator(mode="after")
    def _shape(self) -> EagleSpec:
        self._chain(" (use spec=eagle3 for trees)")
        return self


class Eagle3Spec(_SpecBase):
    """EAGLE-3: topk >= 1 trees, verified with a custom mask or cascade."""

    algorithm: Literal["eagle3"]
    """Spec algorithm key."""
    draft_kv: Literal["own_pool"] = "own_pool"
    """EAGLE-3 drafts write their own, non-SWA pool, indexed with the target's full slots."""

    @model_validator(mode="after")
    def _shape(self) -> Eagle3Spec:
        self._tree()
        return self


class NextNSpec(_SpecBase):
    """NextN / MTP: one draft layer with its own pool, chain verify."""

    algorithm: Literal["nextn"]
    """Spec algorithm key."""
    draft_kv: Literal["own_pool"] = "own_pool"
    """The MTP layer writes its own pool, indexed with the target's full slots."""

    @model_validator(mode="after")
    def _shape(self) -> NextNSpec:
        self._chain()
        return self


class FrozenKVMTPSpec(_SpecBase):
    """FROZEN_KV MTP: draft layers read the target's KV, write none; chain verify."""

    algorithm: Literal["frozen_kv_mtp"]
    """Spec algorithm key."""
    draft_kv: Literal["target_pool"] = "target_pool"
    """The draft reads a frozen view of the target's pool, its layers bound to same-type layers."""

    @model_validator(mode="after")
    def _shape(self) -> FrozenKVMTPSpec:
        self._chain()
        return self


class DFlashSpec(_SpecBase):
    """DFlash: drafts a block in parallel (non-causal inside the block), chain verify."""

    algorithm: Literal["dflash"]
    """Spec algorithm key."""
    draft_kv: Literal["own_pool"] = "own_pool"
    """DFlash drafts write their own pool."""
    block_size: int = Field(default=8, ge=2)
    """Tokens drafted in one parallel, non-causal block."""
    draft_pool_split: bool = False
    """The draft pool is itself hybrid: it shares the target's full→SWA mapping."""

    @model_validator(mode="after")
    def _block(self) -> DFlashSpec:
        self._need(self.topk == 1 and self.num_steps == 1, "topk" if self.topk != 1 else "num_steps",
                   f"dflash drafts one block: topk and num_steps must be 1, got topk={self.topk}, "
                   f"num_steps={self.num_steps}")
        self._need(self.num_draft_tokens == self.block_size, "num_draft_tokens",
                   f"dflash verifies its block: num_draft_tokens must equal block_size="
                   f"{self.block_size}, got {self.num_draft_tokens}")
        return self


class StandaloneSpec(_SpecBase):
    """A separate small draft model with its own pool; chain or tree verify."""

    algorithm: Literal["standalone"]
    """Spec algorithm key."""
    draft_kv: Literal["own_pool"] = "own_pool"
    """The draft model writes its own, non-SWA pool, indexed with the target's full slots."""

    @model_validator(mode="after")
    def _shape(self) -> StandaloneSpec:
        self._tree()
        return self


SpecConfig = Annotated[Union[NoSpec, EagleSpec, Eagle3Spec, NextNSpec, FrozenKVMTPSpec, DFlashSpec,
                             StandaloneSpec], Field(discriminator="algorithm")]
SPEC_ALGORITHMS = ("none", "eagle", "eagle3", "nextn", "frozen_kv_mtp", "dflash", "standalone")
