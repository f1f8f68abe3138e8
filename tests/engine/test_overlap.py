"""run=generate with run.overlap=true: the host plans forward N+1 before forward N's tokens
come back, as sglang's overlap scheduler does.

Every spec generates the same tokens as without overlap (the run's own ``overlap`` check) and
stays lossless and close to transformers; nothing reads a forward's results back except the
readback's copy into host memory, and with overlap that copy is waited for one forward late,
but where a host decision needs it (a tree's next level, a step's accept lengths with no
forward to hide them behind).
"""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

import swafactory  # noqa: E402
from swafactory.config.paths import group_options  # noqa: E402
from swafactory.engine import generator  # noqa: E402
from swafactory.serving import readback  # noqa: E402
from swafactory.engine.run import run_generate  # noqa: E402
from swafactory.engine.runner import Runner  # noqa: E402

SPECS = group_options("spec")  # every spec the registry has a file for
SMALL = ["run=generate", "backend=torch", "model=tiny", "workload.num_requests=2",
         "workload.seed=1", "workload.max_running_requests=2", "workload.prompt_over_window=[4,20]",
         "workload.output_len=[5,7]", "workload.chunk_size=16", "run.hidden_size=32",
         "run.intermediate_size=32", "run.vocab_size=128", "model.sliding_window=16"]

HOST_READS = {"tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__"}


class _OnDevice(torch.Tensor):
    """A forward's logits and everything computed from them: reading one on the host raises."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            raise AssertionError(f"a forward's result read on the host ({func.__name__}) "
                                 "outside the readback")
        return super().__torch_function__(func, types, args, kwargs or {})


def _gen(*overrides: str):
    return run_generate(swafactory.compose([*SMALL, *overrides]))


@pytest.mark.parametrize("spec", SPECS)
def test_overlap_generates_the_tokens_of_no_overlap_losslessly(spec: str) -> None:
    r = _gen(f"spec={spec}", "run.overlap=true")
    assert r.status == "ok", (r.caught_by, r.error, r.checks)
    checks = {c.name: c for c in r.checks}
    assert checks["overlap"].status == "ok" and "diverged" not in checks["overlap"].detail, \
        checks["overlap"]
    assert r.overlap and r.tokens_per_s > 0 and r.tokens_per_s_no_overlap > 0
    assert checks["logits"].status == "ok"
    assert all(len(q.generated_ids) == q.max_new_tokens for q in r.requests)
    if spec != "none":
        assert r.lossless is True and checks["acceptance"].status == "ok", checks


@pytest.mark.parametrize("spec", ["none", "eagle3", "frozen_kv_mtp", "dflash"])
def test_nothing_reads_a_forward_back_but_the_readback_one_forward_late(monkeypatch,
                                                                         spec: str) -> None:
    """Every forward's logits come back wrapped so that any host read raises; only the
    readback's copy into host memory unwraps them. Each wait is recorded with the forwards
    launched by then: under overlap a forward is waited for after the next one was launched,
    but for the host decisions that have no forward to hide behind (a tree's next level,
    frozen_kv_mtp's accept lengths) and the run's last; without overlap, right away."""
    forward, host = Runner.forward, readback._host

    def wrapped(self, mode, reqs, tokens, positions, *rest, **kw):
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.as_subclass(torch.Tensor)
        return forward(self, mode, reqs, tokens, positions, *rest, **kw).as_subclass(_OnDevice)

    gens: list = []
    init = generator.Generator.__init__

    def kept(self, *a, **kw):
        init(self, *a, **kw)
        gens.append(self)

    monkeypatch.setattr(Runner, "forward", wrapped)
    monkeypatch.setattr(readback, "_host", lambda t: host(t.as_subclass(torch.Tensor)))
    monkeypatch.setattr(generator.Generator, "__init__", kept)
    r = _gen(f"spec={spec}", "run.overlap=true")
    assert r.status == "ok", (r.caught_by, r.error, r.checks)
    main, twin = gens[0], gens[1]  # the overlap run, then the same run without
    assert main.overlap and not twin.overlap
    for g in (main, twin):
        assert sorted(i for i, _, _ in g.resolved_at) == list(range(1, g.launched + 1))
    assert all(i == n for i, n, _ in twin.resolved_at)  # without overlap: right after each
    at_once = {(why, i == n) for i, n, why in main.resolved_at if i == n}
    allowed = {("end", True)}
    if spec == "eagle3":  # the tree's shape and path are host decisions
        allowed |= {("tree", True), ("accept", True)}
    if spec == "frozen_kv_mtp":  # no draft_extend to run while the accept lengths come back
        allowed |= {("accept", True)}
    assert at_once <= allowed, main.resolved_at
    late = [(i, n) for i, n, why in main.resolved_at if why == "late"]
    assert late and all(i < n for i, n in late)


def test_overlap_with_graph_replays_generates_the_tokens_of_no_overlap() -> None:
    """backend.cuda_graph=true (on CPU the torch backend's recorded steps): the replay refill of
    forward N+1 happens before forward N's tokens are back, and the tokens do not change."""
    r = _gen("spec=eagle", "backend.cuda_graph=true", "run.overlap=true")
    assert r.status == "ok", (r.caught_by, r.error, r.checks)
    assert {c.name: c.status for c in r.checks}["overlap"] == "ok"
    assert r.cuda_graphs["target"]["replays"] > 0 and r.cuda_graphs["draft"]["replays"] > 0
