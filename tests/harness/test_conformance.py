"""The main job: every spec serves a workload under SWA pool pressure with 0 oracle mismatches,
and every fault switch makes the run fail, named by the check that caught it."""
from __future__ import annotations

import os

import pytest

from cli_process import run_cli

import swafactory
from swafactory.config.paths import group_options
from swafactory.harness import run as run_module
from swafactory.harness.leaks import leak_message, leaked
from swafactory.harness.report_model import Report
from swafactory.registry.fault_needs import FAULT_NEEDS

SPECS = group_options("spec")


def _run(*overrides: str) -> Report:
    return swafactory.run(swafactory.compose(["backend=torch", "workload=smoke", *overrides]))


@pytest.mark.parametrize("spec", SPECS)
def test_every_spec_on_gpt_oss_passes_under_pool_pressure(spec: str, monkeypatch) -> None:
    real, built = run_module.build_parts, []  # keep the run's parts to read their books after
    monkeypatch.setattr(run_module, "build_parts",
                        lambda *a, **kw: built.append(real(*a, **kw)) or built[-1])
    r = _run(f"spec={spec}", "model=gpt_oss_20b")
    assert r.status == "ok", r.mismatch
    # every request finished: every pool is back to its capacity, every row released
    books = leaked(built[0])
    assert books and set(books.values()) == {0}, leak_message(books)
    assert {"target.full", "target.swa", "req_to_token", "free_and_mapped"} <= set(books)
    if built[0].draft_pool is not None:
        assert {sp.pool_id for sp in built[0].draft_pool.sub_pools} <= set(books)
    assert r.checks > 0 and r.passed == r.checks and r.max_rel_err <= r.tolerance
    assert r.peak_swa_use > 0.9 and r.evictions > 0
    modes = {(m.worker, m.mode) for m in r.mode_stats}
    assert ("target", "extend") in modes
    if spec == "none":
        assert ("target", "decode") in modes and r.accept_len is None
    else:
        assert {("target", "target_verify"), ("draft", "draft_decode")} <= modes
        assert r.accept_len is not None and r.accept_len >= 1
    assert all(m.checks > 0 for m in r.mode_stats if m.mode != "extend"), "decode/verify/draft " \
        "calls are always checked"


@pytest.mark.parametrize("spec", ["eagle3", "frozen_kv_mtp"])
def test_gemma4_split_geometry_passes(spec: str) -> None:
    # Gemma 4's head dims and KV heads per group; a 256-key window keeps prompts ~300 tokens
    r = _run(f"spec={spec}", "model=gemma4", "model.sliding_window=256")
    assert r.status == "ok", r.mismatch
    assert r.peak_swa_use > 0.9 and r.evictions > 0
    assert r.layers_attended == [53, 57, 58, 59]  # two per group, every geometry


def test_tree_verify_by_cascade() -> None:
    r = _run("spec=eagle3", "model=gpt_oss_20b", "backend.tree_mask=cascade")
    assert r.status == "ok" and r.parts["tree"] == "cascade"


GRAPHS_SHRINK = ["workload.max_running_requests=4", "workload.num_requests=6"]
FAULTS = {  # fault → (spec it belongs to, the check that must catch it)
    "skip_spec_translation": ("eagle3", "space"),
    "allocator_pool_for_own_pool_draft": ("dflash", "space"),
    "swa_pool_missed": ("dflash", "space"),  # its SWA group reads full slots of its split pool
    "pool_cached_at_init": ("frozen_kv_mtp", "space"),  # full slots in the SWA group: typed
    "window_off_by_one": ("none", "oracle"),
    "no_swa_eviction": ("none", "capacity"),
    "no_draft_headroom": ("eagle", "capacity"),
    # chains reject a few drafts per step and the SWA share has the slack; a tree (eagle3) or a
    # DFlash block rejects more, and the SWA pool runs out before the end (capacity) instead
    "leak_rejected_draft_slots": ("eagle", "leak"),
    # the field's later SWA + spec bug classes
    "plan_without_window": ("none", "oracle"),  # a chunk's later queries see past W
    "sink_dropped": ("none", "oracle"),  # gpt_oss_20b has sinks
    "fp8_descale_dropped": ("none", "oracle"),  # the harness's fp8 scales are 1/8-1/32
    "premature_free_on_reject": ("eagle", "space"),  # the guards: an SWA hole in the window
    "tree_mask_not_rebased": ("eagle3", "oracle"),  # nodes past depth lose window-edge keys
    # the guards: a partly freed page leaves SWA holes where the key list starts
    "paged_free_stale_mapping": ("none", "space"),
    "graph_pad_stale_swa_loc": ("none", "space"),  # the replay guard: padding writes a live slot
    # draft windows: a block's later queries see past theirs; the draft reads group 0's window
    "block_window_one_left_bound": ("dflash", "oracle"),
    "draft_planned_with_group0": ("eagle3", "oracle"),
    # a window-retained draft admitted at the whole sequence: no request fits the SWA share
    "windowed_draft_admitted_as_full": ("eagle3", "capacity"),
    # the third round: verify and draft passes on SWA targets
    "swa_metadata_missing_in_spec_modes": ("eagle", "space"),  # a freed slot in the list
    "window_gather_from_zero": ("eagle", "space"),  # the first keys: freed SWA slots
    "verify_rows_share_write_loc": ("eagle", "nan"),  # the rows' other slots: poisoned
    "verify_as_decode": ("eagle", "oracle"),  # a row sees the rows after it
    "lookahead_not_retained": ("eagle", "space"),  # the window's oldest key was freed
    "frozen_draft_fp8_unscaled": ("frozen_kv_mtp", "oracle"),  # the harness's scales 1/8-1/32
}
# faults of the engine's own path (its graph keying), shown by run=generate on CPU
# (tests/engine/test_graph_routes.py) and on their launch lines (test_fault_acted.py)
ENGINE_FAULTS = {"graph_key_without_mode": ("dflash", "space"),
                 "graph_draft_extend_untranslated": ("eagle3", "nan")}
# what a fault needs to bite besides its spec (the CPU runs use gpt_oss_20b, sinks included)
FAULT_OVERRIDES = {"fp8_descale_dropped": ["backend.kv_dtype=fp8_e4m3"],
                   "swa_pool_missed": ["spec.draft_pool_split=true"],
                   "paged_free_stale_mapping": ["backend.page_size=16"],
                   # graphs (emulated on CPU), and a batch that shrinks inside its bucket of 4
                   "graph_pad_stale_swa_loc": ["backend.cuda_graph=true", *GRAPHS_SHRINK],
                   "graph_key_without_mode": ["backend.cuda_graph=true"],
                   "block_window_one_left_bound": ["spec.draft_window=16"],
                   "draft_planned_with_group0": ["spec.draft_window=16"],
                   "windowed_draft_admitted_as_full": ["spec.draft_window=16",
                                                       "spec.draft_kv_retention=window"],
                   "frozen_draft_fp8_unscaled": ["backend.kv_dtype=fp8_e4m3"],
                   "graph_draft_extend_untranslated": [
                       "run=generate", "backend.cuda_graph=true", "spec.draft_window=16",
                       "spec.draft_kv_retention=window", "spec.draft_weights=random"]}


def test_graph_replays_pass_as_batches_shrink_inside_a_bucket() -> None:
    """The clean twin of graph_pad_stale_swa_loc's run: the same load through graphs (recorded
    and re-run on CPU) passes (verify graphs: run=generate's test and the GPU tests)."""
    r = _run("spec=none", "model=gpt_oss_20b", "backend.cuda_graph=true", *GRAPHS_SHRINK)
    assert r.status == "ok", r.mismatch
    use = r.parts["cuda_graphs"]
    assert "recorded (emulated" in use and " 0 replays" not in use, use
    assert r.graph_state_bytes > 0  # the write slots of every captured bucket, in report.json


def test_leaked_names_every_pool_and_a_split_draft_pool_shares_the_target_count() -> None:
    from swafactory.harness.setup import Parts
    from swafactory.kvcache import ReqToToken, RequestSlots, build_draft_pool, build_pools

    cfg = swafactory.compose(["model=tiny", "spec=dflash", "spec.draft_pool_split=true",
                              "backend=torch"])
    pool, alloc = build_pools(cfg, 64, 32)
    dpool = build_draft_pool(cfg, pool, alloc)
    slots = RequestSlots(alloc, ReqToToken(2, 64))
    parts = Parts(cfg, None, pool, alloc, slots, None, None, dpool, None, None, None)
    zeros = {"target.full": 0, "target.swa": 0, "draft.full": 0, "draft.swa": 0,
             "req_to_token": 0, "free_and_mapped": 0}
    slots.open("a")
    slots.extend("a", 10)
    assert leaked(parts) == zeros and leak_message(zeros) == "no leaks"
    slots.truncate("a", 4, leak_rejected_draft_slots=True)  # 6 rejected, SWA side kept
    slots.finish("a")
    books = leaked(parts)
    assert books == {**zeros, "target.swa": 6, "draft.swa": 6, "free_and_mapped": 6}
    msg = leak_message(books)
    assert "target.swa 6 slots" in msg and "draft.swa 6 slots" in msg and "target.full" not in msg


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_each_fault_fails_the_run_naming_its_check(fault: str) -> None:
    """In process, on GPT-OSS's geometry (sinks included); the CLI's side of every fault (exit
    1, the check named on stderr, result.json) runs on its documented launch line
    (test_fault_acted.py), so each run here skips a process start."""
    spec, check = FAULTS[fault]
    report = _run(f"spec={spec}", "model=gpt_oss_20b", f"faults={fault}",
                  *FAULT_OVERRIDES.get(fault, ()))
    assert report.status == "failed" and report.fault == fault, report.mismatch
    assert report.mismatch is not None and report.mismatch.check == check, report.mismatch
    assert report.fault_acted.get(fault, 0) > 0, report.fault_acted


def test_cli_writes_a_valid_report_and_a_png(tmp_path) -> None:
    out = run_cli(["backend=torch", "model=tiny", f"hydra.run.dir={tmp_path}"], timeout=300,
                  cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    Report.model_validate_json((tmp_path / "report.json").read_text())
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "forwards and oracle checks" in out.stdout


def test_triton_backend_under_the_interpreter_on_tiny(tmp_path) -> None:
    """triton through the CLI, on the full layers and the draft's; the SWA layers on torch through
    `backend.groups.swa` (a kernel per layer group; triton's windows run in the backend tests)."""
    pytest.importorskip("triton")
    # prompts W+2..W+8 (smoke's run to W+128): each still crosses the window and the draft still
    # verifies every step, in about half the interpreted time
    out = run_cli(["backend=triton", "model=tiny", "backend.groups.swa=torch", "spec=eagle3",
                   "backend.kv_dtype=float32", "workload.num_requests=2",
                   "workload.prompt_over_window=[2,8]", f"hydra.run.dir={tmp_path}"],
                  timeout=600, cwd=tmp_path, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    r = Report.model_validate_json((tmp_path / "report.json").read_text())
    assert r.backend == "triton" and r.status == "ok" and r.checks == r.passed > 0
    assert r.parts["kernel"].startswith("triton") and "torch" in r.parts["kernel"]


@pytest.mark.parametrize("fault", ["none", "window_off_by_one", "pool_cached_at_init"])
def test_long_forwards_checked_layer_by_layer_catch_the_same(fault: str, monkeypatch) -> None:
    """Every forward takes the path a Gemma 4 prefill chunk takes on a GPU (one sync per layer,
    no outputs kept): clean runs still pass, and faults are caught by the same check."""
    from swafactory.harness import workers

    monkeypatch.setattr(workers, "_KEEP_BYTES", 0)
    spec, caught = FAULTS.get(fault, ("eagle3", None))
    faults = [] if fault == "none" else [f"faults={fault}"]
    r = _run(f"spec={spec}", "model=gpt_oss_20b", *faults)
    if caught is None:
        assert r.status == "ok" and r.checks > 0 and r.passed == r.checks, r.mismatch
    else:
        assert r.status == "failed" and r.mismatch.check == caught, r.mismatch


# an override that takes one need away from the configuration a fault's test uses
TAKES_AWAY = {"backend.cuda_graph=true": "backend.cuda_graph=false",
              "backend.kv_dtype=fp8_e4m3": "backend.kv_dtype=bfloat16",
              "backend.page_size > 1": "backend.page_size=1",
              "model.attention_sinks=true": "model.attention_sinks=false",
              "model.hybrid_pool=true": "model.hybrid_pool=false",
              "spec.topk > 1": "spec=eagle", "a speculative spec (not spec=none)": "spec=none",
              "spec=dflash": "spec=eagle",
              "spec.draft_kv_retention=window": "spec.draft_kv_retention=full",
              "spec.draft_kv=own_pool": "spec=frozen_kv_mtp",
              "spec.draft_kv=target_pool": "spec=eagle",
              "spec.draft_pool_split=false": "spec.draft_pool_split=true",
              "spec.draft_pool_split=true": "spec.draft_pool_split=false",
              "run=conformance": "run=generate"}


@pytest.mark.parametrize("fault", sorted(FAULT_NEEDS))
def test_a_fault_that_could_not_act_is_refused_naming_what_it_needs(fault: str) -> None:
    """A fault switched on where it cannot act (no graphs, no fp8, no sinks, no tree, no SWA
    pool, ...) would let the run pass as if it proved something: each need taken away is
    refused, naming the need, the field's value and the fix, before any backend is chosen; the
    configuration the fault tests use is accepted."""
    spec, _ = FAULTS.get(fault) or ENGINE_FAULTS[fault]
    base = ["model=gpt_oss_20b", f"spec={spec}", f"faults={fault}",
            *FAULT_OVERRIDES.get(fault, ())]
    used = swafactory.compose(["backend=torch", *base])
    assert all(n.holds(used) for n in FAULT_NEEDS[fault]) and not swafactory.check(used)
    for need in FAULT_NEEDS[fault]:
        bare = swafactory.compose(["backend=auto", *base, TAKES_AWAY[need.needs]])
        assert not need.holds(bare)
        reasons = [r for r in swafactory.check(bare) if r.field == need.field]
        assert len(reasons) == 1 and reasons[0].fix == need.fix and reasons[0].rule == "faults_rule"
        assert f"faults={fault} needs {need.needs}" in reasons[0].message
        with pytest.raises(swafactory.ConfigError) as refused:
            swafactory.validate(bare)
        text = str(refused.value)
        assert f"faults={fault} cannot act with backend=auto" in text
        assert "found no backend" not in text and "registered backend" not in text
