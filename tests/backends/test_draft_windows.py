"""A draft backend built with ``view=`` alone plans each layer with the window of what it reads.

A draft's layer j is not the target's layer j: a FROZEN_KV draft layer reads the target layer it is
bound to, an own non-split pool is full attention, and a split DFlash pool holds the target's last
``draft_num_layers`` layer types. Each family is built as an engine builds it (no ``windows=``),
run through real pools (shuffled pages, out-of-window SWA slots evicted and NaN-poisoned) over
contexts longer than W, and every layer is compared with the fp32 oracle over the logical K/V.
The old default (the target's windows keyed 0…N) is built beside it and must mismatch.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import swafactory
from swafactory.backend import build_backend, model_windows
from swafactory.harness.oracle import masked_attention, visibility
from swafactory.harness.world import World
from swafactory.kvcache.draft import build_draft_pool, frozen_draft_view, own_draft_pool
from swafactory.kvcache.factory import build_pools
from swafactory.kvcache.pool import ReqToToken
from swafactory.kvcache.requests import RequestSlots
from swafactory.resolve.layout import frozen_draft_binding
from swafactory.metadata import ForwardBatch, ReqForward, plan
from swafactory.resolve.source import resolve_kv_source

TOL = 2e-5
# gemma4 keeps its geometry, W = 1024 and layer pattern, in 6 layers (the draft binds the last ones)
MODELS = {"tiny": ["model=tiny"], "gemma4": ["model=gemma4", "model.num_layers=6"]}
SPECS = {"eagle": ["spec=eagle"], "frozen_kv_mtp": ["spec=frozen_kv_mtp"], "dflash": ["spec=dflash"],
         "dflash_split": ["spec=dflash", "spec.draft_pool_split=true"]}


class View:
    """A host engine's runner view (`swafactory.resolve.source.RunnerView`)."""

    def __init__(self, active_pool, allocator_pool, role: str, spec_algorithm: str) -> None:
        self.active_pool, self.allocator_pool = active_pool, allocator_pool
        self.role, self.spec_algorithm = role, spec_algorithm


def true_windows(cfg) -> dict[int, int | None]:
    """What each draft layer reads, stated from the config as the spec defines it (the oracle's
    side): FROZEN_KV → its bound target layer's type; split own pool → the target's last types;
    any other own pool → full attention."""
    m, s = cfg.model, cfg.spec
    if s.draft_kv == "target_pool":
        types = [m.layer_types[t] for t in frozen_draft_binding(cfg)]
    elif getattr(s, "draft_pool_split", False):
        types = list(m.layer_types[-s.draft_num_layers:])
    else:
        types = ["full_attention"] * s.draft_num_layers
    return {j: m.sliding_window if t == "sliding_attention" else None for j, t in enumerate(types)}


def _max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if torch.isnan(out).any():
        return float("inf")
    return float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6))


def run_family(model: str, spec: str) -> tuple[dict[int, float], dict[int, float]]:
    """Per draft layer, the relative error vs the oracle of (the default backend, the old one)."""
    few = ["spec.draft_num_layers=2"] if model == "gemma4" and spec.startswith("dflash") else []
    cfg = swafactory.compose(["backend=torch", "backend.kv_dtype=float32", *MODELS[model],
                              *SPECS[spec], *few])  # gemma4 dflash: 2 draft layers (S F if split)
    m, s = cfg.model, cfg.spec
    W = m.sliding_window
    lens = [W + 1, 2 * W + 3, 3 * W] if model == "tiny" else [W + 67]
    nodes = s.block_size if s.algorithm == "dflash" else 3
    gen = torch.Generator().manual_seed(len(lens) + nodes)
    size = sum(lens) + nodes * len(lens) + 16
    pool, alloc = build_pools(cfg, size, size, "cpu", check_mode=True)
    alloc.shuffle(gen)  # pages in random order: a wrong list reads someone else's rows
    slots = RequestSlots(alloc, ReqToToken(len(lens), max(lens) + nodes, "cpu"))
    for rid, n in enumerate(lens):
        slots.open(rid)
        assert slots.extend(rid, n + nodes) is not None

    frozen = s.draft_kv == "target_pool"
    if frozen:  # the engine's dummy until it swaps the target's frozen view in per forward
        binding = frozen_draft_binding(cfg)
        geo = m.full or m.swa
        dummy = own_draft_pool(16, 1, len(binding), geo.num_kv_heads, geo.head_dim, torch.float32)
        view = View(dummy, pool, "draft_reads_target", s.algorithm)
        writer, wpool, written = build_backend(cfg, pools=pool), pool, list(binding)  # the target
        reads = dict(enumerate(binding))
    else:
        dpool = build_draft_pool(cfg, pool, alloc, check_mode=True)
        assert dpool.is_split == (spec == "dflash_split")
        view = View(dpool, pool, "draft_own_pool", s.algorithm)
        writer, wpool, written = None, dpool, list(range(s.draft_num_layers))
        reads = {j: j for j in written}
    new = build_backend(cfg, view=view)  # what an engine writes: no windows=
    # the old default, unguarded: the guards refuse its SWA layers' reads of evicted slots
    # (`slot_guard`), and this test shows the oracle tells its wrong windows apart
    old = build_backend(cfg, view=view, windows=model_windows(cfg), guards=False)
    writer = writer or new

    def swap():
        if frozen:
            view.active_pool = frozen_draft_view(pool, binding)

    # every token's K/V (history and this step's nodes), written through the planner's locations
    table = slots.req_to_token.table
    fill = [ReqForward(rid, slots.reqs[rid].row, 0, n + nodes) for rid, n in enumerate(lens)]
    swap()
    writer.init_forward_metadata(ForwardBatch.of("extend", fill, table, alloc.full_id))
    kv = {}
    for layer in written:
        _, _, sub = wpool.get_kv(layer)
        k, v = (torch.randn(sum(lens) + nodes * len(lens), sub.num_kv_heads, sub.head_dim,
                            generator=gen) for _ in range(2))
        writer.write_kv(layer, k, v)
        kv[layer] = (k, v)
    for rid, n in enumerate(lens):  # the engine's job: free SWA slots no query can see
        slots.evict_out_of_window(rid, n, W)

    reqs = [ReqForward(rid, slots.reqs[rid].row, n, nodes, block=s.algorithm == "dflash")
            for rid, n in enumerate(lens)]
    batch = ForwardBatch.of("draft_extend", reqs, table, alloc.full_id)
    truth = true_windows(cfg)
    errs: tuple[dict[int, float], dict[int, float]] = ({}, {})
    qs = {}
    for backend, err in zip((new, old), errs):
        swap()
        backend.init_forward_metadata(batch)
        for j in sorted(truth):
            _, _, sub = view.active_pool.get_kv(j)
            scale = m.softmax_scale or sub.head_dim ** -0.5
            if j not in qs:  # scores of unit variance whatever the model's scale
                qs[j] = torch.randn(batch.total_q, m.num_attention_heads, sub.head_dim,
                                    generator=gen) * (sub.head_dim ** -0.5 / scale)
            out = backend.forward(qs[j], None, None, j, save_kv=False)
            refs, off = [], 0
            for i, (r, n) in enumerate(zip(reqs, lens)):  # each request's logical K/V, in order
                k, v = (t[off:off + n + nodes] for t in kv[reads[j]])
                off += n + nodes
                pos = torch.arange(n + nodes)
                structure = torch.ones(nodes, n + nodes, dtype=torch.bool) if r.block else \
                    pos[None, :] <= pos[n:, None]
                allowed = visibility(pos[n:], pos, structure, truth[j])
                refs.append(masked_attention(qs[j][i * nodes:(i + 1) * nodes], k, v, allowed,
                                             scale=scale))
            err[j] = _max_err(out, torch.cat(refs))
    return errs


CASES = [pytest.param(model, spec, id=f"{model}-{spec}") for model in MODELS for spec in SPECS]


@pytest.mark.parametrize("model, spec", CASES)
def test_draft_built_with_view_alone_matches_the_oracle(model: str, spec: str) -> None:
    default, old = run_family(model, spec)
    assert all(e < TOL for e in default.values()), f"view= alone: per draft layer {default}"
    # the test can fail: the target's windows keyed 0..N are wrong for this draft
    assert max(old.values()) > 100 * TOL, f"the old default matched the oracle: {old}"


def test_runner_windows_follow_what_each_draft_layer_reads() -> None:
    """tiny (SSF SSF): FROZEN_KV draft 0, 1 → target 4 (S), 5 (F); a split DFlash pool of 5
    layers mirrors target 1…5 (S F S S F); an own non-split pool is full attention."""
    from swafactory.backend import runner_windows

    tiny = ["backend=torch", "model=tiny"]
    W = 16
    for spec, role, want in (
            (["spec=frozen_kv_mtp"], "draft_reads_target", {0: W, 1: None}),
            (["spec=dflash", "spec.draft_pool_split=true"], "draft_own_pool",
             {0: W, 1: None, 2: W, 3: W, 4: None}),
            (["spec=dflash"], "draft_own_pool", dict.fromkeys(range(5))),
            (["spec=eagle3"], "draft_own_pool", {0: None}),
            (["spec=eagle3"], "target", model_windows(swafactory.compose(tiny)))):
        cfg = swafactory.compose([*tiny, *spec])
        assert runner_windows(cfg, View(None, None, role, cfg.spec.algorithm)) == want, spec
    off = swafactory.compose([*tiny, "spec=frozen_kv_mtp", "faults=window_off_by_one"])
    assert runner_windows(off, View(None, None, "draft_reads_target", "frozen_kv_mtp")) == \
        {0: W, 1: None}  # the windows are the model's: the fault lives in the backend
    from swafactory.backend.faulty import FaultyBackend
    from swafactory.kvcache.factory import build_pools

    pool, _ = build_pools(swafactory.validate(off), 64, 64, "cpu")
    faulty = swafactory.build_backend(off, pools=pool)
    assert isinstance(faulty, FaultyBackend)  # sliding layers see W + 1 keys, full ones all
    assert faulty.windows == {i: (W + 1 if w else None) for i, w in model_windows(off).items()}
    clean = swafactory.build_backend(swafactory.compose([*tiny, "spec=frozen_kv_mtp"]),
                                     pools=pool)
    assert type(clean).__name__ == "AttentionBackend" and clean.windows == model_windows(off)


def test_an_own_pool_that_disagrees_with_the_config_is_refused() -> None:
    """A split draft pool built for one config, backed by a config without draft_pool_split: the
    derived windows would be wrong, so build_backend names the field instead."""
    split = swafactory.compose(["backend=torch", "model=tiny", "spec=dflash",
                                "spec.draft_pool_split=true"])
    pool, alloc = build_pools(split, 256, 256)
    dpool = build_draft_pool(split, pool, alloc)
    plain = swafactory.compose(["backend=torch", "model=tiny", "spec=dflash"])
    with pytest.raises(swafactory.ConfigError, match="spec.draft_pool_split"):
        build_backend(plain, view=View(dpool, pool, "draft_own_pool", "dflash"))


def test_two_windows_in_one_sub_pool_never_share_tables() -> None:
    """Layers 0 and 1 both live in tiny's SWA sub-pool; given windows 4 and 8 they get two groups,
    each trimmed and masked by its own window (the old key dropped the window: the last one
    won for both)."""
    cfg = swafactory.compose(["backend=torch", "model=tiny", "spec=none", "model.sliding_window=8",
                              "backend.kv_dtype=float32"])
    windows = {**model_windows(cfg), 0: 4}
    w = World(cfg, size_full=256, size_swa=256)
    w.backend = build_backend(cfg, pools=w.pool, windows=windows)
    w.specs[0] = dataclasses.replace(w.specs[0], window=4)
    w.open("a")
    w.forward("extend", [w.req("a", 0, 20)], [0, 1])
    n = 20
    batch = ForwardBatch.of("decode", [w.req("a", n, 1)], w.slots.req_to_token.table,
                            w.alloc.full_id)
    assert w.slots.extend("a", 1) is not None
    source = resolve_kv_source(w.backend.view, "auto")
    fp = plan(batch, w.pool.layers_mapping, windows, source)
    assert w.pool.layers_mapping[0][0] == w.pool.layers_mapping[1][0] == "swa"
    g0, g1 = fp.group(0), fp.group(1)
    assert (g0.key, g1.key, fp.group(2).key) == ("swa/w4", "swa/w8", "full")
    assert g0 is not g1 and (g0.window, g1.window) == (4, 8)
    assert g0.tables.kv_pos.tolist() == list(range(n - 3, n + 1))
    assert g1.tables.kv_pos.tolist() == list(range(n - 7, n + 1))
    checks = w.forward("decode", [w.req("a", n, 1)], [0, 1])  # and each against the oracle
    assert [c.group for c in checks] == ["swa/w4", "swa/w8"]
    assert max(c.error() for c in checks) < TOL
