"""The generate payload: a small continuous-batching generator on HF model definitions (the
`models` extra), served through swafactory's serving core (`swafactory.serving`).

`run_generate(cfg)` (`run`) builds the model of ``model=<key>`` (random weights, or
``model.checkpoint``; `swafactory.models`) and its draft (`swafactory.drafts`), serves them with
the HF runner (`runner`), the generator loop and its requests (`generator`, `requests`), checks
the result against transformers (`checks`, `oracle_watch`) and writes the generate report
(`report`, `report_model`); ``python -m swafactory run=generate``. transformers is imported when
a run starts, never at import time.
"""
from __future__ import annotations

__all__ = ["run_generate"]


def __getattr__(name: str):
    if name == "run_generate":
        from swafactory.engine.run import run_generate

        return run_generate
    raise AttributeError(f"module 'swafactory.engine' has no attribute {name!r}")
