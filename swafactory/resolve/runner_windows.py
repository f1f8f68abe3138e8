"""Which window each layer of a runner reads (``layer -> W or None``), from its role and the
config: the target's layer types, a FROZEN_KV draft's binding to target layers, or an own
pool's layer types. `build_backend` derives them; `check_own_pool` refuses a pool that holds
other layers than the config describes. The window convention itself is `swafactory.window`'s.
"""
from __future__ import annotations

from collections.abc import Mapping

from swafactory.config.schema import SwaFactoryConfig
from swafactory.errors import ConfigError, Reason
from swafactory.kvcache.draft import draft_layer_types
from swafactory.resolve.layout import frozen_draft_binding
from swafactory.resolve.source import RunnerView
from swafactory.window import narrowed

__all__ = ["model_windows", "runner_windows", "check_own_pool"]


def _windows(cfg: SwaFactoryConfig, layer_types) -> dict[int, int | None]:
    w = cfg.model.sliding_window
    return {i: (w if t == "sliding_attention" else None) for i, t in enumerate(layer_types)}


def model_windows(cfg: SwaFactoryConfig) -> dict[int, int | None]:
    """The *target's* ``layer -> W`` for sliding layers, None for full ones (masking, not pool
    choice). A draft's layers are keyed differently: see `runner_windows`.
    """
    return _windows(cfg, cfg.model.layer_types)


def runner_windows(cfg: SwaFactoryConfig, view: RunnerView, *, draft_window: bool = True
                   ) -> dict[int, int | None]:
    """``layer -> W or None`` of the runner behind ``view``, from what its layers really read.

    From the role and the config only (a FROZEN_KV view's active pool at build time is a dummy
    the engine swaps):

    * ``target``: the model's layer types (`model_windows`);
    * ``draft_reads_target`` (FROZEN_KV): draft layer j takes the window of the target layer it
      is bound to (`swafactory.resolve.layout.frozen_draft_binding`);
    * ``draft_own_pool``: the layer types `kvcache.draft.draft_layer_types` gives the pool it
      builds: a split own pool (DFlash ``draft_pool_split`` on a split target) has the target's
      last ``draft_num_layers`` layer types, a window-retained one
      (``spec.draft_kv_retention=window``) only sliding layers, any other own pool only
      full-attention ones (no window).

    A draft's layers then read ``spec.draft_window`` where it is narrower (`window.narrowed`);
    ``draft_window=False`` gives the windows of their layer types alone (what the pool holds).
    """
    if view.role == "target":
        return model_windows(cfg)
    if view.role == "draft_reads_target":
        target = model_windows(cfg)
        out = {j: target[t] for j, t in enumerate(frozen_draft_binding(cfg))}
    elif view.role == "draft_own_pool":
        out = _windows(cfg, draft_layer_types(cfg))
    else:
        raise ValueError(f"role must be target, draft_own_pool or draft_reads_target, "
                         f"got {view.role!r}")
    if not draft_window:
        return out
    return {j: narrowed(w, cfg.spec.draft_window) for j, w in out.items()}


def check_own_pool(view: RunnerView, windows: Mapping[int, int | None], model=None) -> None:
    """A pool the runner owns (target, own-pool draft) must hold only derived layers, and a split
    one must keep exactly its windowed layers in its SWA sub-pool: else the config describes
    another runner than the engine built, and the windows would be wrong without an error.
    model: the backend's `ModelSpec`, named with the pools' own model in the message."""
    pool = view.active_pool
    lmap = pool.layers_mapping
    split = getattr(pool, "is_split", False)
    bad = sorted(set(lmap) - set(windows)) or [
        j for j, (sub, _) in sorted(lmap.items())
        if split and (sub == "swa") != (windows[j] is not None)]
    if not bad:
        return
    kinds = "".join("F" if windows[j] is None else "S" for j in sorted(windows))
    ours = f"{len(kinds)} layers {_pattern(kinds)}"
    if model is not None:
        w = f", window {model.sliding_window}" if model.sliding_window else ""
        ours = f"model {model.name} ({ours}{w}; {_geometry(model)})"
    where = _layers(bad)
    if view.role == "draft_own_pool":
        raise ConfigError([Reason(
            "spec", "spec.draft_pool_split",
            f"the draft's own pool ({_pool(pool)}) is not the one this config's draft has "
            f"({len(kinds)} layers {_pattern(kinds)}; S sliding, F full): {where} disagree, as "
            "when the pool was built with another spec.draft_pool_split",
            "build the draft pool from the same config as the backend: "
            "swafactory.kvcache.build_draft_pool(cfg, pool, alloc)", rule="windows")])
    theirs = getattr(pool, "model", None)
    raise ConfigError([Reason(
        "model", "model",
        f"this backend is built for {ours}, but its pools were built for "
        f"{theirs or 'another config'} ({_pool(pool)}; S sliding, F full): {where} disagree",
        "build the backend from the config the pools were built from: "
        "build_backend(cfg, pools=pool) with the cfg given to build_pools"
        + (f" (model={theirs})" if theirs else ""), rule="windows")])


def _pattern(kinds: str) -> str:
    """``SFSFSF`` → ``SF×3``: the shortest unit that repeats to the whole string."""
    n = len(kinds)
    for p in range(1, n + 1):
        if n % p == 0 and kinds[:p] * (n // p) == kinds:
            return kinds if p == n else f"{kinds[:p]}×{n // p}"
    return kinds


def _geometry(m) -> str:
    """``sliding 8 KV heads × 64, full 8 KV heads × 64``: each group's KV geometry."""
    parts = [f"{what} {g.num_kv_heads} KV heads × {g.head_dim}"
             for what, g in (("sliding", m.swa), ("full", m.full)) if g is not None]
    return ", ".join(parts)


def _pool(pool) -> str:
    """A pool in one line: its layers' sub-pools as S/F and each sub-pool's KV geometry."""
    lmap = pool.layers_mapping
    kinds = "".join("S" if lmap[j][0] == "swa" else "F" for j in sorted(lmap))
    subs = sorted(pool.sub_pools, key=lambda p: p.space != "swa")  # sliding first, as models
    subs = ", ".join(f"{'sliding' if p.space == 'swa' else 'full'} {p.num_kv_heads} KV heads × "
                     f"{p.head_dim}" for p in subs)
    return f"{len(kinds)} layers {_pattern(kinds)}; {subs}"


def _layers(ids: list[int]) -> str:
    shown = ", ".join(map(str, ids[:6]))
    return f"layer{'s' if len(ids) > 1 else ''} {shown}" + (
        f" and {len(ids) - 6} more" if len(ids) > 6 else "")
