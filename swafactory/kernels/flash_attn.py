"""flash-attn-4 (CuTe DSL): varlen paged attention; trees through cascade + LSE merge."""
from __future__ import annotations

from swafactory.registry.capabilities import Capabilities

__all__ = ["CAPABILITIES"]

CAPABILITIES = Capabilities(
    name="flash_attn",
    summary="flash-attn-4 flash_attn_varlen_func with page_table/seqused_k; trees via cascade",
    kernel="flash-attn-4 varlen (cute)",
    devices=frozenset({"cuda"}),
    cuda_archs=frozenset({90, 100, 103}),
    arch_note="flash-attn-4's CuTe kernels target Hopper and Blackwell",
    requires=(("flash_attn.cute", "swafactory[flash-attn]"),),
    max_head_dim=256,
    head_dim_note="flash-attn-4 refuses head_dim > 256 on SM90 ('head_dim must be between 8 and 256')",
    tree_masks=frozenset({"cascade"}),
    paged_trees=False,
    sinks=True,
    sinks_note="learnable_sink",
    softcap=True,
    cuda_graph=True,
    kv_dtypes=frozenset({"float16", "bfloat16"}),
)
