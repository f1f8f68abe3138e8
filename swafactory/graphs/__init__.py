"""The CUDA-graph contract in one room: the state a captured step reads and its refill (`state`),
the bucket sizes and key bounds, torch-free so `run=plan` can read them (`sizing`), the base
class of `AttentionBackend` that sizes, captures and replays (`contract`), and a runner's capture
and replay of every layer's attention, emulated on CPU (`replay`). Nothing is imported here, so
``swafactory.graphs.sizing`` stays importable without torch."""

__all__ = ["contract", "replay", "sizing", "state"]
