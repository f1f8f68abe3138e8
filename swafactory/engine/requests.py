"""What the generator keeps per request, and how it reads a logits row: the argmax, a near tie
between two tokens, and a chain's first rejected draft."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from swafactory.serving.readback import pinned_ids
from swafactory.engine.report_model import Rejection

__all__ = ["GenReq", "tie_tolerance", "logit_gap", "rejection", "argmax_tie", "pack_ids"]


def tie_tolerance(dtype: torch.dtype) -> float:
    """Two logits closer than this (relative to the row's largest |logit|) are an argmax tie:
    which one wins may differ between two correct runs (another batch shape, another kernel), so
    a divergence there is reported, not failed. fp32: 1e-5; 16-bit: 1e-2 (bf16 keeps 8 bits of
    mantissa, and the draft and verify forwards round differently)."""
    return 1e-5 if dtype == torch.float32 else 1e-2


@dataclass
class GenReq:
    """One request's progress (a `scheduler.Request`)."""

    rid: int
    prompt: list[int]
    out: int
    tokens: list[int] = field(default_factory=list)
    committed: int = 0
    accepts: list[int] = field(default_factory=list)
    logits: dict[int, torch.Tensor] = field(default_factory=dict)
    """Target logits at each position whose argmax gave the next token (fp32, on the host)."""
    ties: list[int] = field(default_factory=list)
    """Positions whose target argmax was a near tie (`tie_tolerance`)."""
    spec_at: list[int] = field(default_factory=list)
    """The committed length L at each spec step (its verified positions start there)."""
    draft_logits: dict[int, torch.Tensor] = field(default_factory=dict)
    """The draft's logits of its ``draft_extend`` rows (committed tokens), per position."""
    draft_trace: list = field(default_factory=list)
    """Every draft pass's rows as `draft_trace.TraceRow`s, in launch order (a run with a fault
    and its clean twin only: `draft_trace.first_difference` compares the two)."""
    rejections: list[Rejection] = field(default_factory=list)
    """Each chain step's first rejected draft (`Rejection`)."""
    plain: int = 0
    """Generated tokens that no spec step committed (the prefill's, a plain decode's)."""
    pending: int = 0
    """Generated tokens launched whose values are not back on the host yet (`run.overlap`)."""

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def prefilling(self) -> bool:
        return self.committed < len(self.prompt)

    @property
    def complete(self) -> bool:
        """Every token asked for is launched: counted on the host, values may be in flight."""
        return len(self.generated) + self.pending >= self.out

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt):]


def logit_gap(row: torch.Tensor, a: int, b: int) -> float:
    """How far token ``a`` leads token ``b`` in one [vocab] logits row (any float dtype),
    relative to its largest |logit| (at least 1): the scale of `tie_tolerance`."""
    row = row.double()
    return float(row[a] - row[b]) / max(1.0, float(row.abs().max()))


def rejection(step: int, pos: int, target: torch.Tensor, draft: torch.Tensor | None,
              draft_token: int) -> Rejection:
    """The `Rejection` at logits position ``pos``: target, draft: [vocab] logits rows there (the
    draft's None where it was not kept)."""
    t = int(target.argmax())
    return Rejection(step=step, position=pos, target_token=t, draft_token=draft_token,
                     target_gap=logit_gap(target, t, draft_token),
                     draft_gap=None if draft is None else logit_gap(draft, draft_token, t))


def argmax_tie(row: torch.Tensor, tie: float) -> tuple[int, bool]:
    """(argmax, near tie) of one logits row."""
    top = row.topk(2).values
    return int(row.argmax()), bool(top[0] - top[1] <= tie * max(1.0, float(row.abs().max())))


def pack_ids(pieces: list, device: torch.device) -> torch.Tensor:
    """[T] int64 input ids on ``device`` from host lists and device tensors, in order."""
    if all(isinstance(p, list) for p in pieces):
        return pinned_ids([t for p in pieces for t in p], device)
    return torch.cat([p if isinstance(p, torch.Tensor) else pinned_ids(p, device)
                      for p in pieces])
