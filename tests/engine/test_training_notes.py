"""A run that trains a model says so before it starts: about how long (and where the figure comes
from) and the cache path; a second run says it reuses that cache. Training is cut to a few steps
here (the recipe monkeypatched) and the cache is a temp directory."""
from __future__ import annotations

import io
import json
import re

import pytest

pytest.importorskip("transformers")

import swafactory  # noqa: E402
from swafactory.drafts import language  # noqa: E402
from swafactory.drafts.train import REFERENCE_CPU_S, Recipe, estimate  # noqa: E402
from swafactory.engine.run import run_generate  # noqa: E402

SMALL = ["run=generate", "backend=torch", "model=tiny", "spec=none", "workload.num_requests=2",
         "workload.seed=1", "workload.max_running_requests=2", "workload.prompt_over_window=[4,20]",
         "workload.output_len=[5,7]", "workload.chunk_size=16", "run.target_weights=pretrained"]


def test_a_target_to_train_says_its_estimate_and_cache_and_a_second_run_reuses_it(
        tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SWAFACTORY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(language, "PRETRAIN", Recipe(steps=3, lr=1e-2, batch=4, stop_loss=0.05))
    cfg = swafactory.compose(SMALL)
    first, second = io.StringIO(), io.StringIO()
    run_generate(cfg, progress=first)
    text = first.getvalue()
    note = re.search(r"target: not in the cache; about (\d+) s on cpu, if it is as small as "
                     r"model=tiny's, whose target took 42 s for 149 steps on a 2-core CPU .*; "
                     r"at most 3 steps, fewer once the loss converges; caching it at (\S+) ", text)
    assert note, text
    path = note.group(2)
    assert path.startswith(str(tmp_path / "targets"))
    assert text.index(note.group(0)) < text.index("target: step 1/3")  # said before it trains
    assert json.loads((tmp_path / "targets" / path.rsplit("/", 1)[1] / "swafactory.json")
                      .read_text())["trained"]["steps"] == 3
    run_generate(cfg, progress=second)
    again = second.getvalue()
    assert f"target: reusing the cached weights at {path} (trained once in" in again, again
    assert "not in the cache" not in again and "target: step" not in again


def test_the_estimate_comes_from_a_similar_cached_model_else_the_measured_reference(
        tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SWAFACTORY_CACHE_DIR", str(tmp_path))
    shape = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1}
    fields = {"draft": shape, "device": "cpu", "seed": 1}
    recipe = Recipe(steps=200, lr=1e-2, batch=16)
    secs, ref_steps = REFERENCE_CPU_S["draft eagle"]
    got = estimate("drafts", "draft eagle", fields, recipe)  # an empty cache: the reference
    assert got[0] == pytest.approx(secs / ref_steps * 200) and "model=tiny's" in got[1]
    assert estimate("drafts", "draft eagle", {**fields, "device": "cuda"}, recipe) is None
    entry = tmp_path / "drafts" / "abc"
    entry.mkdir(parents=True)
    (entry / "swafactory.json").write_text(json.dumps({
        "fields": {"draft": shape, "device": "cpu", "seed": 2},
        "trained": {"what": "draft eagle", "steps": 100, "trained_s": 30.0}}))
    got = estimate("drafts", "draft eagle", fields, recipe)  # another seed, the same shape
    assert got[0] == pytest.approx(60.0) and str(entry) in got[1]
    wider = {**fields, "draft": {**shape, "hidden_size": 128}}  # another shape: not similar
    assert "model=tiny's" in estimate("drafts", "draft eagle", wider, recipe)[1]
