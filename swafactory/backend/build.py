"""`build_backend(cfg, pools=…, view=…)`: validate the config for the pools' device, build the
kernel adapters (and our CUDA kernels, here, never in a forward), and compose the backend: a
`FaultyBackend` when the config switches a fault on, else the plain `AttentionBackend`."""
from __future__ import annotations

from collections.abc import Mapping

from swafactory.backend.core import AttentionBackend
from swafactory.backend.faulty import FaultyBackend
from swafactory.config.schema import SwaFactoryConfig
from swafactory.errors import ConfigError, Reason
from swafactory.kernels.cuda import KernelEnv
from swafactory.kernels.cuda.prepare import start_adapters
from swafactory.registry.device import detect_device
from swafactory.registry.kernel_choice import PASSES
from swafactory.registry.select import validate
from swafactory.registry.table import backend_module
from swafactory.resolve.source import RunnerView, TargetView
from swafactory.resolve.runner_windows import check_own_pool, runner_windows

__all__ = ["build_backend"]


def build_backend(cfg: SwaFactoryConfig, pools=None, view: RunnerView | None = None, *,
                  windows: Mapping[int, int | None] | None = None,
                  guards: bool = True) -> AttentionBackend:
    """Validate ``cfg`` for the pools' device and compose the backend.

    pools: a target `HybridSWAPool` (wrapped in a `TargetView`), or give ``view`` (drafts,
    host engines). windows: ``layer -> W or None`` of the runner's layers; the default,
    `runner_windows(cfg, view)`, follows what each layer reads (a draft's layer j is not the
    target's layer j). Pass it only to override. guards: False skips the typed-space checks of
    reads and writes and the geometry check, as an engine that embedded only the kernels would
    run (the generator's ``run.guards=false``: faults must then show end to end).
    """
    if view is None:
        if pools is None:
            raise ValueError("build_backend needs pools= (a target pool) or view= (any runner)")
        view = TargetView(pools, spec_algorithm=cfg.spec.algorithm)
    pool = view.active_pool
    device = detect_device("cuda" if pool.sub_pools[0].device.type == "cuda" else "cpu")
    cfg = validate(cfg, device)
    b = cfg.backend
    names = dict.fromkeys((b.name, *(n for n in (b.groups.swa, b.groups.full) if n),
                           *(b.family_for(s, p) for s in (True, False) for p in PASSES)))
    modules = {n: backend_module(n) for n in names}
    for n, module in modules.items():
        if not hasattr(module, "Adapter"):  # check() refused it already; a direct caller may not
            raise ConfigError([Reason("backend", "backend.name", f"{n}'s capabilities are "
                                      "declared but its adapter is not built yet",
                                      "backend=torch", rule="adapter")])
    if windows is None:
        windows = runner_windows(cfg, view)
        if view.role != "draft_reads_target":  # a FROZEN_KV view's pool is a dummy until swapped
            # the pool holds layer types; a draft window narrows reads, not where a layer lives
            check_own_pool(view, runner_windows(cfg, view, draft_window=False), cfg.model)
    adapters = {n: m.Adapter() for n, m in modules.items()}
    # the kernels' environment overrides, read here once: a layer's call reads no os.environ
    env = KernelEnv.read()
    for ad in adapters.values():
        if hasattr(ad, "env"):
            ad.env = env
    # our CUDA kernels are built here (or fall back, warned), never in a forward
    kernels = start_adapters(cfg, adapters, pool.sub_pools[0].device, device)
    # a fault's code lives in FaultyBackend only: the default class carries none
    cls = FaultyBackend if cfg.faults.active else AttentionBackend
    backend = cls(cfg, adapters[b.name], view, windows, guards, adapters=adapters)
    backend.kernels = kernels  # what serves each pass × group (KernelPolicy; .lines())
    backend.kernel_env = env  # the overrides its adapters' kernels obey (`KernelEnv`)
    return backend
