"""run=generate: HF model definitions on swafactory attention, checked against transformers.

Every family is lossless against spec=none and its logits match transformers' eager forward; a
self-speculating copy reaches the ideal accept length; the seed faults and the field's silent ones
are caught end to end with the guards off; a save_pretrained checkpoint generates the
same tokens as the weights it saved.
Shapes are tiny (short prompts past a 16-token window, a few tokens out) to stay cheap on 2 cores.
"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

import swafactory  # noqa: E402
from swafactory.models.hf import load_target  # noqa: E402
from swafactory.engine.run import ideal_accept, run_generate  # noqa: E402

SPECS = ["none", "eagle", "eagle3", "nextn", "standalone", "frozen_kv_mtp", "dflash"]
SMALL = ["run=generate", "backend=torch", "workload.num_requests=2", "workload.seed=1",
         "workload.max_running_requests=2", "workload.prompt_over_window=[4,20]",
         "workload.output_len=[5,7]", "workload.chunk_size=16", "run.hidden_size=32",
         "run.intermediate_size=32", "run.vocab_size=128", "model.sliding_window=16"]
GEOMETRY = {"gemma4": ["model=gemma4"], "gpt_oss_20b": ["model=gpt_oss_20b", "run.num_layers=4"]}


def _gen(*overrides: str):
    return run_generate(swafactory.compose([*SMALL, *overrides]))


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("model", sorted(GEOMETRY))
def test_every_family_is_lossless_and_matches_transformers(model: str, spec: str) -> None:
    r = _gen(*GEOMETRY[model], f"spec={spec}")
    assert r.status == "ok", (r.caught_by, r.error, r.checks)
    checks = {c.name: c for c in r.checks}
    assert r.logits_positions > 0 and r.logits_max_rel_err <= r.logits_tolerance
    assert all(len(q.generated_ids) == q.max_new_tokens for q in r.requests)
    assert r.serving_model["swa"]["head_dim"] == swafactory.compose([GEOMETRY[model][0]]).model.swa.head_dim
    if spec == "none":
        assert r.lossless is None and r.accept_len is None
        return
    assert r.lossless is True and checks["lossless"].status == "ok"
    assert checks["acceptance"].status == "ok"
    ideal = ideal_accept(swafactory.compose([f"spec={spec}"]).spec)
    if ideal is not None:  # a self-speculating copy commits the ideal length every step
        assert r.ideal_accept_len == ideal
        assert {a for q in r.requests for a in q.accept_lengths} == {ideal}
    if spec != "frozen_kv_mtp":  # a draft that writes its pool is checked against its model
        assert checks["draft_logits"].status == "ok"


@pytest.mark.parametrize(("fault", "spec", "model", "symptom"), [
    ("skip_spec_translation", "eagle3", "tiny", "kernel"),  # full slots index the SWA pool: OOB
    ("allocator_pool_for_own_pool_draft", "dflash", "tiny", "draft_logits"),
    ("pool_cached_at_init", "frozen_kv_mtp", "tiny", "kernel"),  # the dummy pool's geometry
    # the field's bug classes: wrong numbers with no error, so only the logits show them
    ("plan_without_window", "none", "tiny", "logits"),  # prompts pass W = 16
    ("tree_mask_not_rebased", "eagle3", "tiny", "logits"),  # a tree's deep nodes
    ("sink_dropped", "none", "gpt_oss_20b", "logits"),  # GPT-OSS's sinks
    # the third round: a verify or a draft extend that reads or writes the wrong K/V
    ("swa_metadata_missing_in_spec_modes", "eagle", "tiny", "logits"),
    ("window_gather_from_zero", "eagle", "tiny", "logits"),
    ("verify_rows_share_write_loc", "eagle", "tiny", "logits"),
    ("verify_as_decode", "eagle", "tiny", "logits"),
    ("lookahead_not_retained", "eagle", "tiny", "logits"),
])
def test_faults_are_caught_end_to_end_without_guards(fault: str, spec: str, model: str,
                                                     symptom: str) -> None:
    geometry = GEOMETRY.get(model, [f"model={model}"])
    # the attention oracle off: this proves the checks a user has without it (with it on, the
    # oracle names the pass first: tests/engine/test_generate_oracle.py)
    r = _gen(*geometry, f"spec={spec}", f"faults={fault}", "run.guards=false", "run.oracle=false")
    assert r.status == "failed" and r.caught_by == symptom, (r.caught_by, r.checks)
    assert not {"space", "nan"} & set(r.failed_checks), "the guards were off"
    clean = _gen(*geometry, f"spec={spec}", "run.guards=false")
    assert clean.status == "ok", (clean.caught_by, clean.checks)


def test_graph_replays_generate_losslessly_and_stale_padding_shows_in_the_logits() -> None:
    """backend.cuda_graph=true on CPU (the torch backend records each bucket's model call and
    re-runs it over the same buffers): lossless; graph_pad_stale_swa_loc, with batches that
    shrink inside a bucket of 4, writes padding K/V into live SWA slots: the logits are off."""
    load = ["model=tiny", "spec=eagle3", "backend.cuda_graph=true", "workload.num_requests=7",
            "workload.max_running_requests=4"]
    r = _gen(*load)
    assert r.status == "ok" and r.lossless is True, (r.caught_by, r.checks)
    assert r.cuda_graphs["target"]["replays"] > 0 and r.cuda_graphs["draft"]["replays"] > 0
    assert r.graph_state_bytes > 0  # the captured buckets' write slots, in report.json
    bad = _gen(*load, "faults=graph_pad_stale_swa_loc", "run.guards=false", "run.oracle=false")
    assert bad.status == "failed" and bad.caught_by == "logits", (bad.caught_by, bad.checks)
    # the oracle watches the replays themselves: it names the graph pass first
    seen = _gen(*load, "faults=graph_pad_stale_swa_loc", "run.guards=false", "run.oracle=true")
    assert seen.status == "failed" and seen.caught_by == "oracle", (seen.caught_by, seen.error)


def test_the_guards_catch_a_seed_fault_first() -> None:
    r = _gen("model=tiny", "spec=frozen_kv_mtp", "faults=pool_cached_at_init")
    assert r.caught_by in ("nan", "space"), (r.caught_by, r.error)


def test_a_saved_checkpoint_generates_the_tokens_of_its_weights(tmp_path) -> None:
    cfg = swafactory.compose([*SMALL, "model=tiny", "spec=eagle"])
    model, _, _ = load_target(cfg, __import__("torch").float32, "cpu")
    model.save_pretrained(tmp_path / "ckpt")
    fresh = run_generate(cfg)
    loaded = _gen("model=tiny", "spec=eagle", f"model.checkpoint={tmp_path / 'ckpt'}")
    assert loaded.status == "ok", (loaded.caught_by, loaded.checks)
    assert loaded.checkpoint == str(tmp_path / "ckpt")
    assert [q.generated_ids for q in loaded.requests] == [q.generated_ids for q in fresh.requests]
    with pytest.raises(swafactory.ConfigError, match="model.checkpoint"):
        _gen("model=tiny", f"model.checkpoint={tmp_path / 'missing'}")


def test_the_report_rebuilds_with_plain_transformers(tmp_path) -> None:
    """report.json alone (config dict, seed, post_init, prompt ids) lets plain transformers re-derive the
    generated tokens: greedy decoding with HF's own eager forward, no swafactory."""
    import torch
    import transformers

    from swafactory.engine.report import write_generate

    r = _gen("model=tiny", "spec=eagle3")
    write_generate(r, tmp_path)
    data = json.loads((tmp_path / "report.json").read_text())
    config = transformers.AutoConfig.for_model(**data["hf_config"])
    torch.manual_seed(data["seed"])
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, value in data["post_init"].items():
            model.get_parameter(name).fill_(value)
    for q in data["requests"]:
        ids = list(q["prompt_ids"])
        with torch.no_grad():
            for _ in range(q["max_new_tokens"]):
                ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
        assert ids[len(q["prompt_ids"]):] == q["generated_ids"]
    assert (tmp_path / "report.png").exists()


def test_the_report_plot_has_whole_step_ticks_and_legends_outside() -> None:
    from swafactory.engine.report import figure

    r = _gen("model=tiny", "spec=eagle3")
    fig = figure(r)
    fig.canvas.draw()
    ax, ax_pool, ax_hist = fig.axes
    assert max(len(q.accept_lengths) for q in r.requests) < 8  # few steps: where 0.25 ticks came
    for a in (ax, ax_pool, ax_hist):
        ticks = [t for t in a.get_xticks() if a.get_xlim()[0] <= t <= a.get_xlim()[1]]
        assert len(ticks) >= 2 and all(t == int(t) for t in ticks), ticks
        box = a.get_legend().get_window_extent(fig.canvas.get_renderer())
        assert box.x0 >= a.bbox.x1, (box, a.bbox)  # right of the axes, over none of the points
    bars = sum(len(c) for c in ax_hist.containers)  # a bar per request and accept length seen
    assert bars == sum(len(q.accept_histogram) - 1 for q in r.requests if q.accept_histogram)


def test_generate_fields_are_validated() -> None:
    with pytest.raises(swafactory.ConfigError, match="run.num_layers"):
        swafactory.compose(["run=generate", "model=tiny", "run.num_layers=7"])
    with pytest.raises(swafactory.ConfigError, match="experts_per_token"):
        swafactory.compose(["run=generate", "run.num_experts=2", "run.experts_per_token=3"])


def test_cli_generate_exits_by_its_checks(cli) -> None:
    # the ok path's exit 0 is the CLI's default; one subprocess keeps the suite short
    bad = cli(*SMALL, "model=tiny", "spec=eagle3", "faults=skip_spec_translation",
              "run.guards=false")
    assert bad.returncode == 1 and "caught by the kernel check" in bad.stderr, bad.stderr[-2000:]
    assert "generating: step" in bad.stdout and "lossless" in bad.stdout


def test_a_draft_that_proposes_the_wrong_token_is_named_with_both_gaps(monkeypatch) -> None:
    """A standalone draft whose second draft_decode of each step is pushed onto token 0 (a
    stale key would do the same, less loudly): the acceptance check fails and says where the
    draft and the target parted, the target's margin and the draft's, and every rejection is
    in the report."""
    from swafactory.engine.runner import Runner
    forward = Runner.forward

    def pushed(self, mode, reqs, tokens, positions, *rest, **kw):
        logits = forward(self, mode, reqs, tokens, positions, *rest, **kw)
        if self.name == "draft" and mode == "draft_decode" and reqs[0].query_from == 1:
            logits[:, 0] += 1e3
        return logits

    monkeypatch.setattr(Runner, "forward", pushed)
    r = _gen("model=tiny", "spec=standalone")
    acc = {c.name: c for c in r.checks}["acceptance"]
    assert r.status == "failed" and acc.status == "failed", acc
    assert "at position" in acc.detail and "the draft preferred 0 by" in acc.detail, acc.detail
    rej = [j for q in r.requests for j in q.rejections]
    assert rej and all(j.draft_token == 0 and j.target_token != 0 for j in rej)
    assert all(j.target_gap > 0 and j.draft_gap is not None and j.draft_gap > 0.5 for j in rej)
    # fp32: the fp64 forward at the same position agrees with the target's margin
    assert all(j.exact_gap == pytest.approx(j.target_gap, abs=1e-4) for j in rej), rej
    assert "fp64 prefers" in acc.detail and "excused" not in acc.detail, acc.detail
    assert all(len(q.rejections) <= len(q.accept_lengths) for q in r.requests)
    assert r.lossless is True  # a wrong draft costs steps, never tokens


def test_a_missed_swa_backed_draft_pool_reads_wrong_keys_and_never_crashes() -> None:
    """sglang #27737's mechanism: the DFlash draft's own split pool (draft_pool_split) written
    at its SWA slots and read with full slots. Guards on, the typed-space check stops the first
    draft forward, naming its SWA sub-pool. Guards off, the pool holds a slot per target token
    (as sglang's draft runner did), so no read leaves the buffer, even on a pool sized tight: the
    draft attends the wrong keys (shuffled pages: from the first step), which the attention
    oracle names (the CLI without it: the draft_logits check). The collapse over time, with
    pages in order, is `+experiment=seed2_dflash_swa_pool_missed` (tests/harness/test_experiments.py).
    (GPT-OSS: both groups share head_dim and KV heads; tiny and gemma4's drafters take the SWA
    geometry for their sliding layers, `drafts.dflash`.)"""
    fault = ["spec=dflash", "spec.draft_pool_split=true", "faults=swa_pool_missed",
             *GEOMETRY["gpt_oss_20b"]]
    on = _gen(*fault)
    assert on.status == "failed" and on.caught_by == "space", on.checks
    assert "'draft.swa'" in on.error, on.error
    tight = _gen(*fault, "run.guards=false")
    assert tight.status == "failed" and tight.caught_by == "oracle", tight.error
    assert "out of bounds" not in tight.error and tight.fault_acted["swa_pool_missed"] > 0
    assert "draft draft_extend layer" in tight.error and "(swa)" in tight.error, tight.error
    smoke = ["run=generate", "backend=torch", "model=gpt_oss_20b", "workload=smoke",
             "workload.num_requests=2", "run.guards=false", "spec=dflash",
             "spec.draft_pool_split=true"]
    clean = run_generate(swafactory.compose(smoke))
    assert clean.status == "ok", clean.checks
