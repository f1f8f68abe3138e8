"""The pydantic schema of a composed swafactory configuration.

Every model is frozen and forbids unknown fields. The one window convention is stated here and
nowhere else: ``sliding_window = W`` is HF's value, and a query at position ``p`` sees the keys
``p-W+1 … p`` (W keys, the current token included). Kernel parameters are derived from it by
the functions of :mod:`swafactory.window`.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from swafactory.config.backend_keys import known_backend as _known_backend
from swafactory.config.faults import FaultsSpec
from swafactory.config.specs import (SPEC_ALGORITHMS, DFlashSpec, Eagle3Spec, EagleSpec,
                                     FrozenKVMTPSpec, NextNSpec, NoSpec, SpecConfig, StandaloneSpec)
from swafactory.errors import FieldError

__all__ = ["Geometry", "ModelSpec", "SpecConfig", "NoSpec", "EagleSpec", "Eagle3Spec", "NextNSpec",
           "FrozenKVMTPSpec", "DFlashSpec", "StandaloneSpec", "BackendSpec", "WorkloadSpec",
           "GroupKernels", "PassKernels", "KernelChoice", "PassKernel", "RunSpec", "FaultsSpec",
           "ParallelSpec", "SwaFactoryConfig", "LayerType", "SPEC_ALGORITHMS", "KV_DTYPE_BYTES",
           "hands_to_ours"]

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
    architecture: Literal["gemma4", "gemma4_moe", "gpt_oss", "mistral", "gemma3"] | None = None
    """The HF model definition `run=generate` builds (transformers' Gemma4ForCausalLM (dense or
    MoE), GptOssForCausalLM, MistralForCausalLM, Gemma3ForCausalLM); None = none (refused)."""
    checkpoint: str | None = None
    """`run=generate`: a local HF checkpoint directory to load (`from_pretrained(PATH,
    local_files_only=True)`) instead of random weights; its attention geometry is served."""

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


# ---------------------------------------------------------------- backend, workload, run
class GroupKernels(_Frozen):
    """A kernel per layer group (null: `backend.name`'s). The planner, the resolver and the typed
    spaces stay shared; only the kernel that reads a group's tables changes."""

    swa: str | None = None
    """Registry key of the kernel for the layers with a window (e.g. `flash_attn`, which reads
    Gemma 4's head_dim-256 SWA layers but not its head_dim-512 full layers)."""
    full: str | None = None
    """Registry key of the kernel for the layers without a window."""

    @field_validator("swa", "full")
    @classmethod
    def _known(cls, name: str | None) -> str | None:
        return None if name is None else _known_backend(name, auto=False)


PassKernel = Literal["auto", "cuda", "triton", "library"]
"""Which kernel serves a pass: `auto` (ours where one fits and builds, else the family's
default), `cuda` (our CUDA kernel, required), `triton` (our Triton kernel), `library` (the
backend's own: FlashInfer, flash-attn, …). Under a library family, `triton` or `cuda` on a pass
it serves with its own kernel hands that pass to the triton family's adapter
(`BackendSpec.family_for`): a group may decode on our kernels and prefill on FlashInfer's."""


class PassKernels(_Frozen):
    """The kernel of each pass of one layer group, within the family `backend.groups` picks."""

    decode: PassKernel = "auto"
    """One query per request (decode, draft decode)."""
    verify: PassKernel = "auto"
    """Several queries per request under a chain, tree or block mask (target verify, draft
    extend)."""
    extend: PassKernel = "auto"
    """Prefill chunks."""


class KernelChoice(_Frozen):
    """Which of our kernels serve each pass × layer group (`backend.kernels.full.verify=cuda`),
    checked by the registry and built when the backend is built, never in a forward."""

    swa: PassKernels = PassKernels()
    """The layers with a window."""
    full: PassKernels = PassKernels()
    """The layers without a window."""
    build_timeout_s: float = Field(default=300.0, gt=0)
    """Seconds nvcc may take on one kernel; past it the Triton kernel serves (one warning)."""


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
    groups: GroupKernels = GroupKernels()
    """A kernel per layer group (`backend.groups.full=triton`): each group is validated against
    its own kernel's capabilities."""
    kernels: KernelChoice = KernelChoice()
    """Which kernel serves each pass of each group, within its family (`run=plan` shows what
    each resolved to)."""
    autotune: bool = True
    """`backend=auto` on a GPU: time each candidate family and kernel per layer group and pass
    at the run's geometry and keep the fastest (cached on disk; `swafactory.backend.timing`). False,
    or on CPU: the fixed preference order."""

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        return _known_backend(name, auto=True)

    def kernel_for(self, sliding: bool) -> str:
        """Registry key of the kernel family serving layers with (``sliding``) or without a
        window (`backend.groups`, else `backend.name`)."""
        return (self.groups.swa if sliding else self.groups.full) or self.name

    def family_for(self, sliding: bool, pass_: str) -> str:
        """Registry key of the adapter that runs ``pass_`` (decode, verify, extend) of the
        group: its family, or `triton` where ``backend.kernels.<group>.<pass>`` asks for our
        kernels (`triton`, `cuda`) on a pass the family would serve with its own. FlashInfer's
        adapter runs our verify tiles itself, so its verify passes stay with it."""
        fam = self.kernel_for(sliding)
        choice = getattr(self.kernels.swa if sliding else self.kernels.full, pass_)
        return "triton" if hands_to_ours(fam, pass_, choice) else fam


def hands_to_ours(family: str, pass_: str, choice: str) -> bool:
    """Whether ``backend.kernels.<group>.<pass_>=choice`` hands a pass of a ``family`` group to
    the triton family's adapter: our kernels asked for on a pass the library would serve with
    its own (FlashInfer's adapter runs our verify tiles itself)."""
    return (family != "triton" and choice in ("triton", "cuda")
            and not (family == "flashinfer" and pass_ == "verify"))


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
    page_order: Literal["shuffled", "in_order"] = "shuffled"
    """The allocators' free pages: `shuffled` (a random order, so index-space mix-ups show at
    once) or `in_order` (as an engine's allocator starts: full and SWA slots coincide until
    SWA eviction recycles a page, so such a mix-up shows only over time)."""
    check_rate: float = Field(default=1.0, ge=0, le=1)
    """Fraction of prefill attention calls compared with the oracle (decode, verify and draft
    calls, and calls right after an eviction, are always checked)."""
    layers: Literal["all", "subset"] = "all"
    """`subset`: attend two layers per layer group (every geometry), still driving every pool;
    the pools give rows to those layers only."""
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
    """What the command does, and the sizes of `generate`'s model (conf/run/generate.yaml)."""

    mode: Literal["plan", "conformance", "generate"] = "conformance"
    """`plan`: validate and print the plan, allocate nothing. `conformance`: the serving
    simulation with every checked attention output compared with the oracle. `generate`: greedy
    (speculative) generation with an HF model definition whose attention is the built backend,
    checked against transformers' own forward."""
    hidden_size: int = Field(default=64, ge=8)
    """`generate`: the model's hidden size (the attention heads and head dims stay the model's)."""
    intermediate_size: int = Field(default=128, ge=8)
    """`generate`: MLP (and each expert's) intermediate size."""
    num_layers: int | None = Field(default=6, ge=1)
    """`generate`: the first this many of the model's layers (their types kept); null = all."""
    num_experts: int = Field(default=4, ge=1)
    """`generate`, MoE models (GPT-OSS, Gemma 4 26B-A4B): experts per layer."""
    experts_per_token: int = Field(default=2, ge=1)
    """`generate`, MoE models: experts each token is routed to."""
    vocab_size: int = Field(default=256, ge=8)
    """`generate`: vocabulary size (prompts are drawn from it)."""
    init_std: float = Field(default=0.1, gt=0)
    """`generate`: HF `initializer_range` of the random weights: large enough that attention, not
    the token embedding alone, decides the next token."""
    max_position_embeddings: int = Field(default=8192, ge=16)
    """`generate`: RoPE table length; prompts and outputs must fit in it."""
    target_weights: Literal["random", "pretrained"] = "random"
    """`generate`: ``random``: the seeded random weights (their greedy continuations are close to
    chaotic, so no draft can learn them). ``pretrained``: those weights trained first on the
    built-in lag-copy language (`drafts.language`), cached on disk: a target whose text has
    structure a draft can learn, and which it can only predict by reading its K/V."""
    guards: bool = True
    """`generate`: false turns off the typed-space checks and the NaN poisoning of freed slots, as
    an engine that embedded only the kernels would run; faults must then show end to end."""
    overlap: bool = False
    """`generate`: run as sglang's overlap scheduler does: forward N+1 is planned and launched
    before forward N's tokens come back (a non-blocking copy into pinned memory and an event,
    one step late), so host-runs-ahead races show. A twin run without overlap gives the
    tokens/s to compare and must generate the same tokens."""
    oracle: bool = False
    """`generate`: also check the attention rows against the fp32 oracle, as the conformance run
    does (`swafactory.engine.oracle_watch`): each request's logical K/V history is kept beside
    the pools from what every forward writes, and the outputs of sampled passes (target extend,
    decode, verify, draft decode, draft extend, graph replays) are compared with attention over
    it; a row beyond the harness's tolerance fails the run, naming runner, mode, layer, request
    and error. Off by default (it keeps a copy of the K/V); conf/run/generate.yaml reads its
    default from the environment, SWAFACTORY_ORACLE=true (the test suite and the GPU suite)."""
    oracle_rate: float = Field(default=1.0, gt=0, le=1)
    """`generate` with ``oracle``: the fraction of passes checked past the first of each runner ×
    mode × eager/replay, which is always checked (seeded by ``workload.seed``)."""

    @model_validator(mode="after")
    def _experts(self) -> RunSpec:
        if self.experts_per_token > self.num_experts:
            raise FieldError("experts_per_token", f"{self.experts_per_token} exceeds "
                             f"num_experts={self.num_experts}")
        return self


class ParallelSpec(_Frozen):
    """How attention is spread over processes."""

    tp: int = Field(default=1, ge=1)
    """Tensor-parallel size: query and KV heads are sharded over this many ranks (torch.distributed;
    gloo on CPU, NCCL on GPUs). KV heads fewer than `tp` are replicated, as in vLLM."""


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
    parallel: ParallelSpec = ParallelSpec()
    """Tensor parallelism (one process by default)."""

    @model_validator(mode="after")
    def _generate_fits(self) -> SwaFactoryConfig:
        n, m = self.run.num_layers, self.model
        if self.run.mode == "generate" and n is not None and n > m.num_layers:
            raise FieldError("run.num_layers", f"{n} exceeds model.num_layers={m.num_layers} of "
                             f"model={m.name}; use run.num_layers≤{m.num_layers} or null (all)")
        if self.model.checkpoint and self.run.target_weights == "pretrained":
            raise FieldError("run.target_weights", "model.checkpoint loads trained weights; "
                             "run.target_weights=pretrained would train random ones. Drop one "
                             "of the two")
        w = self.spec.draft_weights
        if self.run.mode != "generate" and w != "target":
            raise FieldError("spec.draft_weights", f"draft weights ({w!r}) exist only in "
                             f"run=generate, which runs HF model code; run={self.run.mode} "
                             "serves attention alone. Add run=generate, or drop the override")
        return self

    @property
    def combination(self) -> str:
        """The combination as the overrides that select it."""
        return f"backend={self.backend.name} spec={self.spec.name} model={self.model.name}"
