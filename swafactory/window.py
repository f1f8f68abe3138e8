"""The one window convention, and every kernel parameter derived from it.

HF `sliding_window = W`: a query at position ``p`` sees the keys at positions ``p-W+1 … p``
(W keys, the current token included). ``None`` means no window. In verify and draft modes the
position is the tree node's own position (prefix length + depth), never its flattened index.
A sink (``spec.draft_sink = S``, sglang's windowed draft decode) keeps the keys at positions
``0 … S-1`` visible beside a window: ``p-W < k ≤ p`` or ``k < S`` (still causal).
"""
from __future__ import annotations

import torch

__all__ = ["visible", "in_window", "first_visible_pos", "flashinfer_window_left", "flash_attn_window_size",
           "kept_keys", "narrowed"]


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None,
            sink: int = 0) -> torch.Tensor:
    """Which keys each query may see by position: causal, and inside the window or the sink.

    q_pos: [nq] int; k_pos: [nk] int. Returns [nq, nk] bool.
    """
    d = q_pos[:, None] - k_pos[None, :]
    ok = d >= 0
    return ok if window is None else ok & (in_window(d, k_pos[None, :], window, sink))


def in_window(d: torch.Tensor, k_pos: torch.Tensor, window: int, sink: int = 0) -> torch.Tensor:
    """The window's part of visibility: query-to-key distance ``d`` below W, or (with a sink)
    the key's position ``k_pos`` below S; broadcasts."""
    inside = d < window
    return inside | (k_pos < sink) if sink else inside


def narrowed(window: int | None, draft_window: int | None) -> int | None:
    """A layer's window under a draft window (``spec.draft_window``): the narrower of the two; a
    draft window narrows a layer's own window, never widens it."""
    if draft_window is None:
        return window
    return draft_window if window is None else min(window, draft_window)


def first_visible_pos(q_pos: int, window: int | None) -> int:
    """Position of the oldest key a query at ``q_pos`` sees."""
    return 0 if window is None else max(0, q_pos - window + 1)


def kept_keys(seq_len: int, window: int | None) -> int:
    """Keys a decode query at position ``seq_len - 1`` sees: ``min(seq_len, W)``."""
    return seq_len if window is None else min(seq_len, window)


def flashinfer_window_left(window: int | None) -> int:
    """FlashInfer `window_left` (inclusive count of keys left of the query; -1 = none)."""
    return -1 if window is None else window - 1


def flash_attn_window_size(window: int | None) -> tuple[int | None, int]:
    """flash-attn-4 causal `window_size=(left, right)`; left None = unbounded (FA4 reads -1 as a
    bound, not as "none")."""
    return (None if window is None else window - 1, 0)
