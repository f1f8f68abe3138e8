"""The registry's rules for a draft's windows and where its K/V lives: `spec.draft_window`,
`spec.draft_sink`, `spec.draft_kv_retention` and DFlash's `spec.draft_pool_split`.

The spec validates each field alone (> 0, DFlash's window holds its block, a sink or a window
retention needs a window, FROZEN_KV retains nothing); these rules need the model, the run and
the backend beside it. Every rule yields all its reasons, each with the override that fixes it.
"""
from __future__ import annotations

from collections.abc import Iterator

from swafactory.config.schema import SwaFactoryConfig
from swafactory.errors import Reason
from swafactory.kvcache.draft import draft_layer_types
from swafactory.registry.capabilities import Capabilities
from swafactory.registry.device import DeviceInfo

__all__ = ["draft_window_rule", "split_drafter_rule", "draft_sink_rule"]

_COPIES = ("eagle", "eagle3", "nextn", "standalone")
"""Algorithms whose ``draft_weights=target`` draft in `run=generate` is a copy of every target
layer, each keeping its own K/V (`models.build`)."""


def _r(field: str, message: str, fix: str | None = None) -> Reason:
    return Reason(field.split(".")[0], field, message, fix)


def draft_window_rule(cfg: SwaFactoryConfig, caps: Capabilities, dev: DeviceInfo,
                      groups: tuple[str, ...] = ()) -> Iterator[Reason]:
    """``draft_kv_retention=window`` puts the draft's K/V on the target's SWA slots: the target
    must split its pool, its window must cover the draft's (it frees a slot once the slot leaves
    its own window), and the draft must be one pool of its own layers."""
    s, m = cfg.spec, cfg.model
    if s.draft_kv_retention != "window":
        return
    fix = "spec.draft_kv_retention=full"
    if not (m.swa_layers and m.hybrid_pool and m.sliding_window):
        yield _r("spec.draft_kv_retention", f"draft_kv_retention=window keeps the draft's K/V on "
                 f"the target's SWA slots, but model={m.name} has no SWA pool (sliding layers "
                 "and model.hybrid_pool=true)", fix)
        return
    if s.draft_window is not None and s.draft_window > m.sliding_window:
        yield _r("spec.draft_window", f"the target frees an SWA slot once it leaves its window of "
                 f"{m.sliding_window}, so a window-retained draft cannot read "
                 f"draft_window={s.draft_window} keys back",
                 f"spec.draft_window={m.sliding_window}")
    if getattr(s, "draft_pool_split", False):
        yield _r("spec.draft_pool_split", "draft_pool_split=true mirrors the target's layer types "
                 "in the draft pool, and draft_kv_retention=window puts every draft layer on the "
                 "SWA side: choose one", "spec.draft_pool_split=false")
    if cfg.run.mode == "generate" and s.draft_weights == "target" and s.algorithm in _COPIES:
        yield _r("spec.draft_kv_retention", f"with draft_weights=target the {s.algorithm} draft "
                 "is a copy of every target layer, each keeping its own layer type's K/V; a "
                 "window retention needs a draft of its own layers",
                 "spec.draft_weights=distilled")


def split_drafter_rule(cfg: SwaFactoryConfig, caps: Capabilities, dev: DeviceInfo,
                       groups: tuple[str, ...] = ()) -> Iterator[Reason]:
    """A drafter of its own weights (EAGLE heads, a distilled draft) has one KV geometry, the
    target's full layers'; a pool with sliding draft layers
    (`draft_pool_split`, `draft_kv_retention=window`) gives those the target's SWA geometry."""
    s, m = cfg.spec, cfg.model
    if cfg.run.mode != "generate" or m.swa is None or m.full is None \
            or "sliding_attention" not in draft_layer_types(cfg):
        return
    if s.algorithm == "dflash" and s.draft_weights != "target":
        return  # a DFlash drafter takes the SWA geometry for its sliding layers (drafts.dflash)
    if s.draft_weights == "target" and not (  # DFlash's own layers: the target's last ones
            s.algorithm == "dflash" and s.draft_kv_retention == "window"
            and "full_attention" in m.layer_types[-s.draft_num_layers:]):
        return  # a split pool mirrors their types; copies are draft_window_rule's
    swa, full = (m.swa.num_kv_heads, m.swa.head_dim), (m.full.num_kv_heads, m.full.head_dim)
    if swa == full:
        return
    if s.draft_kv_retention == "window":
        field, fix = "spec.draft_kv_retention", "spec.draft_kv_retention=full"
    else:
        field, fix = "spec.draft_pool_split", "spec.draft_pool_split=false"
    pool = "window-retained" if s.draft_kv_retention == "window" else "split"
    yield _r(field, f"the {s.algorithm} drafter of {s.draft_weights!r} weights has full layers of "
             f"the target's full geometry ({full[0]} KV heads of {full[1]}), but the {pool} "
             f"draft pool gives its sliding layers model={m.name}'s SWA geometry ({swa[0]} of "
             f"{swa[1]})", fix)


def draft_sink_rule(cfg: SwaFactoryConfig, caps: Capabilities, dev: DeviceInfo,
                    groups: tuple[str, ...] = ("swa", "full")) -> Iterator[Reason]:
    """Sink keys beside a draft window are a kernel's to read (a second key range), from a
    pool that keeps them: one whose draft layers are full-indexed. A pool on the target's SWA
    slots (FROZEN_KV's reads, a split DFlash pool, a copy's sliding layers) frees them once they
    leave the target's window."""
    s, m = cfg.spec, cfg.model
    if not s.draft_sink:
        return
    if not caps.draft_sink:
        yield _r("spec.draft_sink", f"draft_sink={s.draft_sink} reads each request's first "
                 f"keys beside the draft window, which {caps.name}'s kernels do not here",
                 "spec.draft_sink=0")
    split = bool(m.swa_layers and m.hybrid_pool)
    copy = cfg.run.mode == "generate" and s.draft_weights == "target" and s.algorithm in _COPIES
    where = ("reads the target's pool" if s.draft_kv == "target_pool" else
             "has a split pool" if getattr(s, "draft_pool_split", False) else
             "is a copy of every target layer" if copy else None)
    if split and where is not None and "sliding_attention" in m.layer_types:
        yield _r("spec.draft_sink", f"the {s.algorithm} draft {where}, whose sliding layers' "
                 f"K/V sits on the target's SWA slots: model={m.name}'s SWA pool frees the "
                 f"sink's {s.draft_sink} keys once they leave its window of {m.sliding_window}",
                 "spec.draft_sink=0")
