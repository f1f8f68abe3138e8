"""What the model's config makes part of every call, raised in the caller's terms
(`swafactory.backend.layer_contract`, `resolve.runner_windows.check_own_pool`):

* sinks: a layer of a model with attention sinks (GPT-OSS) refuses a `forward` without
  ``sinks=``, a layer of a model without them refuses some; given as the model says, the output
  matches the oracle;
* ``ForwardBatch.full_id``: an id the runner's pool does not address is named as the field, with
  the value, the id the pool knows and where to get it;
* a backend built for one model over another model's pools names both models and how their
  layers differ, in a line, suggesting the config the pools came from (never ``windows=``, never
  ``build_draft_pool`` for a target pool).
"""
from __future__ import annotations

import pytest
import torch

import swafactory
from swafactory.backend.faulty import with_faults
from swafactory.guards import CallError
from swafactory.harness.world import World
from swafactory.kvcache import ReqToToken, RequestSlots, build_draft_pool
from swafactory.kvcache.factory import build_pools
from swafactory.metadata import ForwardBatch, ReqForward
from swafactory.resolve.layout import frozen_draft_binding
from swafactory.resolve.source import DraftView

TOL = 2e-5


def _cfg(model: str, *extra: str):
    return swafactory.validate(swafactory.compose(
        [f"model={model}", "backend=torch", "spec=none", "backend.kv_dtype=float32", *extra]))


def _planned(model: str, n: int = 12):
    """A target of ``model`` with request "a" prefilled over n positions and an extend of it
    planned: (backend, q, k, v) for layer 0."""
    cfg = _cfg(model)
    pool, alloc = build_pools(cfg, 128, 128)
    book = RequestSlots(alloc, ReqToToken(2, 64))
    backend = swafactory.build_backend(cfg, pools=pool)
    row = book.open("a").row
    book.extend("a", n)
    backend.init_forward_metadata(ForwardBatch.of(
        "extend", [ReqForward("a", row, 0, n)], book.req_to_token, alloc.full_id))
    sub = pool.sub_pool(0)
    q = torch.randn(n, backend.q_heads, sub.head_dim)
    k, v = (torch.randn(n, sub.num_kv_heads, sub.head_dim) for _ in range(2))
    return backend, q, k, v


# --- sinks ------------------------------------------------------------------------------------

def test_a_model_with_sinks_refuses_a_forward_without_them() -> None:
    backend, q, k, v = _planned("gpt_oss_20b")
    before = backend.planned_pool.sub_pool(0).k_bufs[0].clone()
    with pytest.raises(CallError, match=r"model\.attention_sinks=true") as err:
        backend.forward(q, k, v, 0)
    text = str(err.value)
    assert "gpt_oss_20b" in text and "sinks=" in text and "[64] fp32" in text
    assert "extend layer 0" in text
    assert torch.equal(backend.planned_pool.sub_pool(0).k_bufs[0], before)  # nothing written


def test_a_model_without_sinks_refuses_sinks() -> None:
    backend, q, k, v = _planned("tiny")
    with pytest.raises(CallError, match=r"model\.attention_sinks=false") as err:
        backend.forward(q, k, v, 0, sinks=torch.zeros(backend.q_heads))
    text = str(err.value)
    assert "'tiny' has no attention sinks" in text and "drop sinks=" in text
    assert f"[{backend.q_heads}] fp32" in text


@pytest.mark.parametrize("model", ["gpt_oss_20b", "tiny"])
def test_sinks_as_the_model_says_match_the_oracle(model: str) -> None:
    """GPT-OSS with its sinks, tiny without: a prefill and a decode over a sliding and a full
    layer, each output against the fp32 oracle (which applies the same sinks)."""
    w = World(_cfg(model), size_full=128, size_swa=128, max_requests=2, max_context=64)
    assert bool(w.sinks) == (model == "gpt_oss_20b") == w.backend.takes_sinks
    layers = [0, 1]  # sliding, full (GPT-OSS); sliding, sliding (tiny)
    w.open("a")
    checks = w.forward("extend", [w.req("a", 0, 20)], layers)
    checks += w.forward("decode", [w.req("a", 20, 1)], layers)
    assert checks and max(c.error() for c in checks) < TOL


def test_an_own_pool_draft_of_a_model_with_sinks_takes_either() -> None:
    """An own-pool draft's layers are the draft model's (an EAGLE head has no sinks, a copy of
    the target has them): the config cannot say, so neither is refused; a FROZEN_KV draft reads
    target layers and follows the model."""
    cfg = _cfg("gpt_oss_20b", "spec=eagle3")
    pool, alloc = build_pools(cfg, 128, 128)
    dpool = build_draft_pool(cfg, pool, alloc)
    draft = swafactory.build_backend(cfg, view=DraftView(dpool, pool, "draft_own_pool", "eagle3"))
    assert draft.takes_sinks is None
    frozen = _cfg("gpt_oss_20b", "spec=frozen_kv_mtp")
    fpool, falloc = build_pools(frozen, 128, 128)
    view = build_draft_pool(frozen, fpool, falloc, binding=frozen_draft_binding(frozen))
    fdraft = swafactory.build_backend(frozen, view=DraftView(view, fpool, "draft_reads_target",
                                                             "frozen_kv_mtp"))
    assert fdraft.takes_sinks is True


def test_the_sink_dropped_fault_still_drops_what_the_caller_passed() -> None:
    """The fault is the kernel's: the caller's side of the contract is still checked, and the
    sinks it passes are ignored (the output differs from the oracle)."""
    backend, q, k, v = _planned("gpt_oss_20b")
    sinks = torch.full((backend.q_heads,), 3.0)
    want = backend.forward(q, k, v, 0, sinks=sinks)
    with_faults(backend, sink_dropped=True)
    with pytest.raises(CallError, match=r"model\.attention_sinks"):
        backend.forward(q, k, v, 0)
    assert not torch.allclose(backend.forward(q, k, v, 0, sinks=sinks), want)


def test_guards_off_check_no_sinks() -> None:
    """``guards=False`` runs none of the call's checks, the sinks' included (an engine that
    embedded only the kernels)."""
    cfg = _cfg("gpt_oss_20b")
    pool, alloc = build_pools(cfg, 64, 64)
    book = RequestSlots(alloc, ReqToToken(1, 32))
    backend = swafactory.build_backend(cfg, pools=pool, guards=False)
    row = book.open("a").row
    book.extend("a", 4)
    backend.init_forward_metadata(ForwardBatch.of(
        "extend", [ReqForward("a", row, 0, 4)], book.req_to_token, alloc.full_id))
    out = backend.forward(torch.randn(4, 64, 64), torch.randn(4, 8, 64), torch.randn(4, 8, 64), 0)
    assert out.shape == (4, 64, 64)


# --- ForwardBatch.full_id ---------------------------------------------------------------------

def test_an_unknown_full_id_names_the_field_the_value_and_the_known_id() -> None:
    cfg = _cfg("tiny")
    pool, alloc = build_pools(cfg, 64, 64)
    book = RequestSlots(alloc, ReqToToken(1, 32))
    backend = swafactory.build_backend(cfg, pools=pool)
    row = book.open("a").row
    book.extend("a", 10)
    reqs = [ReqForward("a", row, 0, 10)]
    with pytest.raises(swafactory.SpaceError, match=r"full_id='foo'") as err:
        backend.init_forward_metadata(ForwardBatch("extend", tuple(reqs), book.req_to_token,
                                                   full_id="foo"))
    text = str(err.value)
    assert "'target.full'" in text and "allocator.full_id" in text
    assert "locations of" not in text  # the translation's words, not the caller's
    backend.init_forward_metadata(ForwardBatch.of("extend", reqs, book.req_to_token,
                                                  alloc.full_id))  # the allocator's: planned


def test_the_allocators_full_id_plans_and_matches_the_oracle() -> None:
    w = World(_cfg("tiny"), size_full=64, size_swa=64, max_requests=1, max_context=32)
    w.open("a")
    checks = w.forward("extend", [w.req("a", 0, 12)], [0, 2])  # batches carry alloc.full_id
    assert w.alloc.full_id == "target.full" and max(c.error() for c in checks) < TOL


# --- a backend over another model's pools -----------------------------------------------------

@pytest.mark.parametrize(("backend_model", "pool_model", "ours", "theirs"), [
    ("gpt_oss_20b", "tiny", "24 layers SF×12", "6 layers SSF×2"),
    ("tiny", "gpt_oss_20b", "6 layers SSF×2", "24 layers SF×12"),
])
def test_a_backend_over_another_models_pools_names_both_models(
        backend_model: str, pool_model: str, ours: str, theirs: str) -> None:
    pool, _ = build_pools(_cfg(pool_model), 64, 64)
    with pytest.raises(swafactory.ConfigError) as err:
        swafactory.build_backend(_cfg(backend_model), pools=pool)
    (reason,) = err.value.reasons
    assert reason.field == "model"
    assert f"built for model {backend_model} ({ours}" in reason.message
    assert f"built for {pool_model} ({theirs}" in reason.message
    assert f"model={pool_model}" in reason.fix and "build_pools" in reason.fix
    text = str(err.value)
    assert "windows=" not in text and "build_draft_pool" not in text
    assert "{" not in text and len(reason.message) < 400  # a line, not a dict of every layer


def test_the_same_config_as_the_pools_is_accepted() -> None:
    cfg = _cfg("gpt_oss_20b")
    pool, _ = build_pools(cfg, 64, 64)
    backend = swafactory.build_backend(cfg, pools=pool)
    assert backend.windows == {i: (128 if i % 2 == 0 else None) for i in range(24)}


def test_a_draft_pool_of_another_config_suggests_the_draft_pool_builder() -> None:
    """An own draft pool built split for one config, backed by a config without the split: the
    draft's field, its builder, and still no ``windows=``."""
    split = swafactory.compose(["backend=torch", "model=tiny", "spec=dflash",
                                "spec.draft_pool_split=true"])
    pool, alloc = build_pools(split, 256, 256)
    dpool = build_draft_pool(split, pool, alloc)
    plain = swafactory.compose(["backend=torch", "model=tiny", "spec=dflash"])
    with pytest.raises(swafactory.ConfigError) as err:
        swafactory.build_backend(plain, view=DraftView(dpool, pool, "draft_own_pool", "dflash"))
    (reason,) = err.value.reasons
    assert reason.field == "spec.draft_pool_split" and "build_draft_pool(cfg" in reason.fix
    assert "windows=" not in str(err.value) and "{" not in reason.message
