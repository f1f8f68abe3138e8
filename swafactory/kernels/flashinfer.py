"""FlashInfer: BatchDecode / BatchPrefill (custom mask) wrappers, one per layer group."""
from __future__ import annotations

from swafactory.registry.capabilities import Capabilities

__all__ = ["CAPABILITIES"]

CAPABILITIES = Capabilities(
    name="flashinfer",
    summary="FlashInfer paged decode + prefill with custom tree masks; one wrapper per layer group",
    kernel="FlashInfer BatchDecode/BatchPrefill",
    devices=frozenset({"cuda"}),
    cuda_archs=frozenset({80, 86, 89, 90, 100, 103, 120}),
    arch_note="FlashInfer's FA2/FA3 templates (SM80+)",
    requires=(("flashinfer", "swafactory[flashinfer]"),),
    head_dims=frozenset({64, 128, 256, 512}),
    head_dim_note="FlashInfer compiles head dims 64, 128, 256 and 512",
    tree_masks=frozenset({"custom_mask"}),
    sinks=False,
    sinks_note="FlashInfer serves sinks only through the trtllm-gen kernels of SM100",
    softcap=True,
    cuda_graph=True,
    kv_dtypes=frozenset({"float16", "bfloat16", "fp8_e4m3"}),
)
