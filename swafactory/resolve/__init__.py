"""Which pool and which window each runner and layer reads: the runner's view and the pure
function that picks the pool it translates full slots against, once per forward (`source`), the
windows of a runner's layers and the own-pool check (`runner_windows`), and the plan summary of a
config with the binding of a FROZEN_KV draft's layers to the target's (`layout`). Nothing is
imported here: import the module you need."""

__all__ = ["layout", "runner_windows", "source"]
