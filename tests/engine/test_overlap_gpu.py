"""run.overlap=true on CUDA: the generator's loop makes no host sync of its own.

The main generation runs under ``torch.cuda.set_sync_debug_mode("warn")``: every synchronizing
call (a read back, a blocking copy) warns from the Python line that made it. Nothing in
swafactory/engine may sync but the readback's event wait (readback.py); what syncs elsewhere
(the allocator, transformers' model code) is named in one warning, for the record.

    python -m pytest -m gpu tests/engine/test_overlap_gpu.py -rw
"""
from __future__ import annotations

import collections
import warnings
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

import swafactory  # noqa: E402
from swafactory.engine import generator  # noqa: E402
from swafactory.engine.run import run_generate  # noqa: E402

ENGINE = Path(generator.__file__).parent


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["none", "eagle", "eagle3"])
def test_the_overlap_loop_makes_no_sync_but_the_readback(monkeypatch, spec: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    run, seen = generator.Generator.run, []

    def watched(self) -> None:
        if seen:  # the reference runs after the first go unwatched
            return run(self)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                run(self)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        seen.append([w for w in caught if "synchronizing" in str(w.message)])

    monkeypatch.setattr(generator.Generator, "run", watched)
    r = run_generate(swafactory.compose([
        "run=generate", "model=tiny", f"spec={spec}", "backend=torch", "workload.device=cuda",
        "run.overlap=true", "workload.num_requests=4", "workload.max_running_requests=4",
        "workload.output_len=[8,12]"]))
    assert r.status == "ok", (r.caught_by, r.error, r.checks)
    sites = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in seen[0])
    ours = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in seen[0]
                               if Path(w.filename).parent == ENGINE
                               and Path(w.filename).name != "readback.py")
    if sites:  # for the record: the allocator's reads, the model code's
        warnings.warn(f"overlap {spec}: host syncs during the loop (file:line: count): "
                      f"{dict(sites.most_common())}", stacklevel=1)
    assert not ours, f"swafactory/engine syncs the device outside the readback: {ours}"
