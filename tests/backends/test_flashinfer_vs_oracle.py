"""The flashinfer adapter on a GPU (bf16 KV, FlashInfer's real kernels) against the fp32 oracle.

Same worlds as `test_backends_vs_oracle.py`: random page order, lengths straddling the window
edges, evicted (NaN-poisoned) SWA slots, Gemma 4's two geometries. Built through the registry
where it accepts the combination; sinks (GPT-OSS) go through the adapter directly, since the
registry still refuses them for flashinfer. Run on the GPU host:
``python3 -m pytest -q tests/backends/test_flashinfer_vs_oracle.py``.
"""
from __future__ import annotations

import pytest

from test_backends_vs_oracle import MODES, assert_close, run_mode
from test_flashinfer_host import adapter_world

pytestmark = pytest.mark.gpu
pytest.importorskip("flashinfer")

BF16 = 2e-2  # max abs error / max |ref| for bf16 K/V and q (observed ~3e-3)
D64 = ["model.swa.head_dim=64", "model.full.head_dim=64"]  # tiny's 16/32 are not compiled


def world(model, page, extra=(), **kw):
    return adapter_world(model, page, extra, device="cuda", kv_dtype="bfloat16", **kw)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("page", [1, 16])
def test_gemma4_every_mode(mode: str, page: int) -> None:
    w, cfg = world("gemma4", page, ["model.sliding_window=8"], via_registry=True)
    assert cfg.model.swa != cfg.model.full
    assert_close(run_mode(w, mode, [0, 5], 8), BF16)


@pytest.mark.parametrize("tree_mask", ["custom_mask", "cascade"])
@pytest.mark.parametrize("mode", ["verify_tree_2", "verify_tree_4", "draft_decode"])
def test_trees_through_both_strategies(mode: str, tree_mask: str) -> None:
    w, _ = world("tiny", 1, [*D64, "model.sliding_window=6"], tree_mask=tree_mask,
                 via_registry=True)
    checks = run_mode(w, mode, [0, 2], 6)
    assert (w.backend.plan.groups["swa"].cascade is not None) == (tree_mask == "cascade")
    assert_close(checks, BF16)


@pytest.mark.parametrize("model", ["mistral_7b", "gemma3_4b"])
def test_shipped_models_verify(model: str) -> None:
    w, _ = world(model, 1, ["model.sliding_window=7", "model.num_layers=4",
                            "model.softmax_scale=0.1"], via_registry=True)
    assert_close(run_mode(w, "verify_chain", [0, 1] if model != "mistral_7b" else [0], 7), BF16)


@pytest.mark.parametrize("mode", ["decode", "verify_tree_2"])
def test_softcap(mode: str) -> None:
    w, _ = world("tiny", 1, [*D64, "model.logit_softcap=2.0", "model.sliding_window=5"],
                 via_registry=True)
    assert_close(run_mode(w, mode, [0, 2], 5), BF16)


@pytest.mark.parametrize("tree_mask", ["custom_mask", "cascade"])
@pytest.mark.parametrize("mode", ["decode", "verify_chain", "verify_tree_2"])
def test_gpt_oss_sinks_by_lse_epilogue(mode: str, tree_mask: str) -> None:
    w, _ = world("gpt_oss_20b", 1, ["model.sliding_window=7", "model.num_layers=4"],
                 tree_mask=tree_mask)
    assert w.sinks, "gpt_oss_20b has attention sinks"
    assert_close(run_mode(w, mode, [0, 1], 7), BF16)
