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
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

__all__ = ["ATTENTION", "register", "routing", "Route", "swafactory_attention"]

ATTENTION = "swafactory"
"""The name to pass as ``attn_implementation``."""


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
    if backend.guards and sliding_window != window:  # guards off: bare kernels compare nothing
        raise ValueError(f"layer {layer}: the model's sliding_window is {sliding_window}, the "
                         f"plan's window is {window}: the engine's config disagrees with the model")
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
