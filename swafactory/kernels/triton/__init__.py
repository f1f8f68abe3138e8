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
    cuda_graph=False,  # the kernels are capturable, but no graph-replay path is built yet
    kv_dtypes=frozenset({"float32", "float16", "bfloat16", "fp8_e4m3"}),
)


class Adapter:
    """Wires planner tables to the Triton kernels (`ops.paged_attention`); holds no pool logic."""

    capabilities = CAPABILITIES

    def run(self, tables, q, k_buf, v_buf, *, window, scale, softcap=None, sinks=None,
            lse: bool = True, k_scale: float = 1.0, v_scale: float = 1.0):
        """One pass → (o, lse); the kernel computes the LSE either way (``lse`` is a hint)."""
        from swafactory.kernels.triton.ops import paged_attention

        t = tables
        return paged_attention(q, k_buf, v_buf, t.qo_indptr, t.kv_indptr, t.kv_rows,
                               t.q_pos, t.kv_pos, mask=t.mask, mask_indptr=t.mask_indptr,
                               window=window, scale=scale, softcap=softcap, sinks=sinks,
                               max_q_len=t.max_q_len, k_scale=k_scale, v_scale=v_scale)

    def merge(self, o1, lse1, o2, lse2, sinks=None):
        """Cascade merge → o."""
        from swafactory.kernels.triton.merge import merge_attention_states

        return merge_attention_states(o1, lse1, o2, lse2, sinks)[0]
