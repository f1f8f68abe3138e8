"""What the model's config makes part of every layer's call, raised in the caller's terms: the
attention sinks `forward` must (or must not) get, and the ``full_id`` a `ForwardBatch` names.

Both are host facts (a None test, a string compare), checked once per call with guards on: a
sink logit dropped or added changes every output silently, and a wrong ``full_id`` otherwise
surfaces as a translation's `SpaceError` about "locations of" an id the caller never chose."""
from __future__ import annotations

import torch

from swafactory.errors import SpaceError
from swafactory.guards import CallError

__all__ = ["sinks_expected", "sinks_error", "full_id_error", "full_space_of"]


def sinks_expected(model, role: str) -> bool | None:
    """Whether a runner's layers take ``sinks=``: ``model.attention_sinks`` for the target's
    layers and a FROZEN_KV draft's (it reads target layers); an own-pool draft of a model with
    sinks is a model of its own the config does not describe (an EAGLE head has none, a copy of
    the target has them), so None: either is accepted."""
    want = bool(model.attention_sinks)
    return None if want and role == "draft_own_pool" else want


def sinks_error(layer_id: int, mode: str, model, q_heads: int, sinks,
                want: bool | None) -> CallError | None:
    """The error of a `forward` whose ``sinks`` disagree with ``want`` (`sinks_expected`; None:
    they agree, or either is accepted). model: the runner's `ModelSpec` (named in the message);
    q_heads: this rank's query heads."""
    if want is None or (sinks is not None) == want:
        return None
    shape = f"[{q_heads}] fp32 (one learned logit per query head)"
    if want:
        return CallError(
            f"{mode} layer {layer_id}: model {model.name!r} has attention sinks "
            f"(model.attention_sinks=true) but forward got no sinks=: pass the layer's sink "
            f"logits as forward(q, k, v, layer, sinks=...) with shape {shape}, e.g. "
            "self_attn.sinks.float(); without them every output is wrong")
    got = (f"{list(sinks.shape)} {str(sinks.dtype).removeprefix('torch.')}"
           if isinstance(sinks, torch.Tensor) else type(sinks).__name__)
    return CallError(
        f"{mode} layer {layer_id}: model {model.name!r} has no attention sinks "
        f"(model.attention_sinks=false) but forward got sinks= ({got}; a model with sinks "
        f"takes {shape}): drop sinks=, or set model.attention_sinks=true if this model "
        "really has them")


def full_space_of(pool) -> str | None:
    """The full index space ``pool``'s slots are addressed in: its full sub-pool's owner, else
    (an all-SWA pool, its full space virtual) its mapping's; None when it names none."""
    full = getattr(pool, "full", None)
    if full is not None:
        return full.indexed_by
    mapping = getattr(pool, "mapping", None)
    return None if mapping is None else mapping.full_id


def full_id_error(batch, pool) -> SpaceError | None:
    """The error of a `ForwardBatch` whose ``full_id`` is not the full index space of the pool
    the runner reads (None: it is, or the pool names none)."""
    known = full_space_of(pool)
    if known is None or batch.full_id == known:
        return None
    return SpaceError(
        f"ForwardBatch full_id={batch.full_id!r} is not the full index space of this runner's "
        f"pool {getattr(pool, 'name', '?')!r}, which addresses req_to_token's slots in "
        f"{known!r} (the one full_id it knows). Pass the allocator's id: ForwardBatch.of(mode, "
        f"reqs, req_to_token, allocator.full_id), i.e. RequestSlots.allocator.full_id")
