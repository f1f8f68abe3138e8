"""Device steps the decode and extend stage-1 kernels share: the soft cap, the online-softmax
rescale and update, the sink's merge and the closing normalisation, one copy of each rule.

A row's running state is (m, den, acc): its max score, the sum of e^(s - ref) and the weighted
sum of V rows, where ref is m with -inf read as 0 (a row that has seen no key stays all zero,
never NaN from -inf - -inf). The kernels inline these (Triton inlines every ``@triton.jit`` call).

triton is imported here, so this module is imported only inside the kernels' ``_kernel``
factories (CPU installs may lack triton). Its helpers are decorated once, at that first import,
so ``TRITON_INTERPRET`` is fixed from then on (the tests set it before importing triton). The
kernels reach them as ``online.<name>``, a module global: the interpreter resolves a kernel's
names in its module, not in the factory's closure.
"""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["tanh_cap", "online_max", "accumulate", "add_sink", "normalize"]


@triton.jit
def tanh_cap(s, cap):
    """cap·tanh(s/cap), tanh written with exp (portable to the interpreter)."""
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * s / cap) + 1.0))


@triton.jit
def online_max(m, row_max):
    """(m_new, ref, alpha): the new running max, the reference the probabilities are taken
    against (0 while the row has seen nothing) and the factor that rescales the old state."""
    m_new = tl.maximum(m, row_max)
    ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - ref)
    return m_new, ref, alpha


@triton.jit
def accumulate(den, acc, alpha, p, v, PRECISION: tl.constexpr):
    """(den, acc) rescaled by alpha, plus one key tile's probabilities p [rows, keys] and V."""
    den = den * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return den, acc


@triton.jit
def add_sink(sinks_ptr, heads, rows, m, den, acc):
    """(m, den, acc) with each head's sink logit in the denominator (no V row): a one-split
    kernel finishes the softmax itself; with splits, stage 2 adds it once instead."""
    sk = tl.load(sinks_ptr + heads, mask=rows, other=float("-inf")).to(tl.float32)
    m_new, ref, alpha = online_max(m, sk)
    acc = acc * alpha[:, None]
    den = den * alpha + tl.exp(sk - ref)
    return m_new, den, acc


@triton.jit
def normalize(m, den, acc, poisoned=None):
    """(o, lse) of a row state: o = acc/den, and 0 with lse -inf where no key was seen; NaN in
    the rows where ``poisoned`` > 0 (extend's count of non-finite V rows a row saw)."""
    ref = tl.where(m == float("-inf"), 0.0, m)
    ok = den != 0  # NaN stays NaN: a visible stale read must show
    o = tl.where(ok[:, None], acc / tl.where(ok, den, 1.0)[:, None], 0.0)
    if poisoned is not None:
        o = tl.where(poisoned[:, None] > 0, float("nan"), o)
    lse = tl.where(ok, ref + tl.log(tl.where(ok, den, 1.0)), float("-inf"))
    return o, lse
