"""Logical histories: sliding-window rows no later query can see are dropped, exactly."""
from __future__ import annotations

import pytest
import torch

import swafactory
from swafactory.harness.history import History
from swafactory.harness.loop import Loop


def test_dropped_rows_are_gone_and_kept_rows_are_unchanged() -> None:
    h = History()
    k = torch.arange(100.0).view(100, 1, 1)
    h.record(0, 0, k, -k)
    h.drop_before(0, 40)
    start, keys, values = h.kv_from(0, 90)
    assert start == 40 and torch.equal(keys[:, 0, 0], torch.arange(40.0, 90.0))
    assert torch.equal(values, -keys)
    with pytest.raises(IndexError, match="dropped its first 40"):
        h.kv(0, 90)
    with pytest.raises(IndexError, match="were dropped"):
        h.record(0, 39, k[:1], k[:1])
    h.record(0, 95, torch.full((200, 1, 1), 7.0), torch.zeros(200, 1, 1))  # grows past the view
    start, keys, _ = h.kv_from(0, 295)
    assert start == 40 and keys.shape[0] == 255 and keys[54, 0, 0] == 94 and keys[55, 0, 0] == 7
    h.pos = list(range(295))
    h.reorder_tail(93, [0, 2])
    assert h.kv_from(0, 95)[1][-2:, 0, 0].tolist() == [93.0, 7.0]


def _run(monkeypatch, margin: int):
    calls = []
    real = Loop._trim_histories

    def spy(self):
        for hists in (self.hist_t, self.hist_d):
            for h in hists.values():
                def drop(layer, start, h=h):
                    calls.append(start)
                    History.drop_before(h, layer, start + margin)
                h.drop_before = drop
        real(self)

    monkeypatch.setattr(Loop, "_trim_histories", spy)
    cfg = swafactory.compose(["backend=torch", "workload=smoke", "spec=frozen_kv_mtp",
                              "model=gpt_oss_20b"])
    return swafactory.run(cfg), calls


def test_a_serve_loop_drops_window_rows_and_stays_exact(monkeypatch) -> None:
    report, calls = _run(monkeypatch, margin=0)
    assert report.status == "ok", report.mismatch
    assert max(calls) > 0, "no sliding-window history row was ever dropped"


def test_dropping_one_row_too_many_is_caught_by_the_oracle(monkeypatch) -> None:
    """Two rows past the rule drop a key the last window still sees: the oracle then disagrees
    with the backend, so a wrong drop can never pass silently."""
    report, _ = _run(monkeypatch, margin=2)
    assert report.status == "failed" and report.mismatch.check == "oracle"
