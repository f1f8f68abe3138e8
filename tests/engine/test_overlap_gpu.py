"""run.overlap=true on CUDA: the generation loop makes no host sync but the readback's.

Each shipped spec (every file under conf/spec/) generates on backend=flashinfer and
backend=triton, the kernels an engine runs ahead with (the torch backend's fp32 reference reads
its indptrs back on every layer, so there the host never runs ahead). The main generation runs
under ``torch.cuda.set_sync_debug_mode("error")``: any synchronizing call (a read back, a
blocking copy) raises where it is made, in swafactory, the allocator or the model code alike.
The one wait the generator makes on purpose, `readback.Readback.wait` (a forward's event, one
forward late), runs in the "default" mode and is counted; nothing else may sync. The run must
then be ok: its tokens equal those of the same run without overlap (the run's own ``overlap``
check) and of spec=none (``lossless``).

    python -m pytest -m gpu tests/engine/test_overlap_gpu.py
"""
from __future__ import annotations

import traceback

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

import swafactory  # noqa: E402
from swafactory.config.paths import group_options  # noqa: E402
from swafactory.engine import generator  # noqa: E402
from swafactory.serving import readback  # noqa: E402
from swafactory.engine.run import run_generate  # noqa: E402
from swafactory.registry.table import get_capabilities  # noqa: E402

SPECS = group_options("spec")  # every spec family the project ships a config for
BACKENDS = ("flashinfer", "triton")
# head_dim 64 (both backends serve it) with sinks and SWA layers; a few short requests. The
# oracle watch is off: it reads its sampled rows back every step (a checking instrument, whose
# own readback is a sync by design), and this test watches the engine's path alone
SMALL = ["run=generate", "model=gpt_oss_20b", "workload.device=cuda", "run.overlap=true",
         "run.oracle=false",
         "workload.num_requests=4", "workload.max_running_requests=4",
         "workload.output_len=[8,12]"]


def _needs(backend: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for module, extra in get_capabilities(backend).requires:
        pytest.importorskip(module, reason=f"backend={backend} needs {module} "
                                           f"(pip install '{extra}')")


@pytest.mark.gpu
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_overlap_loop_makes_no_sync_but_the_readback(monkeypatch, backend: str,
                                                         spec: str) -> None:
    _needs(backend)
    run, wait = generator.Generator.run, readback.Readback.wait
    watched: dict = {"runs": 0, "waits": 0, "raised": None}

    def waited(self):  # the readback's own event wait: the one sync the loop makes on purpose
        if not watched["on"]:
            return wait(self)
        watched["waits"] += 1
        torch.cuda.set_sync_debug_mode("default")
        try:
            return wait(self)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    def checked(self) -> None:
        watched["runs"] += 1
        if watched["runs"] > 1:  # the twin without overlap and the references: not watched
            return run(self)
        torch.cuda.synchronize()  # what set-up queued is not the loop's
        watched["on"] = True
        torch.cuda.set_sync_debug_mode("error")
        try:
            run(self)
        except RuntimeError:
            watched["raised"] = traceback.format_exc()
            raise
        finally:
            torch.cuda.set_sync_debug_mode("default")
            watched["on"] = False

    watched["on"] = False
    monkeypatch.setattr(generator.Generator, "run", checked)
    monkeypatch.setattr(readback.Readback, "wait", waited)
    cfg = swafactory.compose([*SMALL, f"backend={backend}", f"spec={spec}"])
    reasons = swafactory.check(cfg)
    if reasons:
        pytest.skip("; ".join(r.message for r in reasons))
    r = run_generate(cfg)
    assert watched["raised"] is None, (
        f"overlap {backend}/{spec}: a host sync outside the readback:\n{watched['raised'][-3000:]}")
    assert watched["waits"] > 0, "the watched loop never waited for a readback"
    assert r.status == "ok", (r.caught_by, r.error, r.checks)
    checks = {c.name: c for c in r.checks}
    assert checks["overlap"].status == "ok" and "diverged" not in checks["overlap"].detail, \
        checks["overlap"]
    if spec != "none":
        assert r.lossless is True, checks.get("lossless")
