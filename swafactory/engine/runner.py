"""One runner of the generator: an HF model whose attention is one `AttentionBackend`.

A forward packs the batch's query tokens into one sequence ``[1, T]`` with per-token
``position_ids`` (tree nodes at ``prefix + depth``), plans it once
(``backend.init_forward_metadata``), then calls the model with ``use_cache=False`` inside
`routing(backend)`: every attention module attends through the backend, which holds the K/V.
"""
from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

import torch

from swafactory.errors import SpaceError
from swafactory.integrations.transformers import ATTENTION, register, routing
from swafactory.metadata.batch import ForwardBatch, ForwardMode, ReqForward

__all__ = ["Runner", "NonFinite", "attn_implementation"]


class NonFinite(SpaceError):
    """The NaN guard: a forward's logits are not finite (a poisoned, freed or dummy slot was
    read). Only raised with ``run.guards=true``."""


@contextmanager
def attn_implementation(model, name: str):
    """Switch ``model`` (and its sub-configs) to the attention implementation ``name`` inside."""
    old = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield model
    finally:
        model.set_attn_implementation(old)


class Runner:
    """An HF model + the backend its attention runs through.

    writes: the runner writes its K/V (False: a FROZEN_KV draft). swap: ``(view, frozen_pool,
    dummy_pool)`` for a FROZEN_KV draft, whose view's active pool the engine swaps to the
    target's frozen view around each forward (sglang's runner does the same). guards: check
    every forward's logits for NaN/inf (the NaN guard; the pools are poisoned in check mode).
    """

    def __init__(self, name: str, model, backend, *, writes: bool = True, swap=None,
                 guards: bool = True) -> None:
        register()
        self.name, self.model, self.backend = name, model, backend
        self.writes, self.swap, self.guards = writes, swap, guards
        self.model.set_attn_implementation(ATTENTION)
        self.device = next(model.parameters()).device
        self.forwards = 0

    @torch.no_grad()
    def forward(self, mode: ForwardMode, reqs: Sequence[ReqForward], tokens: Sequence[int],
                positions: Sequence[int], req_to_token: torch.Tensor,
                full_id: str) -> torch.Tensor:
        """tokens, positions: [T] of the batch's query rows, request by request. Returns the
        logits [T, vocab] fp32."""
        batch = ForwardBatch.of(mode, reqs, req_to_token, full_id)
        if batch.total_q != len(tokens):
            raise ValueError(f"{self.name} {mode}: {len(tokens)} tokens for {batch.total_q} queries")
        if self.swap is not None:
            view, frozen, _ = self.swap
            view.active_pool = frozen  # the engine swaps the target's frozen view in
        try:
            self.backend.init_forward_metadata(batch)
            ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
            pos = torch.tensor([list(positions)], dtype=torch.long, device=self.device)
            with routing(self.backend, writes=self.writes):
                out = self.model(input_ids=ids, position_ids=pos, use_cache=False)
        finally:
            if self.swap is not None:
                view.active_pool = self.swap[2]
        self.forwards += 1
        logits = out.logits[0].float()
        if self.guards and not bool(torch.isfinite(logits).all()):
            raise NonFinite(f"{self.name} {mode}: non-finite logits (a poisoned, freed or dummy "
                            "slot was read)")
        return logits
