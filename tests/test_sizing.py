"""Sizing: hybrid bytes per request against full-only (values counted by hand from the HF
numbers), the one per-request SWA statement against real slot bookkeeping, and `size_pools`."""
from __future__ import annotations

import itertools
import math
import random

import pytest

import swafactory
from swafactory.errors import ConfigError
from swafactory.kvcache import size_pools
from swafactory.kvcache.sizing import pool_sizing, step_nodes, swa_tokens_per_request

K = 1024


def _hand(n_full, full_tok_bytes, n_swa, swa_tok_bytes, keep, ctx):
    hybrid = n_full * full_tok_bytes * ctx + n_swa * swa_tok_bytes * min(ctx, keep)
    return hybrid, (n_full * full_tok_bytes + n_swa * swa_tok_bytes) * ctx


# (model, spec, n_full, K+V bytes/token/layer full, n_swa, swa bytes, SWA tokens kept per request)
# SWA kept = W + step nodes + eviction interval (1) + page (1) + 1, then one more page (page 1,
# so no rounding): swafactory.kvcache.sizing.swa_tokens_per_request, counted by hand.
CASES = {
    # bf16; full 2·4·512·2 = 8192 B, swa 2·16·256·2 = 16384 B; eagle3 tree 1 + 4·3 = 13 nodes
    "gemma4": ("eagle3", 10, 8192, 50, 16384, 1024 + 13 + 1 + 1 + 1 + 1),
    # bf16; 2·8·64·2 = 2048 B for both groups; no spec: a decode adds 1 token
    "gpt_oss_120b": ("none", 18, 2048, 18, 2048, 128 + 1 + 1 + 1 + 1 + 1),
    # bf16; 2·8·128·2 = 4096 B; every layer slides; W = 4096, nextn verifies 2 tokens
    "mistral_7b": ("nextn", 0, 0, 32, 4096, 4096 + 2 + 1 + 1 + 1 + 1),
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


@pytest.mark.parametrize("model", sorted(CASES))
def test_fp8_kv_halves_every_byte_figure_of_bf16(model: str) -> None:
    spec, n_full, bf, n_swa, bs, keep = CASES[model]
    hybrid, full_only = _hand(n_full, bf // 2, n_swa, bs // 2, keep, 32 * K)
    cfg = swafactory.compose([f"model={model}", f"spec={spec}", "backend=torch",
                              "backend.kv_dtype=fp8_e4m3", f"workload.context_len={32 * K}"])
    s = pool_sizing(cfg)
    assert (s.hybrid_bytes_per_request, s.full_only_bytes_per_request) == (hybrid, full_only)
    plan = swafactory.plan_summary(cfg, swafactory.DeviceInfo("cpu"))
    assert plan.kv_dtype == "fp8_e4m3" and plan.hybrid_bytes_per_request == hybrid


def test_gemma3_keeps_every_token_because_its_pool_is_not_split() -> None:
    cfg = swafactory.compose(["model=gemma3_4b", "spec=none"])
    s = pool_sizing(cfg)
    assert s.hybrid_bytes_per_request == s.full_only_bytes_per_request


# ------------------------------------------------------------ the one per-request SWA statement
def _peak_swa(W: int, P: int, I: int, chunk: int, nodes: int, reread: int, seed: int) -> int:
    """SWA slots one request holds at its peak, from real `RequestSlots` bookkeeping: a prompt
    prefilled in ``chunk``s, then spec steps of ``nodes`` truncated to a random accepted length,
    with eviction after every forward (FROZEN_KV: ``reread`` keeps position L-1 readable)."""
    from swafactory.kvcache.allocator import SWAAllocator
    from swafactory.kvcache.pool import ReqToToken
    from swafactory.kvcache.requests import RequestSlots

    rng = random.Random(seed)
    prompt, steps = 3 * W + 2 * chunk + 5 + seed, 40
    cap = (prompt + steps * nodes) // P * P + 4 * P
    alloc = SWAAllocator(cap, cap, P)
    slots = RequestSlots(alloc, ReqToToken(1, cap))
    slots.open(0)
    L = top = 0
    while L < prompt:
        L_next = min(L + chunk, prompt)
        slots.extend(0, L_next - L)
        top, L = max(top, alloc.swa.used_size()), L_next
        slots.evict_out_of_window(0, L - (reread if L == prompt else 0), W, I)
    for _ in range(steps):
        slots.extend(0, nodes)
        top = max(top, alloc.swa.used_size())
        L += rng.randint(1, nodes)
        slots.truncate(0, L)
        slots.evict_out_of_window(0, L - reread, W, I)
    return top


@pytest.mark.parametrize("W,P,I", [(5, 1, 1), (16, 1, 3), (5, 4, 1), (16, 4, 3), (16, 4, 9)])
def test_swa_tokens_per_request_bounds_what_request_slots_holds(W: int, P: int, I: int) -> None:
    for (chunk, nodes), reread in itertools.product([(1, 1), (7, 4), (3, 13)], (0, 1)):
        top = max(_peak_swa(W, P, I, chunk, nodes, reread, s) for s in range(2))
        bound = swa_tokens_per_request(W, max(chunk, nodes), P, I)
        assert bound % P == 0
        assert top <= bound, (W, P, I, chunk, nodes, reread, top, bound)
        assert bound - top <= 3 * P + 5  # slack, not a blanket over-allocation


# ------------------------------------------------------------------------- size_pools
def _tiny(*overrides: str):
    return swafactory.compose(["model=tiny", "backend=torch", *overrides])


def test_size_pools_gives_each_request_its_context_and_its_swa_need() -> None:
    cfg = _tiny("spec=eagle3", "backend.page_size=4", "workload.eviction_interval=3")
    s = size_pools(cfg, 3, 100, 32)
    # tree nodes 1 + 4·3 = 13; full: ⌈(100 + 13) / 4⌉ pages; SWA: W 16 + chunk 32 + I 3 + P 4 + 1
    # = 56 → 14 pages, + 1 page
    assert (s.full_per_request, s.swa_per_request, s.step_tokens) == (29 * 4, 15 * 4, 32)
    assert (s.full, s.swa, s.max_requests) == (3 * 29 * 4, 3 * 15 * 4, 3)
    small_chunk = size_pools(cfg, 3, 100, 2)  # a spec step adds more than the chunk
    assert small_chunk.step_tokens == 13
    assert small_chunk.swa_per_request == swa_tokens_per_request(16, 13, 4, 3)


def test_size_pools_reads_the_ratio_and_refuses_one_too_small() -> None:
    cfg = _tiny("spec=none", "workload.swa_full_tokens_ratio=0.5")
    s = size_pools(cfg, 2, 200, 8)  # full 2 × 201; share ⌊201·2·0.5 / 2⌋ = 100 ≥ need 28
    assert (s.full, s.swa_per_request, s.swa) == (402, 100, 200)
    assert size_pools(cfg, 2, 200, 8, ratio="auto").swa_per_request == \
        swa_tokens_per_request(16, 8, 1, 1)
    with pytest.raises(ConfigError) as e:
        size_pools(cfg, 2, 200, 8, ratio=0.05)
    (r,) = e.value.reasons
    assert r.field == "ratio" and r.rule == "sizing" and "needs" in r.message
    with pytest.raises(ConfigError) as e:
        size_pools(_tiny("spec=none", "workload.swa_full_tokens_ratio=0.05"), 2, 200, 8)
    assert e.value.reasons[0].field == "workload.swa_full_tokens_ratio"
    assert e.value.reasons[0].fix == "workload.swa_full_tokens_ratio=auto"


@pytest.mark.parametrize("kw,name", [(dict(max_requests=0), "max_requests"),
                                     (dict(max_context=-1), "max_context"),
                                     (dict(chunk=True), "chunk"), (dict(chunk=2.5), "chunk"),
                                     (dict(ratio=1.5), "ratio"), (dict(ratio="half"), "ratio")])
def test_size_pools_names_a_bad_argument(kw: dict, name: str) -> None:
    args = dict(max_requests=2, max_context=64, chunk=8) | kw
    with pytest.raises(ValueError, match=f"{name} must be .*Fix: "):
        size_pools(_tiny(), **args)


def test_an_unsplit_pool_has_no_swa_share_and_ignores_the_ratio() -> None:
    cfg = swafactory.compose(["model=gemma3_4b", "spec=none", "backend=torch",
                              "workload.swa_full_tokens_ratio=0.01"])
    s = size_pools(cfg, 2, 5000, 256)
    assert (s.full, s.swa, s.swa_per_request) == (2 * 5001, 0, 0)


def _old_harness_sizes(cfg, prompts, outs):
    """The harness's private sizing before it called `size_pools` (its > 90% SWA-use runs are
    tuned to these numbers): the reference the new call must reproduce."""
    w, m, P = cfg.workload, cfg.model, cfg.backend.page_size
    R, T, I = w.max_running_requests, step_nodes(cfg.spec), w.eviction_interval
    full_pages = math.ceil((max(p + o for p, o in zip(prompts, outs)) + T) / P) + 2
    W = m.sliding_window
    need = math.ceil((W + T + I + P + 1 + (W + T) // 16) / P) + 1
    if w.swa_full_tokens_ratio == "auto":
        return R * full_pages * P, R * need * P, full_pages, need
    swa_pages = int(R * full_pages * P * float(w.swa_full_tokens_ratio)) // P // R
    return (R * full_pages * P, R * swa_pages * P, full_pages, swa_pages) \
        if swa_pages >= need else "refused"


@pytest.mark.parametrize("model", ["tiny", "gemma4", "gpt_oss_20b"])
def test_harness_sizes_through_size_pools_as_tight_as_before(model: str) -> None:
    from swafactory.harness.setup import pool_sizes

    rng = random.Random(7)
    for spec, extra in [("none", ()), ("eagle3", ("backend.page_size=16",)),
                        ("dflash", ("workload.eviction_interval=5",)),
                        ("none", ("workload.swa_full_tokens_ratio=0.9",)),
                        ("eagle3", ("workload.swa_full_tokens_ratio=0.2",))]:
        cfg = swafactory.compose([f"model={model}", f"spec={spec}", "backend=torch", *extra])
        W = cfg.model.sliding_window
        prompts = [W + rng.randint(8, 128) for _ in range(4)]
        outs = [rng.randint(6, 12) for _ in range(4)]
        want = _old_harness_sizes(cfg, prompts, outs)
        if want == "refused":
            with pytest.raises(ConfigError, match="swa_full_tokens_ratio"):
                pool_sizes(cfg, prompts, outs)
            continue
        got, P = pool_sizes(cfg, prompts, outs), cfg.backend.page_size
        assert (got.full, got.swa, got.full_per_request // P, got.swa_per_request // P) == want, \
            (model, spec, extra)
        assert got.full_per_request % P == 0 and got.swa_per_request % P == 0


@pytest.mark.parametrize("model", ["tiny", "gemma4", "gpt_oss_20b"])
def test_the_plan_shows_a_split_draft_pool_by_group_and_sizes_it_as_the_target(model) -> None:
    """DFlash's draft_pool_split: run=plan's draft rows say which draft layers read their window
    from the draft's SWA sub-pool through the target's mapping and which read its full one, each
    at the target's geometry and slots of that kind; the summary's draft bytes are their sum (a
    split draft pool was shown, and sized, as one full-indexed group)."""
    from swafactory.kvcache.draft import draft_layer_types
    from swafactory.registry.device import CPU
    from swafactory.resolve.layout import describe

    cfg = swafactory.validate(swafactory.compose([f"model={model}", "spec=dflash", "backend=torch",
                                                  "spec.draft_pool_split=true"]))
    plan = describe(cfg, CPU)
    rows = {r.group: r for r in plan.rows if r.worker == "draft"}
    types = draft_layer_types(cfg)
    target = {r.group: r for r in plan.rows if r.worker == "target"}
    swa, full = rows["swa"], rows["full"]
    assert swa.num_layers == types.count("sliding_attention") and swa.index_space == "swa"
    assert full.num_layers == types.count("full_attention") and full.index_space == "full"
    assert swa.window == cfg.model.sliding_window and full.window is None
    assert "target's mapping" in swa.pool and swa.resolver.endswith("active pool")
    for kind in ("swa", "full"):
        assert (rows[kind].kv_heads, rows[kind].head_dim, rows[kind].tokens_per_request) == (
            target[kind].kv_heads, target[kind].head_dim, target[kind].tokens_per_request)
    assert plan.draft_bytes_per_request == swa.bytes_per_request + full.bytes_per_request
    whole = describe(swafactory.validate(swafactory.compose(
        [f"model={model}", "spec=dflash", "backend=torch"])), CPU)
    assert [r.group for r in whole.rows if r.worker == "draft"] == ["own"]
    assert plan.draft_bytes_per_request < whole.draft_bytes_per_request
