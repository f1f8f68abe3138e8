"""The serving core (`swafactory.serving.scheduler`): one scheduler admits, prefills, decodes, runs the
spec table, evicts and finishes for every payload. A payload that only records its forwards
shows what the scheduler decides by itself; the drivers schedule nothing of their own."""
from __future__ import annotations

import random
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

import swafactory
from swafactory.errors import CapacityError
from swafactory.fault_counts import FAULT_COUNTS
from swafactory.kvcache.shares import size_pools
from swafactory.registry.device import detect_device
from swafactory.registry.select import validate
from swafactory.harness.loop import Req  # a plain request: the scheduler needs no more
from swafactory.serving.scheduler import Payload, Scheduler
from swafactory.serving.parts import Parts, build_serving
from swafactory.serving.speculative import seeded_accept, seeded_tree

ROOT = Path(swafactory.__file__).parent
CHUNK, R = 8, 2


class _Recorder(Payload):
    """Runs no attention: records each forward's shapes and how many requests were running."""

    def __init__(self, parts: Parts, prompts: list[int], outs: list[int]) -> None:
        self.p, self.cfg, self.rng = parts, parts.cfg, random.Random(0)
        self.forwards: list[tuple[str, str, list[tuple[int, int, int]]]] = []
        self.most_running = 0
        self.core = Scheduler(parts, self, [Req(i, p, o) for i, (p, o)
                                            in enumerate(zip(prompts, outs))])

    def forward(self, worker, mode, reqs, check=True) -> None:
        self.forwards.append((worker, mode, [(f.rid, f.prefix_len, f.nodes) for f in reqs]))
        self.most_running = max(self.most_running, len(self.running))

    def advanced(self, r, n, kind) -> None:
        r.generated += (0 if r.prefilling else 1) if kind == "prefill" else n

    def start_tree(self, reqs):
        s = self.cfg.spec
        return {r.rid: list(seeded_tree(s.topk, s.num_steps, self.rng)) for r in reqs}

    def grow_tree(self, reqs, level, tree) -> None:
        return None

    def accept(self, verify):
        return seeded_accept(verify.parents, verify.nodes, self.rng)

    def on_commit(self, rid, committed, path) -> None:
        return None


def _served(spec: str, *overrides: str) -> tuple[_Recorder, list[int]]:
    cfg = swafactory.compose(["backend=torch", "model=tiny", f"spec={spec}", "workload=smoke",
                              "workload.num_requests=5", f"workload.max_running_requests={R}",
                              f"workload.chunk_size={CHUNK}", *overrides])
    cfg = validate(cfg, detect_device("cpu"))
    rng = random.Random(3)
    prompts = [cfg.model.sliding_window + rng.randint(4, 40) for _ in range(5)]
    outs = [rng.randint(3, 9) for _ in range(5)]
    sizes = size_pools(cfg, R, max(p + o for p, o in zip(prompts, outs)) + 8, chunk=CHUNK)
    sv = build_serving(cfg, sizes, "cpu", check_mode=True)
    none = lambda modes, max_bs=None: 0  # noqa: E731 - no graphs: nothing to capture
    parts = Parts.of(cfg, sizes, sv, SimpleNamespace(name="target", writes=True,
                                                     backend=sv.target, capture_all=none))
    if sv.draft is not None:
        parts.draft = SimpleNamespace(name="draft", writes=sv.draft_pool is not None,
                                      backend=sv.draft, capture_all=none)
    return _Recorder(parts, prompts, outs), prompts


@pytest.mark.parametrize("spec", ["none", "eagle", "eagle3", "frozen_kv_mtp", "dflash"])
def test_the_scheduler_serves_a_workload_by_itself(spec: str) -> None:
    rec, prompts = _served(spec)
    rec.run()
    core, parts = rec.core, rec.p
    assert len(core.done) == 5 and not core.running and not core.waiting
    assert all(r.generated >= r.out for r in core.done)
    assert set(parts.slots.leaks().values()) == {0}  # every slot and row back
    assert 0 < rec.most_running <= R
    prefilled: dict[int, int] = {}
    for worker, mode, reqs in rec.forwards:
        if mode == "extend":
            assert all(n <= CHUNK for _, _, n in reqs)
            for rid, prefix, n in reqs:
                assert prefix == prefilled.get(rid, 0)  # chunks in order, none skipped
                prefilled[rid] = prefix + n
    assert prefilled == dict(enumerate(prompts))
    assert core.evicted > 0  # every prompt passes the window
    modes = {(w, m) for w, m, _ in rec.forwards}
    if spec == "none":
        assert ("target", "decode") in modes and not core.accepts
    else:
        assert {("draft", "draft_decode"), ("target", "target_verify")} <= modes
        assert core.accepts and all(a >= 1 for a in core.accepts)
        assert (("draft", "draft_extend") in modes) == parts.draft.writes


def test_without_eviction_a_request_stops_at_its_swa_share() -> None:
    FAULT_COUNTS.clear()
    rec, _ = _served("none", "faults=no_swa_eviction")
    with pytest.raises(CapacityError, match="SWA share is full"):
        rec.run()
    assert FAULT_COUNTS.of(["no_swa_eviction"])["no_swa_eviction"] > 0


def test_the_drivers_schedule_nothing_of_their_own() -> None:
    """Admission, eviction and the spec step are the scheduler's: neither payload package
    opens, evicts or finishes a request's slots, or builds a spec step."""
    bad = re.compile(r"\.evict_out_of_window\(|SpecStep\(|while self\.waiting|slots\.(open|finish)\(")
    found = [f"{p.relative_to(ROOT)}: {m.group(0)}"
             for pkg in ("harness", "engine", "drafts", "models")
             for p in sorted((ROOT / pkg).rglob("*.py"))
             if p.name != "world.py"  # the tests' one-forward world opens its own requests
             for m in bad.finditer(p.read_text())]
    assert not found, found
    assert bad.search((ROOT / "serving" / "scheduler.py").read_text())
