"""torch FlexAttention: block masks for window and tree; the page size is the KV block size."""
from __future__ import annotations

from swafactory.registry.capabilities import Capabilities

__all__ = ["CAPABILITIES"]

CAPABILITIES = Capabilities(
    name="flex",
    summary="torch FlexAttention with paged block masks (mask_mod for window, tree and DFlash block)",
    kernel="FlexAttention (paged block mask)",
    devices=frozenset({"cuda"}),
    page_sizes=frozenset({16, 32, 64, 128}),
    max_head_dim=256,
    head_dim_note="swafactory caps FlexAttention at head_dim 256 until a larger one is verified on a GPU",
    tree_masks=frozenset({"custom_mask"}),
    sinks=True,
    sinks_note="sinks are applied by rescaling with the returned LSE",
    softcap=True,
    kv_dtypes=frozenset({"float32", "float16", "bfloat16"}),
)
