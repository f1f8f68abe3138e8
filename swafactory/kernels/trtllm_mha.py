"""TensorRT-LLM MHA (trtllm-gen) kernels. Declared for validation only: it needs SM100."""
from __future__ import annotations

from swafactory.registry.capabilities import Capabilities

__all__ = ["CAPABILITIES"]

CAPABILITIES = Capabilities(
    name="trtllm_mha",
    summary="trtllm-gen fmha kernels (Blackwell); declared so the registry can refuse it with reasons",
    kernel="trtllm-gen fmha",
    devices=frozenset({"cuda"}),
    cuda_archs=frozenset({100, 103}),
    arch_note="trtllm-gen fmha kernels are built for SM100/SM103 (Blackwell) only",
    requires=(("flashinfer", "swafactory[flashinfer]"),),
    page_sizes=frozenset({16, 32, 64, 128}),
    head_dims=frozenset({64, 128, 256, 512}),
    tree_masks=frozenset(),
    non_causal_draft=False,
    sinks=True,
    softcap=True,
    cuda_graph=True,
    kv_dtypes=frozenset({"float16", "bfloat16", "fp8_e4m3"}),
)
