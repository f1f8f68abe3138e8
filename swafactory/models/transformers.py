"""swafactory as a transformers attention implementation (transformers 5.x, the `models` extra).

`register()` adds ``"swafactory"`` to ``transformers.AttentionInterface``. A model loaded or
switched to ``attn_implementation="swafactory"`` then calls `swafactory_attention` from each of its
attention modules with its own q, k and v: after RoPE, QK-norm and whatever the model code does.
The function is a thin adapter; it never plans:

* the engine plans the forward once (``backend.init_forward_metadata(batch)``) and binds the
  runner with `routing(backend, writes=…)` around the model call;
* each layer maps HF's ``[1, H, S, D]`` (one packed sequence of the batch's query rows, request
  by request) to the backend's ``[S, H, D]``, passes the module's sinks (GPT-OSS
  ``module.sinks``, given as ``s_aux``), and calls ``backend.forward(q, k, v, layer_id)``;
* the soft-cap, scale and window the module asks for must be the ones the backend planned
  (they come from one config): a disagreement raises instead of attending differently.

HF keeps no cache here (call the model with ``use_cache=False``): swafactory's pools hold K/V.
No attention mask is built either: the name is not registered with ``AttentionMaskInterface``,
so transformers passes ``attention_mask=None`` and the plan carries the structure.
"""
from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

from swafactory.window import narrowed

__all__ = ["ATTENTION", "WINDOWED_EAGER", "register", "routing", "Route", "swafactory_attention",
           "window_draft", "windowed_eager", "eager_name"]

ATTENTION = "swafactory"
"""The name to pass as ``attn_implementation``."""
WINDOWED_EAGER = "swafactory_eager_windowed"
"""transformers' eager attention under a draft window (`windowed_eager`): the reference a
windowed draft's logits are checked against."""


@dataclass(frozen=True)
class Route:
    """The runner the next model call attends through."""

    backend: object
    """An `AttentionBackend` whose `init_forward_metadata` ran for this forward."""
    writes: bool = True
    """False for a runner that writes no K/V (a FROZEN_KV draft reads the target's)."""
    layers: Mapping[int, int] = field(default_factory=dict)
    """HF ``layer_idx`` → backend layer id; missing ids map to themselves."""


_ROUTE: ContextVar[Route | None] = ContextVar("swafactory_route", default=None)


@contextmanager
def routing(backend, *, writes: bool = True,
            layers: Mapping[int, int] | None = None) -> Iterator[Route]:
    """Attend through ``backend`` inside the block (per model call; nests, thread-safe)."""
    route = Route(backend, writes, dict(layers or {}))
    token = _ROUTE.set(route)
    try:
        yield route
    finally:
        _ROUTE.reset(token)


def _same(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return math.isclose(a, b, rel_tol=1e-6)


def swafactory_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, attention_mask: torch.Tensor | None,
                         dropout: float = 0.0, scaling: float | None = None,
                         sliding_window: int | None = None, softcap: float | None = None,
                         s_aux: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature. query: [1, Hq, S, D]; key, value:
    [1, Hkv, S, D] (this forward's new tokens). Returns ([1, S, Hq, D] in query's dtype, None)."""
    del attention_mask, kwargs  # the plan holds the structure; HF's extra kwargs are not needed
    route = _ROUTE.get()
    if route is None:
        raise RuntimeError("swafactory attention was called outside `routing(backend)`: the "
                           "engine plans a forward and binds its runner around the model call")
    if query.shape[0] != 1:
        raise ValueError(f"swafactory attention takes one packed sequence [1, H, S, D]; got batch "
                         f"{query.shape[0]} (pack the requests with per-token position_ids)")
    if dropout:
        raise ValueError(f"swafactory attention serves inference only; dropout={dropout}")
    backend = route.backend
    layer = route.layers.get(module.layer_idx, module.layer_idx)
    plan = backend.plan
    n = query.shape[2]
    if n != plan.total_q:
        raise ValueError(f"layer {layer}: the model passed {n} query rows but the forward was "
                         f"planned for {plan.total_q}")
    window = plan.group(layer).window
    # a windowed draft (spec.draft_window, `window_draft`) narrows the module's own window
    sliding_window = narrowed(sliding_window, getattr(module, "draft_window", None))
    if backend.guards and sliding_window != window:  # guards off: bare kernels compare nothing
        raise ValueError(f"layer {layer}: the model's sliding_window is {sliding_window}, the "
                         f"plan's window is {window}: the engine's config disagrees with the model")
    sink = getattr(module, "draft_sink", 0) if sliding_window is not None else 0
    if backend.guards and sink != plan.group(layer).sink:
        raise ValueError(f"layer {layer}: the model's draft sink is {sink} keys, the plan's "
                         f"{plan.group(layer).sink} (spec.draft_sink): the engine's config "
                         "disagrees with the model")
    scale = backend.layer_scale(layer)
    if scaling is not None and not _same(float(scaling), scale):
        raise ValueError(f"layer {layer}: the model scales scores by {scaling}, the backend by "
                         f"{scale} (model.softmax_scale)")
    if not _same(softcap, backend.softcap):
        raise ValueError(f"layer {layer}: the model's soft-cap is {softcap}, the backend's "
                         f"{backend.softcap} (model.logit_softcap)")
    sinks = s_aux if s_aux is not None else getattr(module, "sinks", None)
    q = query[0].transpose(0, 1).contiguous()                       # [S, Hq, D]
    k = v = None
    if route.writes:
        k = key[0].transpose(0, 1).contiguous()
        v = value[0].transpose(0, 1).contiguous()
    out = backend.forward(q, k, v, layer, save_kv=route.writes,
                          sinks=None if sinks is None else sinks.detach().float())
    return out.to(query.dtype).unsqueeze(0), None


def register(name: str = ATTENTION,
             fn: Callable[..., tuple[torch.Tensor, None]] = swafactory_attention) -> str:
    """Register ``fn`` under ``name`` with transformers' `AttentionInterface` (idempotent);
    returns the name. Raises ImportError naming the extra when transformers is missing."""
    try:
        from transformers import AttentionInterface
    except ImportError as exc:  # pragma: no cover - the extra's message
        raise ImportError("swafactory's transformers integration needs transformers 5.x: "
                          "pip install 'swafactory[models]'") from exc
    AttentionInterface.register(name, fn)
    return name


def window_draft(model: torch.nn.Module, draft_window: int | None,
                 draft_sink: int = 0) -> torch.nn.Module:
    """Give a draft model's attention modules ``spec.draft_window`` (and its sink,
    ``spec.draft_sink``: the first keys stay visible): `swafactory_attention` narrows each
    module's own window to it (a full-attention layer then slides). Returns the model;
    ``None`` leaves it as it is."""
    if draft_window is not None:
        for mod in model.modules():
            if hasattr(mod, "layer_idx") and hasattr(mod, "q_proj"):
                mod.draft_window, mod.draft_sink = draft_window, draft_sink
    return model


def windowed_eager(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, attention_mask: torch.Tensor | None, **kwargs):
    """The module's own transformers eager attention (its modeling file's
    ``eager_attention_forward``), its mask narrowed by the module's ``draft_window``, and the
    first ``draft_sink`` keys kept visible to every later query (the mask rebuilt causal there).

    For a forward of a whole sequence from position 0 (no cache): query row i is position
    ``kv - q + i``, key column j position j. query: [B, Hq, q, D]; key, value: [B, Hkv, kv, D];
    attention_mask: [B, 1, q, kv] bool (True: attend) or additive float, or None (causal)."""
    eager = sys.modules[type(module).__module__].eager_attention_forward
    w = getattr(module, "draft_window", None)
    if w is not None:
        q, kv = query.shape[-2], key.shape[-2]
        qp = torch.arange(kv - q, kv, device=query.device)[:, None]
        kp = torch.arange(kv, device=query.device)[None, :]
        band = (qp - kp < w) & (kp <= qp)
        sink = (kp < getattr(module, "draft_sink", 0)) & (kp <= qp)
        if sink.any():  # the sink's keys past the module's own window too: rebuilt, causal
            band, attention_mask = band | sink, None
        if attention_mask is None:
            attention_mask = torch.zeros(q, kv, dtype=query.dtype, device=query.device)
            attention_mask = attention_mask.masked_fill(~band, torch.finfo(query.dtype).min)[None, None]
        elif attention_mask.dtype == torch.bool:
            attention_mask = attention_mask & band
        else:
            attention_mask = attention_mask.masked_fill(~band, torch.finfo(attention_mask.dtype).min)
    return eager(module, query, key, value, attention_mask, **kwargs)


def eager_name(model: torch.nn.Module) -> str:
    """The eager attention to check ``model`` against: `WINDOWED_EAGER` (registered here) for
    a draft `window_draft` narrowed, else transformers' ``eager``."""
    if any(getattr(m, "draft_window", None) is not None for m in model.modules()):
        return register(WINDOWED_EAGER, windowed_eager)
    return "eager"
