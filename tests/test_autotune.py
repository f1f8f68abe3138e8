"""`backend=auto` by measured speed, without a GPU: the cache key follows the device, the
geometry, the dtype and the library versions; a cached tuning is reused, a stale one measured
again; the fastest candidate wins; and the tuned config passes the registry."""
from __future__ import annotations

import json
from dataclasses import replace

import swafactory
from swafactory.registry.tuning import (SCHEMA, TuneCache, candidates, pass_weights, tune,
                                         tune_key)
from swafactory.registry.check import check
from swafactory.registry.device import H200

VERSIONS = {"torch": "2.11.0", "triton": "3.6.0", "flashinfer-python": "0.6.18.post1",
            "flash-attn-4": None, "swafactory": "0.1.0"}


def _cfg(*extra: str):
    return swafactory.compose(["backend=auto", "spec=eagle3", "model=gpt_oss_20b", *extra])


class Timer:
    """Fake timings: group `full` decodes fastest on our triton kernel, everything else on
    flashinfer; counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, cfg, group: str, pass_: str) -> float:
        self.calls += 1
        fam = cfg.backend.family_for(group == "swa", pass_)  # the adapter that runs the pass
        choice = getattr(getattr(cfg.backend.kernels, group), pass_)
        if group == "full" and pass_ == "decode" and fam == "triton":
            return 0.5 if choice in ("auto", "cuda") else 0.7  # the CUDA decode where it fits
        return {"flashinfer": 1.0, "flash_attn": 1.2, "triton": 1.5}[fam]


def test_the_key_changes_with_device_geometry_dtype_and_versions() -> None:
    base = tune_key(_cfg(), H200, VERSIONS)
    assert base["schema"] == SCHEMA
    others = [
        tune_key(_cfg(), replace(H200, name="NVIDIA H100 80GB HBM3"), VERSIONS),
        tune_key(_cfg("model.full.head_dim=128", "model.swa.head_dim=128"), H200, VERSIONS),
        tune_key(_cfg("backend.kv_dtype=fp8_e4m3"), H200, VERSIONS),
        tune_key(_cfg(), H200, {**VERSIONS, "flashinfer-python": "0.6.19"}),
        tune_key(_cfg(), H200, {**VERSIONS, "swafactory": "0.2.0"}),
        tune_key(_cfg("workload.max_running_requests=64"), H200, VERSIONS),
        tune_key(_cfg("backend.cuda_graph=true"), H200, VERSIONS),  # replays are timed then
        tune_key(_cfg("workload.output_len=[512,1024]"), H200, VERSIONS),  # the passes' weights
    ]
    digests = {json.dumps(k, sort_keys=True) for k in [base, *others]}
    assert len(digests) == 1 + len(others)


def test_a_tuning_is_cached_and_a_stale_entry_is_measured_again(tmp_path) -> None:
    cache = TuneCache(tmp_path / "autotune.json")
    timer = Timer()
    cfg1, t1 = tune(_cfg(), H200, timer, cache, VERSIONS)
    first = timer.calls
    assert first > 0 and not t1.cached and t1.choices
    cfg2, t2 = tune(_cfg(), H200, timer, cache, VERSIONS)  # same key: read back, not timed
    assert timer.calls == first and t2.cached and cfg2 == cfg1
    # a new library version is another key: measured again
    tune(_cfg(), H200, timer, cache, {**VERSIONS, "triton": "3.7.0"})
    assert timer.calls == 2 * first
    # an entry written by an older schema (same key fields otherwise) is stale
    data = json.loads(cache.path.read_text())
    for e in data.values():
        e["fields"]["schema"] = SCHEMA - 1
    cache.path.write_text(json.dumps(data))
    _, t3 = tune(_cfg(), H200, timer, cache, VERSIONS)
    assert not t3.cached and timer.calls == 3 * first


def test_the_fastest_candidate_wins_and_the_registry_accepts_it(tmp_path) -> None:
    cfg, t = tune(_cfg(), H200, Timer(), TuneCache(tmp_path / "c.json"), VERSIONS)
    assert check(cfg, H200) == []
    by = {(c.group, c.pass_): c for c in t.choices}
    # full: our CUDA decode at 0.5 beats flashinfer's 1.0, and triton's prefill loses to
    # flashinfer's (decode and verify 16 steps, extend 32 chunks × 2 forwards): flashinfer keeps
    # the full group and hands its decode to our kernel (`backend.kernels.full.decode=cuda`)
    d = by[("full", "decode")]
    assert (d.family, d.kernel, d.ms) == ("flashinfer", "cuda", 0.5)
    assert d.tried["flashinfer/auto"] == 1.0 and d.tried["triton/auto"] == 0.5  # all shown
    assert cfg.backend.name == "flashinfer" and t.lines()[0].startswith("decode/")
    assert cfg.backend.family_for(False, "decode") == "triton"
    assert cfg.backend.family_for(False, "extend") == "flashinfer"


def test_the_tuning_says_which_candidates_its_time_went_to(tmp_path) -> None:
    """A candidate whose first use compiles (here: sleeps) tops `costliest`, and the cache
    keeps each candidate's cost, so a slow first tuning names its cause in the record."""
    import time

    class Compiling(Timer):
        def __call__(self, cfg, group, pass_):
            if (group, pass_, cfg.backend.kernel_for(group == "swa")) == ("full", "verify",
                                                                           "triton"):
                time.sleep(0.3)
            return super().__call__(cfg, group, pass_)

    cache = TuneCache(tmp_path / "c.json")
    _, t = tune(_cfg(), H200, Compiling(), cache, VERSIONS)
    top = t.costliest()
    assert len(top) == 3 and top[0].startswith("verify/full triton/"), top
    assert float(top[0].split()[-2]) >= 0.3
    _, again = tune(_cfg(), H200, Compiling(), cache, VERSIONS)
    assert again.cached and again.costliest() == top


def test_a_group_whose_passes_are_all_faster_elsewhere_moves_family(tmp_path) -> None:
    class Fast(Timer):
        def __call__(self, cfg, group, pass_):
            fam = cfg.backend.family_for(group == "swa", pass_)
            return 0.4 if (group, fam) == ("swa", "triton") else super().__call__(cfg, group, pass_)

    cfg, t = tune(_cfg(), H200, Fast(), TuneCache(tmp_path / "c.json"), VERSIONS)
    assert cfg.backend.kernel_for(True) == "triton" and cfg.backend.kernel_for(False) == "flashinfer"
    assert check(cfg, H200) == []


def test_the_workloads_mix_of_passes_weighs_the_family_choice(tmp_path) -> None:
    """Our decode 4× faster, our prefill 3× slower: a long prompt with a short answer keeps
    flashinfer, a long answer moves both groups to triton (decode steps outweigh the chunks)."""
    class DecodeFast(Timer):
        def __call__(self, cfg, group, pass_):
            fam = cfg.backend.kernel_for(group == "swa")  # the family's own kernels only
            if fam == "triton":
                return {"decode": 0.25, "verify": 1.0, "extend": 3.0}[pass_]
            return super().__call__(cfg, group, pass_)

    def families(*extra):
        cfg, _ = tune(_cfg(*extra), H200, DecodeFast(), TuneCache(tmp_path / "c.json"), VERSIONS)
        assert check(cfg, H200) == []
        return cfg.backend.kernel_for(True), cfg.backend.kernel_for(False)

    assert pass_weights(_cfg("workload.output_len=[1024,1024]", "workload.chunk_size=8192",
                             "workload.max_running_requests=8"))["extend"] == 4 * 2
    assert families("workload.output_len=[8,24]") == ("flashinfer", "flashinfer")
    # the decode's faster family lost on the sum: its line says so, the winners' lines do not
    _, t = tune(_cfg("workload.output_len=[8,24]"), H200, DecodeFast(),
                TuneCache(tmp_path / "c.json"), VERSIONS)
    lines = {f"{c.pass_}/{c.group}": str(c) for c in t.choices}
    assert "triton lost on the group's weighted sum of passes" in lines["decode/swa"]
    assert "lost on" not in lines["extend/swa"]
    assert families("workload.output_len=[1024,1024]", "workload.chunk_size=8192") == (
        "triton", "triton")


def test_a_pass_is_chosen_with_its_planning_and_decode_moves_to_our_kernels(tmp_path) -> None:
    """FlashInfer's library verify runs a layer faster than our tile but plans 2 ms a step; our
    decode is 4× FlashInfer's. GPT-OSS has 12 layers a group: the library verify's step costs
    12·0.8 + 2 = 11.6 ms against our tile's 12·0.9 + 0.1 = 10.9, so auto keeps the tile; decode
    moves to our kernel beside FlashInfer's prefill, and the lines show each plan's time."""
    class Planned(Timer):
        def __call__(self, cfg, group, pass_):
            fam = cfg.backend.family_for(group == "swa", pass_)
            choice = getattr(getattr(cfg.backend.kernels, group), pass_)
            if pass_ == "verify":
                return (0.8, 2.0) if choice == "library" else (0.9, 0.1)
            if pass_ == "decode":
                return (0.25, 0.0) if fam == "triton" else (1.0, 0.3)
            return (1.0, 0.2) if fam == "flashinfer" else (3.0, 0.0)

    cfg, t = tune(_cfg(), H200, Planned(), TuneCache(tmp_path / "c.json"), VERSIONS)
    assert check(cfg, H200) == []
    by = {(c.group, c.pass_): c for c in t.choices}
    for g in ("swa", "full"):
        assert by[(g, "verify")].kernel == "auto" and by[(g, "verify")].family == "flashinfer"
        assert by[(g, "decode")].kernel in ("cuda", "triton")
        assert cfg.backend.family_for(g == "swa", "decode") == "triton"
        assert cfg.backend.family_for(g == "swa", "extend") == "flashinfer"
    line = str(by[("swa", "verify")])
    assert "plan 0.100 ms" in line and "planning included" in line, line


def test_cpu_has_nothing_to_time() -> None:
    assert candidates(swafactory.compose(["backend=auto", "spec=none", "model=tiny"]),
                      swafactory.registry.device.CPU) == {}


def test_run_plan_shows_each_tuned_choice_with_its_time(tmp_path, monkeypatch) -> None:
    """The CLI tunes `backend=auto` before validating (here on a stand-in H200 with fake
    timings) and run=plan writes each choice with its time to plan.json; a second run reads
    the cache."""
    from hydra import compose, initialize_config_dir

    import swafactory.backend.timing as at
    import swafactory.cli.jobs as cli
    from swafactory.config.paths import conf_dir

    monkeypatch.setenv("SWAFACTORY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cli, "detect_device", lambda *_: H200)
    timer = Timer()
    monkeypatch.setattr(at, "measure_pass", timer)
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["run=plan", "backend=auto",
                                                       "spec=eagle3", "model=gpt_oss_20b"])
    assert cli.run_cli(cfg, tmp_path) == 0
    lines = json.loads((tmp_path / "plan.json").read_text())["autotune"]
    assert lines and all(" ms; tried " in x for x in lines)
    assert any(x.startswith("decode/full: flashinfer cuda (0.500 ms") for x in lines), lines
    calls = timer.calls
    assert cli.run_cli(cfg, tmp_path) == 0 and timer.calls == calls  # cached


def test_a_tuning_builds_one_pool_per_pass_for_every_candidate() -> None:
    """The candidates of a pass differ in kernels, not pools: `autotune._world` builds a pass's
    pools and batch once per geometry (the first tuning's cost), and a new geometry (another
    KV dtype, another pass) gets its own."""
    import swafactory.backend.timing as at
    from swafactory.registry.tuning import _with

    base = at._cut(swafactory.compose(["backend=auto", "spec=eagle", "model=tiny",
                                       "workload.max_running_requests=2",
                                       "workload.context_len=64"]))
    try:
        first = at._world(_with(base, "full", "flashinfer"), "decode", "cpu")
        assert at._world(_with(base, "full", "triton", {"decode": "cuda"}), "decode",
                         "cpu") is first
        assert at._world(base, "verify", "cpu") is not first
        other = base.model_copy(update={"backend": base.backend.model_copy(
            update={"kv_dtype": "float16"})})
        assert at._world(other, "decode", "cpu") is not first
        pool, batch, _ = first
        assert batch.mode == "decode" and batch.batch_size == 2
    finally:
        at._WORLDS.clear()


def test_a_graphed_pass_is_captured_through_the_graph_contract_and_replayed(monkeypatch) -> None:
    """With ``backend.cuda_graph`` on, decode and verify are timed as replays (a library's graph
    kernels may not be its eager ones): `autotune._replay` sizes the graph state for the batch,
    captures the forward after one warm call (`graphs.capture_step`, the drivers' own), plans the
    batch for replay, and returns the replay;
    a candidate that cannot be captured is timed eagerly (None)."""
    import contextlib
    import types

    import torch

    import swafactory.backend.timing as at

    calls = []

    class Graph:
        def replay(self):
            calls.append("replay")

    fake = types.SimpleNamespace(
        Stream=lambda *a: types.SimpleNamespace(wait_stream=lambda s: None),
        current_stream=lambda *a: types.SimpleNamespace(wait_stream=lambda s: None),
        stream=lambda s: contextlib.nullcontext(), CUDAGraph=Graph,
        graph=lambda g: contextlib.nullcontext(calls.append("capture")))
    monkeypatch.setattr(torch, "cuda", fake)

    class Backend:
        def init_cuda_graph_state(self, bs, tokens, keys):
            calls.append(("state", bs, tokens, keys))

        def init_forward_metadata_capture(self, bs, tokens, mode):
            calls.append(("capture plan", bs, tokens, mode))

        def init_forward_metadata_replay(self, batch, bs, tokens):
            calls.append(("replay plan", bs, tokens))

    reqs = [types.SimpleNamespace(q_len=4, prefix_len=p, nodes=4) for p in (10, 30)]
    batch = types.SimpleNamespace(batch_size=2, reqs=reqs, mode="target_verify")
    run, plan = at._replay(Backend(), batch, lambda: calls.append("forward"),
                           torch.device("cuda"))
    assert calls == [("state", 2, 4, 34), ("capture plan", 2, 4, "target_verify"), "forward",
                     "capture", "forward", ("replay plan", 2, 4)]
    run()
    assert calls[-1] == "replay"
    plan()  # the planning timed beside the replay is the replay's
    assert calls[-1] == ("replay plan", 2, 4)

    class Refuses(Backend):
        def init_forward_metadata_capture(self, bs, tokens, mode):
            raise ValueError("no graphs here")

    assert at._replay(Refuses(), batch, lambda: None, torch.device("cuda")) == (None, None)


def test_the_planning_is_timed_with_the_other_groups_pass_on_our_kernels() -> None:
    """`autotune._quiet`: the other group's pass goes to our kernels where its library would
    plan it on the host (decode, extend), never FlashInfer's verify (its adapter runs our tiles
    itself) nor a group already on triton."""
    import swafactory.backend.timing as at
    from swafactory.registry.tuning import _with

    base = _with(_cfg(), "swa", "flashinfer")
    q = at._quiet(base, "swa", "decode").backend
    assert q.family_for(False, "decode") == "triton" and q.family_for(True, "decode") == \
        "flashinfer"
    assert at._quiet(base, "swa", "verify") == base
    tri = _with(_with(_cfg(), "full", "triton"), "swa", "flashinfer")
    assert at._quiet(tri, "swa", "extend") == tri
