"""A run's draft rows against its clean twin's: the first request, spec step, mode and row where
they part, at any size of difference the tolerance does not allow."""
from __future__ import annotations

import math

import pytest
import torch

from swafactory.engine.draft_trace import TOP, fingerprint, first_difference

VOCAB = 64


def _trace(seed: int, steps: int) -> list:
    """A request's passes: per spec step a 3-row draft_decode and a 2-row draft_extend."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(steps):
        out.append(fingerprint(s, "draft_decode", torch.randn(3, VOCAB, generator=g)))
        out.append(fingerprint(s, "draft_extend", torch.randn(2, VOCAB, generator=g)))
    return out


def _rows(seed: int, steps: int) -> dict[int, torch.Tensor]:
    return {0: _trace(seed, steps), 1: _trace(seed + 1, steps)}


def test_a_row_keeps_its_top_logits_largest_first() -> None:
    rows = torch.randn(4, VOCAB)
    t = fingerprint(2, "draft_decode", rows)
    assert t.ids.shape == t.values.shape == (4, TOP)
    assert torch.equal(t.ids[:, 0], rows.argmax(-1))
    assert (t.values[:, :-1] >= t.values[:, 1:]).all()
    assert fingerprint(0, "draft_extend", torch.randn(1, 3)).ids.shape == (1, 3)  # vocab < TOP


def test_equal_runs_have_no_difference() -> None:
    assert first_difference(_rows(0, 5), _rows(0, 5), 1e-5) is None


@pytest.mark.parametrize(("change", "said"), [
    ("token", "top-1 token"),
    ("value", "logits"),
    ("nan", "nan"),
])
def test_the_earliest_step_is_named_over_every_request(change: str, said: str) -> None:
    twin, mine = _rows(0, 6), _rows(0, 6)
    late = mine[0][2 * 4]  # request 0, spec step 4, draft_decode
    mine[0][2 * 4] = type(late)(late.step, late.mode, late.ids.flip(-1), late.values)
    early = mine[1][2 * 2 + 1]  # request 1, spec step 2, draft_extend row 1
    ids, values = early.ids.clone(), early.values.clone()
    if change == "token":
        ids[1, 0] = (ids[1, 0] + 1) % VOCAB
    elif change == "value":
        values[1, 3] += 1e-3 * values.abs().max()
    else:
        values[1, 0] = math.nan
    mine[1][2 * 2 + 1] = type(early)(early.step, early.mode, ids, values)
    got = first_difference(mine, twin, 1e-5)
    assert got is not None and got.startswith("request 1 spec step 2, draft_extend row 1"), got
    assert said in got
    assert first_difference(mine, twin, 1.0) is not None  # the token flip at step 4 stays


def test_a_difference_inside_the_tolerance_is_equal() -> None:
    twin, mine = _rows(0, 3), _rows(0, 3)
    t = mine[0][1]
    mine[0][1] = type(t)(t.step, t.mode, t.ids, t.values * (1 + 1e-7))
    assert first_difference(mine, twin, 1e-5) is None


def test_a_pass_only_one_run_made_is_named() -> None:
    twin, mine = _rows(0, 4), _rows(0, 4)
    del mine[0][5:]
    got = first_difference(mine, twin, 1e-5)
    assert got == "request 0 spec step 2: a draft_extend pass only the clean twin made", got
    mine = _rows(0, 4)
    t = mine[1][2]
    mine[1][2] = fingerprint(t.step, "draft_decode", torch.randn(5, VOCAB))
    got = first_difference(mine, twin, 1e-5)
    assert got is not None and "a draft_decode pass of 5 rows where the twin ran" in got, got
