"""The pydantic schema of a composed swafactory configuration.

Every model is frozen and forbids unknown fields. The one window convention is stated here and
nowhere else: ``sliding_window = W`` is HF's value, and a query at position ``p`` sees the keys
``p-W+1 … p`` (W keys, the current token included). Kernel parameters are derived from it by
:func:`swafactory.config.window.kernel_window`.
"""
from __future__ import annotations

from typing import Annotated, ClassVar, Literal, Union

from swafactory.errors import FieldError
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["Geometry", "ModelSpec", "SpecConfig", "NoSpec", "EagleSpec", "Eagle3Spec", "NextNSpec",
           "FrozenKVMTPSpec", "DFlashSpec", "StandaloneSpec", "BackendSpec", "WorkloadSpec",
           "RunSpec", "FaultsSpec", "SwaFactoryConfig", "LayerType", "SPEC_ALGORITHMS", "KV_DTYPE_BYTES"]

LayerType = Literal["sliding_attention", "full_attention"]
_PATTERN_CODES = {"S": "sliding_attention", "F": "full_attention"}
KV_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8_e4m3": 1}


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class Geometry(_Frozen):
    """KV geometry of one layer group."""

    num_kv_heads: int = Field(ge=1)
    """KV heads of the group's layers (HF `num_key_value_heads`, or its global variant)."""
    head_dim: int = Field(ge=1)
    """Head dimension of K and V in this group (HF `head_dim`, or its global variant)."""


class ModelSpec(_Frozen):
    """Attention shape of a model: which layers have a window, and each group's KV geometry."""

    name: str
    """Config-group key (the YAML file's stem)."""
    hf_id: str
    """Hugging Face repo the numbers come from."""
    num_layers: int = Field(ge=1)
    """HF `num_hidden_layers`."""
    num_attention_heads: int = Field(ge=1)
    """HF `num_attention_heads` (query heads; the same on sliding and full layers)."""
    layer_types: tuple[LayerType, ...] | None = None
    """HF `layer_types`: one entry per layer. Give this or `layer_pattern`."""
    layer_pattern: str | None = None
    """Repeating pattern of `S` (sliding) and `F` (full), expanded to `num_layers` entries."""
    sliding_window: int | None = Field(default=None, ge=1)
    """HF `sliding_window` = W: a query at p sees keys p-W+1 … p. Required if any layer slides."""
    swa: Geometry | None = None
    """Geometry of the sliding layers (Gemma 4: HF `num_key_value_heads`, `head_dim`)."""
    full: Geometry | None = None
    """Geometry of the full layers (Gemma 4: `num_global_key_value_heads`, `global_head_dim`)."""
    attention_sinks: bool = False
    """Per-head learned sink logits in the softmax denominator (GPT-OSS `self_attn.sinks`)."""
    logit_softcap: float | None = Field(default=None, gt=0)
    """HF `attn_logit_softcapping`: scores become cap·tanh(s/cap). None = off."""
    softmax_scale: float | None = Field(default=None, gt=0)
    """Score scale; None = head_dim^-0.5 (Gemma 4 uses 1.0 with QK-norm)."""
    hybrid_pool: bool = True
    """Sliding layers get their own SWA sub-pool. False = one full pool, window as a mask only."""

    @model_validator(mode="before")
    @classmethod
    def _expand_pattern(cls, data: object) -> object:
        if not isinstance(data, dict) or data.get("layer_pattern") is None:
            return data
        pattern, n = data["layer_pattern"], data.get("num_layers")
        if not isinstance(pattern, str) or not pattern or set(pattern) - set(_PATTERN_CODES):
            raise FieldError("layer_pattern", f"must be a non-empty string of S and F, got {pattern!r}")
        if not isinstance(n, int) or n < 1:
            return data  # num_layers' own error is reported by its field
        expanded = tuple(_PATTERN_CODES[pattern[i % len(pattern)]] for i in range(n))
        given = data.get("layer_types")
        if given is not None and tuple(given) != expanded:
            raise FieldError("layer_types", "layer_types and layer_pattern disagree; give only one of them")
        return {**data, "layer_types": expanded}

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        if self.layer_types is None:
            raise FieldError("layer_types", "give layer_types (HF list) or layer_pattern (e.g. 'SSSSSF')")
        if len(self.layer_types) != self.num_layers:
            raise FieldError("layer_types", f"has {len(self.layer_types)} entries but num_layers is "
                             f"{self.num_layers}")
        if self.swa_layers:
            if self.sliding_window is None:
                raise FieldError("sliding_window", "sliding layers need sliding_window (HF W)")
            if self.swa is None:
                raise FieldError("swa", "sliding layers need the `swa` geometry")
        if self.full_layers and self.full is None:
            raise FieldError("full", "full layers need the `full` geometry")
        for geo in (self.swa, self.full):
            if geo is not None and self.num_attention_heads % geo.num_kv_heads:
                raise FieldError("num_attention_heads", f"{self.num_attention_heads} is not a multiple "
                                 f"of num_kv_heads={geo.num_kv_heads}")
        if not self.hybrid_pool and self.swa and self.full and self.swa != self.full:
            raise FieldError("hybrid_pool", "false puts every layer in one pool, which needs one "
                             "geometry; sliding and full geometries differ")
        return self

    @property
    def swa_layers(self) -> tuple[int, ...]:
        """Ids of layers with a window."""
        return tuple(i for i, t in enumerate(self.layer_types or ()) if t == "sliding_attention")

    @property
    def full_layers(self) -> tuple[int, ...]:
        """Ids of layers without a window."""
        return tuple(i for i, t in enumerate(self.layer_types or ()) if t == "full_attention")

    def geometry(self, layer_id: int) -> Geometry:
        """KV geometry of one layer."""
        geo = self.swa if layer_id in self.swa_layers else self.full
        assert geo is not None  # guaranteed by _check
        return geo


# ---------------------------------------------------------------- speculative decoding
DraftKV = Literal["none", "own_pool", "target_pool"]


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


class EagleSpec(_SpecBase):
    """EAGLE, chain drafts (topk 1); the draft owns a full-index-space pool."""

    algorithm: Literal["eagle"]
    """Spec algorithm key."""
    draft_kv: Literal["own_pool"] = "own_pool"
    """EAGLE drafts write their own, non-SWA pool, indexed with the target's full slots."""

    @model_validator(mode="after")
    def _chain(self) -> EagleSpec:
        self._need(self.topk == 1, "topk", f"eagle drafts a chain: topk must be 1, got {self.topk} "
                                   "(use spec=eagle3 for trees)")
        self._need(self.num_draft_tokens == self.num_steps + 1, "num_draft_tokens",
                   f"a chain verifies num_steps + 1 = {self.num_steps + 1} tokens, "
                   f"got num_draft_tokens={self.num_draft_tokens}")
        return self


class Eagle3Spec(_SpecBase):
    """EAGLE-3: topk >= 1 trees, verified with a custom mask or cascade."""

    algorithm: Literal["eagle3"]
    """Spec algorithm key."""
    draft_kv: Literal["own_pool"] = "own_pool"
    """EAGLE-3 drafts write their own, non-SWA pool, indexed with the target's full slots."""

    @model_validator(mode="after")
    def _tree(self) -> Eagle3Spec:
        most = self.topk * self.num_steps + 1
        self._need(self.num_draft_tokens <= most, "num_draft_tokens",
                   f"a tree of {self.num_steps} steps × topk {self.topk} has at most {most} "
                   f"tokens, got num_draft_tokens={self.num_draft_tokens}")
        if self.topk == 1:
            self._need(self.num_draft_tokens == self.num_steps + 1, "num_draft_tokens",
                       f"with topk=1 the chain verifies num_steps + 1 = {self.num_steps + 1} tokens")
        return self


class NextNSpec(_SpecBase):
    """NextN / MTP: one draft layer with its own pool, chain verify."""

    algorithm: Literal["nextn"]
    """Spec algorithm key."""
    draft_kv: Literal["own_pool"] = "own_pool"
    """The MTP layer writes its own pool, indexed with the target's full slots."""

    @model_validator(mode="after")
    def _chain(self) -> NextNSpec:
        self._need(self.topk == 1, "topk", f"nextn drafts a chain: topk must be 1, got {self.topk}")
        self._need(self.num_draft_tokens == self.num_steps + 1, "num_draft_tokens",
                   f"a chain verifies num_steps + 1 = {self.num_steps + 1} tokens")
        return self


class FrozenKVMTPSpec(_SpecBase):
    """FROZEN_KV MTP: draft layers read the target's KV, write none; chain verify."""

    algorithm: Literal["frozen_kv_mtp"]
    """Spec algorithm key."""
    draft_kv: Literal["target_pool"] = "target_pool"
    """The draft reads a frozen view of the target's pool, its layers bound to same-type layers."""

    @model_validator(mode="after")
    def _chain(self) -> FrozenKVMTPSpec:
        self._need(self.topk == 1, "topk", f"frozen_kv_mtp verifies a chain: topk must be 1, got {self.topk}")
        self._need(self.num_draft_tokens == self.num_steps + 1, "num_draft_tokens",
                   f"a chain verifies num_steps + 1 = {self.num_steps + 1} tokens")
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
        most = self.topk * self.num_steps + 1
        self._need(self.num_draft_tokens <= most, "num_draft_tokens", f"at most {most} draft tokens for this tree")
        return self


SpecConfig = Annotated[Union[NoSpec, EagleSpec, Eagle3Spec, NextNSpec, FrozenKVMTPSpec, DFlashSpec,
                             StandaloneSpec], Field(discriminator="algorithm")]
SPEC_ALGORITHMS = ("none", "eagle", "eagle3", "nextn", "frozen_kv_mtp", "dflash", "standalone")


# ---------------------------------------------------------------- backend, workload, run
class BackendSpec(_Frozen):
    """Which kernel family serves attention, and how it is wired."""

    name: str
    """Registry key (`auto` picks the best one available on this device)."""
    page_size: int = Field(default=1, ge=1)
    """Tokens per KV page; the allocators keep `full % page == swa % page`."""
    tree_mask: Literal["custom_mask", "cascade"] = "custom_mask"
    """How tree verify (topk > 1) is masked: one custom mask, or prefix pass + expand pass + LSE merge."""
    cuda_graph: bool = False
    """Capture decode and verify in CUDA graphs that replay the plan's buffers."""
    resolver: Literal["auto", "active_pool", "allocator"] = "auto"
    """KV-source policy: `auto` = the truth table; the others pin one answer."""
    kv_dtype: Literal["float32", "float16", "bfloat16", "fp8_e4m3"] = "bfloat16"
    """Storage dtype of the KV pools."""

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        from swafactory.registry.table import list_backends  # the registry owns the key set
        known = ("auto", *list_backends())
        if name not in known:
            raise ValueError(f"unknown backend {name!r}; registered: {', '.join(known)}")
        return name


class WorkloadSpec(_Frozen):
    """The serving load: requests, lengths, pool pressure and how much the oracle checks."""

    name: str
    """Config-group key (the YAML file's stem)."""
    num_requests: int = Field(default=8, ge=1)
    """Requests served over the run."""
    prompt_over_window: tuple[int, int] = (8, 256)
    """Prompt length = W + a uniform draw from this range (prompts longer than the window)."""
    output_len: tuple[int, int] = (8, 24)
    """Tokens generated per request, a uniform draw from this range."""
    max_running_requests: int = Field(default=8, ge=1)
    """Requests decoding at once; the pools are sized for this many."""
    chunk_size: int = Field(default=256, ge=1)
    """Chunked prefill: prompt tokens per extend forward."""
    context_len: int = Field(default=8192, ge=1)
    """Tokens per request that `run=plan` sizes its bytes-per-request figures for."""
    swa_full_tokens_ratio: float | Literal["auto"] = "auto"
    """SWA-pool / full-pool tokens (sglang `--swa-full-tokens-ratio`); `auto` sizes the SWA pool
    to the running requests' windows, so that its use goes above 90%."""
    eviction_interval: int = Field(default=1, ge=1)
    """SWA eviction frees out-of-window slots once the frontier moved this many positions."""
    check_rate: float = Field(default=1.0, ge=0, le=1)
    """Fraction of prefill attention calls compared with the oracle (decode, verify and draft
    calls, and calls right after an eviction, are always checked)."""
    layers: Literal["all", "subset"] = "all"
    """`subset`: attend two layers per layer group (every geometry), still driving every pool."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where pools and kernels live; `auto` = cuda when a GPU is visible."""
    seed: int = 0
    """Seed of every random tensor and choice."""

    @field_validator("swa_full_tokens_ratio")
    @classmethod
    def _ratio(cls, r: float | str) -> float | str:
        if r != "auto" and not 0 < float(r) <= 1:
            raise ValueError(f"must lie in (0, 1] or be 'auto', got {r}")
        return r

    @model_validator(mode="after")
    def _ranges(self) -> WorkloadSpec:
        for field, (lo, hi) in (("prompt_over_window", self.prompt_over_window),
                                ("output_len", self.output_len)):
            if not 0 <= lo <= hi:
                raise FieldError(field, f"must be [min, max] with 0 <= min <= max, got [{lo}, {hi}]")
        if self.output_len[0] < 1:
            raise FieldError("output_len", "every request generates at least one token")
        return self


class RunSpec(_Frozen):
    """What the command does."""

    mode: Literal["plan", "conformance"] = "conformance"
    """`plan`: validate and print the plan, allocate nothing. `conformance`: the serving
    simulation with every checked attention output compared with the oracle."""


class FaultsSpec(_Frozen):
    """Fault-injection switches inside the shared parts; each reproduces a known engine bug."""

    name: str = "none"
    """Config-group key (the YAML file's stem)."""
    skip_spec_translation: bool = False
    """Spec/tree tables of SWA groups stay in full space (FA3 + EAGLE3 topk > 1, sglang #24402)."""
    allocator_pool_for_own_pool_draft: bool = False
    """An own-pool draft resolves the allocator's SWA pool (FlashInfer + DFlash, sglang #27737)."""
    pool_cached_at_init: bool = False
    """The backend keeps the pool it saw at construction (trtllm_mha + FROZEN_KV, sglang #26957)."""
    window_off_by_one: bool = False
    """Sliding layers see W + 1 keys."""
    no_swa_eviction: bool = False
    """Out-of-window SWA slots are never freed (sglang #33805)."""
    no_draft_headroom: bool = False
    """The own draft pool gets half the target's full capacity (sglang #17630)."""

    @property
    def active(self) -> list[str]:
        """Names of the switches that are on."""
        return [k for k, v in self.model_dump().items() if v is True]


class SwaFactoryConfig(_Frozen):
    """A whole, validated configuration: model × spec × backend × workload × run."""

    model: ModelSpec
    """The target model."""
    spec: SpecConfig
    """The speculative-decoding algorithm."""
    backend: BackendSpec
    """The attention backend."""
    workload: WorkloadSpec
    """The serving load."""
    run: RunSpec
    """What to do."""
    faults: FaultsSpec = FaultsSpec()
    """Fault injection (all off by default)."""

    @property
    def combination(self) -> str:
        """The combination as the overrides that select it."""
        return f"backend={self.backend.name} spec={self.spec.name} model={self.model.name}"
