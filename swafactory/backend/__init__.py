"""`build_backend(cfg, pools=…, view=…) -> AttentionBackend`: resolver + planner + kernel adapter.

The embedding contract. A host engine gives swafactory a *view*: four facts read fresh on every
forward (`swafactory.resolve.source.RunnerView`):

* ``active_pool``: the `HybridSWAPool` this runner's attention reads and writes now (a FROZEN_KV
  draft may swap it between forwards);
* ``allocator_pool``: the pool of the shared allocator (the target's);
* ``role``: ``target``, ``draft_own_pool`` or ``draft_reads_target``;
* ``spec_algorithm``: the spec key (``none``, ``eagle3``, ``frozen_kv_mtp``, …).

Per forward the engine calls `init_forward_metadata(batch)` once (the only place the resolver
runs and the only host work), then `forward(q, k, v, layer_id)` once per layer. Adapters wire the
plan's tables to a kernel and hold no pool logic. CUDA graphs: `init_cuda_graph_state`,
`init_forward_metadata_capture` and `init_forward_metadata_replay` (`swafactory.graphs.state`).

Three parts, one class: planning and the guards (`core`), the CUDA-graph contract
(`graphs.contract`), the per-layer path (`layer_path`). The fault catalog's injections live in a
subclass, `faulty.FaultyBackend`, which `build_backend` (`build`) composes only when the config
switches a fault on: the default path has no fault branch. `backend=auto`'s timer, which builds
backends and times each candidate's passes on a GPU, is `timing` (imported by the CLI only).
"""
from swafactory.backend.build import build_backend
from swafactory.backend.core import AttentionBackend
from swafactory.backend.layer_path import LayerEntry
from swafactory.resolve.runner_windows import model_windows, runner_windows
from swafactory.resolve.source import TargetView

__all__ = ["AttentionBackend", "LayerEntry", "build_backend", "TargetView", "model_windows",
           "runner_windows"]
