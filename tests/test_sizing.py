"""Hybrid bytes per request against full-only, pinned to values computed by hand from the HF numbers."""
from __future__ import annotations

import pytest

import swafactory
from swafactory.kvcache.sizing import pool_sizing

K = 1024


def _hand(n_full, full_tok_bytes, n_swa, swa_tok_bytes, keep, ctx):
    hybrid = n_full * full_tok_bytes * ctx + n_swa * swa_tok_bytes * min(ctx, keep)
    return hybrid, (n_full * full_tok_bytes + n_swa * swa_tok_bytes) * ctx


# (model, spec, n_full, K+V bytes/token/layer full, n_swa, swa bytes, SWA tokens kept per request)
CASES = {
    # bf16; full 2·4·512·2 = 8192 B, swa 2·16·256·2 = 16384 B; eagle3 keeps 1024 + 12 + 1
    "gemma4": ("eagle3", 10, 8192, 50, 16384, 1024 + 12 + 1),
    # bf16; 2·8·64·2 = 2048 B for both groups; no spec keeps 128 + 0 + 1
    "gpt_oss_120b": ("none", 18, 2048, 18, 2048, 128 + 1),
    # bf16; 2·8·128·2 = 4096 B; every layer slides; W = 4096, nextn draft 2 tokens
    "mistral_7b": ("nextn", 0, 0, 32, 4096, 4096 + 2 + 1),
}


@pytest.mark.parametrize("ctx", [8 * K, 32 * K, 128 * K])
@pytest.mark.parametrize("model", sorted(CASES))
def test_hybrid_bytes_per_request_equal_the_analytic_values(model: str, ctx: int) -> None:
    spec, n_full, bf, n_swa, bs, keep = CASES[model]
    cfg = swafactory.compose([f"model={model}", f"spec={spec}", "backend=auto",
                              f"workload.context_len={ctx}"])
    s = pool_sizing(cfg)
    hybrid, full_only = _hand(n_full, bf, n_swa, bs, keep, ctx)
    assert (s.hybrid_bytes_per_request, s.full_only_bytes_per_request) == (hybrid, full_only)
    plan = swafactory.plan_summary(cfg, swafactory.DeviceInfo("cpu"))
    assert (plan.hybrid_bytes_per_request, plan.full_only_bytes_per_request) == (hybrid, full_only)


def test_gemma3_keeps_every_token_because_its_pool_is_not_split() -> None:
    cfg = swafactory.compose(["model=gemma3_4b", "spec=none"])
    s = pool_sizing(cfg)
    assert s.hybrid_bytes_per_request == s.full_only_bytes_per_request
