"""The torch reference backend: exact fp32 gather + masked softmax over the plans."""
from __future__ import annotations

from swafactory.registry.capabilities import Capabilities

__all__ = ["CAPABILITIES"]

CAPABILITIES = Capabilities(
    name="torch",
    summary="fp32 gather + masked softmax over the same plans; the CPU default and the reference",
    kernel="torch fp32 gather+softmax",
    devices=frozenset({"cpu", "cuda"}),
    tree_masks=frozenset({"custom_mask", "cascade"}),
    sinks=True,
    sinks_note="sink logits join the softmax denominator",
    softcap=True,
    kv_dtypes=frozenset({"float32", "float16", "bfloat16"}),
)
