"""bench/bench_fp8.py's table: a refused row keeps its whole reason (below the table, numbered
from its cell), and a measured row gives bf16 / fp8 and fp8 against its floor."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import bench_fp8  # noqa: E402


def test_a_refusal_keeps_its_whole_reason(tmp_path: Path) -> None:
    why = "refused: " + "the 10 full layers have head_dim 512; " * 8 + "the end"
    rows = [{"model": "gemma4", "backend": "flashinfer", "bs": 64, "ctx": 8192,
             "bfloat16": {"ms": 24.0, "floor_ms": 22.0}, "fp8_e4m3": {"error": why}},
            {"model": "gemma4", "backend": "triton", "bs": 64, "ctx": 8192,
             "bfloat16": {"ms": 26.0, "floor_ms": 22.0},
             "fp8_e4m3": {"ms": 13.0, "floor_ms": 11.0, "kv_gb": 48.0}}]
    meta = {"commit": "abc1234", "gpu": "H200", "torch": "t", "copy_tbs": 4.2, "ctx": 8192,
            "command": "python3 bench/bench_factory.py --fp8 flashinfer,triton"}
    text = bench_fp8.render(rows, meta, tmp_path)
    assert "| gemma4 | flashinfer | 64 | 24.00 | not run (1, below) | - |" in text
    assert f"- gemma4 × flashinfer, fp8: {why}\n" in text
    assert "| gemma4 | triton | 64 | 26.00 | 13.00 | 2.00× | 22.00 | 11.00 | 1.18× | 48.00 |" in text
    assert (tmp_path / "fp8-h200.md").read_text() == text
