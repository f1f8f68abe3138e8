"""swafactory's own Triton kernels: paged decode, paged extend/verify with tree masks, LSE merge."""
from __future__ import annotations

from swafactory.registry.capabilities import Capabilities

__all__ = ["CAPABILITIES", "Adapter"]

CAPABILITIES = Capabilities(
    name="triton",
    summary="own Triton kernels: split-KV paged decode, paged extend/verify with tree masks, LSE merge",
    kernel="triton paged decode/extend",
    devices=frozenset({"cuda"}),
    cpu_needs_interpreter=True,
    requires=(("triton", "swafactory[triton]"),),
    head_dims=frozenset({16, 32, 64, 128, 256, 512}),
    head_dim_note="tiles use power-of-two head dims from 16 to 512",
    tree_masks=frozenset({"custom_mask", "cascade"}),
    sinks=True,
    softcap=True,
    cuda_graph=True,  # every mode: static tables per bucket (`adapter.py`)
    graph_emulation=True,  # CPU under TRITON_INTERPRET=1: the contract over the same static tables
    kv_dtypes=frozenset({"float32", "float16", "bfloat16", "fp8_e4m3"}),
)


from swafactory.kernels.triton.adapter import Adapter  # noqa: E402 - it reads CAPABILITIES
