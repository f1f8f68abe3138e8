"""A small continuous-batching generator on HF model definitions (the `models` extra).

`run_generate(cfg)` builds the model of ``model=<key>`` (random weights, or
``model.checkpoint``), serves it through swafactory's pools, allocator, `RequestSlots`, SWA
eviction and the built backend, drives the spec table with greedy drafts, and checks the
result against transformers (``python -m swafactory run=generate``). transformers is imported
when a run starts, never at import time.
"""
from __future__ import annotations

__all__ = ["run_generate"]


def __getattr__(name: str):
    if name == "run_generate":
        from swafactory.engine.run import run_generate

        return run_generate
    raise AttributeError(f"module 'swafactory.engine' has no attribute {name!r}")
