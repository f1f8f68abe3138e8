"""`bench/bench_generate.py acceptance --swa-as-full` (the GPU record's way): with its smaller
prefill chunk, every shipped model's SWA pool can be the full pool's size, so the seed-2 pool
fault's slots stay inside the draft's own pool (sized as the full one) and show as the
accept-length collapse users saw. At the default chunk the window's need passed each request's
full share, the SWA pool fell back to `auto` (larger than the draft's pool) and the fault's slots
indexed past the draft pool: a device-side assert on an H100, not a collapse."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_generate as bg  # noqa: E402
from swafactory import compose  # noqa: E402
from swafactory.engine.run import draws  # noqa: E402
from swafactory.errors import ConfigError  # noqa: E402
from swafactory.kvcache.shares import size_pools  # noqa: E402
from swafactory.kvcache.sizing import step_nodes  # noqa: E402


def _sizes(model: str, family: str, extra: list[str]):
    """The pools `run=generate` sizes for the bench's row, with SWA/full = 1 (as `build` does:
    the longest request plus a step's nodes and a page, chunks capped by the longest prompt)."""
    cfg = compose([f"model={model}", "backend=torch", "run=generate", "workload=smoke",
                   *bg.FAMILIES[family],
                   "workload.device=cpu", "workload.swa_full_tokens_ratio=1", *extra])
    prompts, outs = draws(cfg, cfg.run.vocab_size)
    lens = [len(p) for p in prompts]
    longest = max(n + o for n, o in zip(lens, outs)) + step_nodes(cfg.spec) + \
        cfg.backend.page_size
    chunk = min(cfg.workload.chunk_size, max(lens))
    return size_pools(cfg, cfg.workload.max_running_requests, longest, chunk=chunk)


@pytest.mark.parametrize("family", ["eagle", "dflash"])
@pytest.mark.parametrize("model", ["gpt_oss_20b", "gemma4"])
def test_swa_as_full_chunk_makes_the_swa_pool_the_full_ones_size(model: str, family: str) -> None:
    s = _sizes(model, family, [f"workload.chunk_size={bg.SWA_AS_FULL_CHUNK}"])
    assert s.swa == s.full > 0
    with pytest.raises(ConfigError, match="swa_full_tokens_ratio"):  # why the bench lowers it
        _sizes(model, family, [])
