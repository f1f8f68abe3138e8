"""Which window each layer of a runner reads (``layer -> W or None``), from its role and the
config: the target's layer types, a FROZEN_KV draft's binding to target layers, or an own
pool's layer types. `build_backend` derives them; `check_own_pool` refuses a pool that holds
other layers than the config describes. The window convention itself is `swafactory.window`'s.
"""
from __future__ import annotations

from collections.abc import Mapping

from swafactory.config.schema import SwaFactoryConfig
from swafactory.errors import ConfigError, Reason
from swafactory.resolve.layout import frozen_draft_binding
from swafactory.resolve.source import RunnerView

__all__ = ["model_windows", "runner_windows", "check_own_pool"]


def _windows(cfg: SwaFactoryConfig, layer_types) -> dict[int, int | None]:
    w = cfg.model.sliding_window
    return {i: (w if t == "sliding_attention" else None) for i, t in enumerate(layer_types)}


def model_windows(cfg: SwaFactoryConfig) -> dict[int, int | None]:
    """The *target's* ``layer -> W`` for sliding layers, None for full ones (masking, not pool
    choice). A draft's layers are keyed differently: see `runner_windows`.
    """
    return _windows(cfg, cfg.model.layer_types)


def runner_windows(cfg: SwaFactoryConfig, view: RunnerView) -> dict[int, int | None]:
    """``layer -> W or None`` of the runner behind ``view``, from what its layers really read.

    From the role and the config only (a FROZEN_KV view's active pool at build time is a dummy
    the engine swaps):

    * ``target``: the model's layer types (`model_windows`);
    * ``draft_reads_target`` (FROZEN_KV): draft layer j takes the window of the target layer it
      is bound to (`swafactory.resolve.layout.frozen_draft_binding`);
    * ``draft_own_pool``: a split own pool (DFlash ``draft_pool_split`` on a split target) has the
      target's last ``draft_num_layers`` layer types, as `kvcache.draft.build_draft_pool` builds
      it; any other own pool is one full-attention pool (no window).
    """
    m, s = cfg.model, cfg.spec
    if view.role == "target":
        return model_windows(cfg)
    if view.role == "draft_reads_target":
        target = model_windows(cfg)
        return {j: target[t] for j, t in enumerate(frozen_draft_binding(cfg))}
    if view.role == "draft_own_pool":
        split = getattr(s, "draft_pool_split", False) and bool(m.swa_layers) and m.hybrid_pool
        types = m.layer_types[-s.draft_num_layers:] if split else \
            ("full_attention",) * s.draft_num_layers
        return _windows(cfg, types)
    raise ValueError(f"role must be target, draft_own_pool or draft_reads_target, "
                     f"got {view.role!r}")


def check_own_pool(view: RunnerView, windows: Mapping[int, int | None]) -> None:
    """A pool the runner owns (target, own-pool draft) must hold only derived layers, and a split
    one must keep exactly its windowed layers in its SWA sub-pool: else the config describes
    another runner than the engine built, and the windows would be wrong without an error."""
    lmap = view.active_pool.layers_mapping
    split = getattr(view.active_pool, "is_split", False)
    bad = sorted(set(lmap) - set(windows)) or [
        j for j, (sub, _) in sorted(lmap.items())
        if split and (sub == "swa") != (windows[j] is not None)]
    if bad:
        derived = {j: windows.get(j) for j in sorted(windows)}
        pool = {j: sub for j, (sub, _) in sorted(lmap.items())}
        field = "spec.draft_pool_split" if view.role == "draft_own_pool" else "model.layer_types"
        raise ConfigError([Reason(
            "spec" if view.role == "draft_own_pool" else "model", field,
            f"the {view.role} runner's pool holds layers {pool} but the config gives it windows "
            f"{derived} (layers {bad} disagree)",
            "build the pool from the same config (swafactory.kvcache.build_draft_pool), or pass "
            "build_backend(..., windows=) explicitly", rule="windows")])
