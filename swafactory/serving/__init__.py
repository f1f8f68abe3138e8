"""The one serving core: the parts a served model runs on, built once from a config (`parts`:
`Parts`, `build_serving`, `FrozenSwap`), the continuous-batching scheduler (`scheduler`), the
spec step's verify, accept and KV moves (`speculative`) and the pinned host readback of a step's
ids (`readback`). The payloads (the conformance harness, the generate run) plug in here and are
never imported by it. Nothing is imported here: import the module you need."""

__all__ = ["parts", "readback", "scheduler", "speculative"]
