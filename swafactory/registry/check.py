"""`check(cfg, device) -> list[Reason]`: every reason a combination cannot run, never the first only.

Rules come from the backend's declared capabilities, from sglang's rejection rules
(`sglang-swa-facts.md` §E) and from DESIGN invariants 6 (sizing) and 7 (config-time validation).
"""
from __future__ import annotations

import math
from dataclasses import replace
from collections.abc import Iterator

from swafactory.config.schema import SwaFactoryConfig
from swafactory.errors import Reason
from swafactory.kvcache.sizing import swa_tokens_per_request
from swafactory.registry.capabilities import Capabilities
from swafactory.registry.device import DeviceInfo
from swafactory.registry.draft_rules import draft_sink_rule, draft_window_rule, split_drafter_rule
from swafactory.registry.fault_needs import faults_rule
from swafactory.registry.kernel_choice import kernel_choice
from swafactory.registry.table import get_capabilities, has_adapter

__all__ = ["check", "kernel_groups", "routed_passes"]


def check(cfg: SwaFactoryConfig, device: DeviceInfo) -> list[Reason]:
    """All reasons ``cfg`` cannot run on ``device``; empty means it can. `auto` must be resolved.

    Each kernel is checked against the layer groups it serves (`kernel_groups`): a kernel named
    by `backend.groups.<g>` is held to group g's geometry only, and its reasons name that field.
    """
    if cfg.backend.name == "auto":
        raise ValueError("resolve backend=auto first (registry.select.resolve_auto)")
    reasons: list[Reason] = []
    for name, groups in kernel_groups(cfg).items():
        caps = get_capabilities(name)
        for rule in _KERNEL_RULES:
            for r in rule(cfg, caps, device, groups):
                reasons.append(_scoped(r, rule, cfg, name, groups))
    tri = get_capabilities("triton")
    for group, passes in routed_passes(cfg).items():  # a library's passes on our kernels
        for rule in _KERNEL_RULES:
            for r in rule(cfg, tri, device, (group,)):
                reasons.append(_routed(r, rule, group, passes))
    caps = get_capabilities(cfg.backend.name)
    for rule in _CONFIG_RULES:
        reasons.extend(replace(r, rule=rule.__name__.lstrip("_")) for r in rule(cfg, caps, device, ()))
    seen: set[tuple[str, str]] = set()  # a rule every kernel breaks alike is said once
    return [r for r in reasons if (r.field, r.message) not in seen
            and not seen.add((r.field, r.message))]


def kernel_groups(cfg: SwaFactoryConfig) -> dict[str, tuple[str, ...]]:
    """Registry key → the layer groups (`swa`, `full`) of the model it serves; `backend.name`
    first. A group without layers is served by nobody here (a draft runner's layers still
    follow `backend.kernel_for`)."""
    m, b = cfg.model, cfg.backend
    out: dict[str, tuple[str, ...]] = {b.name: ()}
    for group, layers in (("swa", m.swa_layers), ("full", m.full_layers)):
        if layers:
            name = b.kernel_for(group == "swa")
            out[name] = (*out.get(name, ()), group)
    if not out[b.name] and len(out) > 1:
        del out[b.name]  # every group has its own kernel: backend.name serves none of them
    return out


def routed_passes(cfg: SwaFactoryConfig) -> dict[str, tuple[str, ...]]:
    """Layer group → its passes that ``backend.kernels`` hands from the group's library family
    to the triton family's adapter (`BackendSpec.family_for`): checked as triton's."""
    m, b = cfg.model, cfg.backend
    out: dict[str, tuple[str, ...]] = {}
    for group, layers in (("swa", m.swa_layers), ("full", m.full_layers)):
        sliding = group == "swa"
        if layers and b.kernel_for(sliding) != "triton":
            passes = tuple(p for p in ("decode", "verify", "extend")
                           if b.family_for(sliding, p) == "triton")
            if passes:
                out[group] = passes
    return out


def _routed(r: Reason, rule, group: str, passes: tuple[str, ...]) -> Reason:
    """A reason of the triton adapter serving a routed pass names the field that routed it."""
    field = f"backend.kernels.{group}." + "/".join(passes)
    return replace(r, part="backend", rule=rule.__name__.lstrip("_"),
                   field=field if r.field == "backend.name" else r.field,
                   message=f"{field} runs on the triton family's kernels: {r.message}",
                   fix=f"{field}=auto" if r.field == "backend.name" else r.fix)


def _scoped(r: Reason, rule, cfg: SwaFactoryConfig, name: str, groups: tuple[str, ...]) -> Reason:
    """A reason of a group's own kernel names the field that chose it."""
    r = replace(r, rule=rule.__name__.lstrip("_"))
    if name == cfg.backend.name:
        return r
    field = "backend.groups." + "/".join(groups)
    return replace(r, part="backend", field=field if r.field == "backend.name" else r.field,
                   message=f"{field}={name}: {r.message}",
                   fix=r.fix if r.field != "backend.name" else f"{field}=null")


def _served(cfg: SwaFactoryConfig, groups: tuple[str, ...]) -> Iterator[tuple[str, object, tuple]]:
    """(group, geometry, layer ids) of each group in ``groups`` that has layers."""
    m = cfg.model
    for group, geo, layers in (("swa", m.swa, m.swa_layers), ("full", m.full, m.full_layers)):
        if group in groups and geo is not None and layers:
            yield group, geo, layers


def _r(field: str, message: str, fix: str | None = None) -> Reason:
    return Reason(field.split(".")[0], field, message, fix)


def _adapter(cfg: SwaFactoryConfig, caps: Capabilities, dev: DeviceInfo,
            groups: tuple[str, ...] = ("swa", "full")) -> Iterator[Reason]:
    if not has_adapter(caps.name):
        yield _r("backend.name", f"swafactory declares {caps.name}'s capabilities but has no "
                                 f"adapter that calls its kernels yet, so nothing can run on it")


def _device(cfg: SwaFactoryConfig, caps: Capabilities, dev: DeviceInfo,
            groups: tuple[str, ...] = ("swa", "full")) -> Iterator[Reason]:
    name = caps.name
    if dev.kind == "cpu":
        if "cpu" in caps.devices:
            return
        if caps.cpu_needs_interpreter and dev.triton_interpret:
            if cfg.backend.kv_dtype in ("bfloat16", "fp8_e4m3"):  # fp8 K/V compute in bf16
                # measured: the interpreter's tl.dot of two bf16 tiles is off by ~1e10 (its numpy
                # emulation has no bfloat16); fp16 and fp32 match torch exactly
                yield _r("backend.kv_dtype", f"the Triton interpreter (TRITON_INTERPRET=1) "
                         f"computes bfloat16 dot products wrongly, and kv_dtype="
                         f"{cfg.backend.kv_dtype} computes in bfloat16",
                         "backend.kv_dtype=float16 (or float32)")
            return
        archs = "" if caps.cuda_archs is None else " of " + "/".join(f"SM{a}" for a in sorted(caps.cuda_archs))
        extra = " (or set TRITON_INTERPRET=1 to run its kernels on CPU tensors, slowly)" \
            if caps.cpu_needs_interpreter else ""
        note = f" ({caps.arch_note})" if caps.arch_note else ""
        yield _r("backend.name", f"{name} needs a CUDA GPU{archs}{note}; this device is cpu{extra}")
    elif dev.kind not in caps.devices:
        note = f" ({caps.devices_note})" if caps.devices_note else ""
        yield _r("backend.name", f"{name} does not run on {dev.kind}{note}")
    elif caps.cuda_archs is not None and dev.sm not in caps.cuda_archs:
        want = "/".join(f"SM{a}" for a in sorted(caps.cuda_archs))
        yield _r("backend.name", f"{name} needs {want}; this device is {dev.describe()} "
                                 f"({caps.arch_note})")


def _packages(cfg: SwaFactoryConfig, caps: Capabilities, dev: DeviceInfo,
            groups: tuple[str, ...] = ("swa", "full")) -> Iterator[Reason]:
    for module, requirement in caps.requires:
        if module not in dev.packages:
            yield _r("backend.name", f"{caps.name} needs the `{module}` package, which is not "
                                     f"installed", f"pip install '{requirement}'")


def _page_size(cfg: SwaFactoryConfig, caps: Capabilities, dev: DeviceInfo,
            groups: tuple[str, ...] = ("swa", "full")) -> Iterator[Reason]:
    ps = cfg.backend.page_size
    if caps.page_sizes is not None and ps not in caps.page_sizes:
        ok = sorted(caps.page_sizes)
        yield _r("backend.page_size", f"{caps.name} serves page sizes {ok}, got {ps}",
                 f"backend.page_size={ok[-1]}")


def _head_dims(cfg: SwaFactoryConfig, caps: Capabilities, dev: DeviceInfo,
            groups: tuple[str, ...] = ("swa", "full")) -> Iterator[Reason]:
    for group, geo, layers in _served(cfg, groups):
        m, d = cfg.model, geo.head_dim
        too_big = caps.max_head_dim is not None and d > caps.max_head_dim
        not_listed = caps.head_dims is not None and d not in caps.head_dims
        if too_big or not_listed:
            limit = (f"head_dim ≤ {caps.max_head_dim}" if too_big
                     else f"head dims {sorted(caps.head_dims or ())}")
            note = f" ({caps.head_dim_note})" if caps.head_dim_note else ""
            yield _r(f"model.{group}.head_dim",
                     f"{_the_layers(layers, group)} of {m.name} {_have(layers)} head_dim {d}; "
                     f"{caps.name} serves {limit}{note}")


def _the_layers(layers, group: str) -> str:
    """"the 10 full layers" / "the 1 full layer" (a 6-layer Gemma 4 has one full layer)."""
    return f"the {len(layers)} {group} layer{'s' if len(layers) != 1 else ''}"


def _have(layers) -> str:
    return "have" if len(layers) != 1 else "has"


def _geometry(cfg: SwaFactoryConfig, caps: Capabilities, dev: DeviceInfo,
            groups: tuple[str, ...] = ("swa", "full")) -> Iterator[Reason]:
    m = cfg.model
    if not caps.per_group_geometry and len(groups) == 2 and m.swa != m.full:
        yield _r("model.name", f"{caps.name} plans one head geometry, but {m.name}'s sliding and "
                               "full layers differ in KV heads or head_dim")


def _window(cfg: SwaFactoryConfig, caps: Capabilities, dev: DeviceInfo,
            groups: tuple[str, ...] = ("swa", "full")) -> Iterator[Reason]:
    if "swa" in groups and not caps.sliding_window:
        yield _r("model.name", f"{caps.name} cannot apply a sliding window")


def _tree(cfg: SwaFactoryConfig, caps: Capabilities, dev: DeviceInfo,
            groups: tuple[str, ...] = ("swa", "full")) -> Iterator[Reason]:
    spec, b = cfg.spec, cfg.backend
    if not spec.is_tree:
        return
    if not caps.tree_masks:
        yield _r("spec.topk", f"topk={spec.topk} verifies a tree, and {caps.name} serves no tree "
                              "mask (sglang refuses trtllm_mha with topk > 1); spec=eagle drafts a "
                              "chain", "spec=eagle")
    elif b.tree_mask not in caps.tree_masks:
        other = sorted(caps.tree_masks)[0]
        yield _r("backend.tree_mask", f"{caps.name} serves tree masks by {sorted(caps.tree_masks)}, "
                                      f"not {b.tree_mask!r}", f"backend.tree_mask={other}")
    if caps.tree_masks and b.page_size > 1 and not caps.paged_trees:
        yield _r("backend.page_size", f"{caps.name} verifies trees (topk > 1) only with page_size 1 "
                                      f"(sglang: FA3 SWA spec metadata asserts page_size == 1), got "
                                      f"{b.page_size}", "backend.page_size=1")


def _dflash(cfg: SwaFactoryConfig, caps: Capabilities, dev: DeviceInfo,
            groups: tuple[str, ...] = ("swa", "full")) -> Iterator[Reason]:
    if cfg.spec.algorithm == "dflash" and not caps.non_causal_draft:
        yield _r("spec.algorithm", f"dflash drafts a block with non-causal attention inside it, "
                                   f"which {caps.name} cannot mask")


def _sinks(cfg: SwaFactoryConfig, caps: Capabilities, dev: DeviceInfo,
            groups: tuple[str, ...] = ("swa", "full")) -> Iterator[Reason]:
    if cfg.model.attention_sinks and not caps.sinks:
        note = f" ({caps.sinks_note})" if caps.sinks_note else ""
        yield _r("model.attention_sinks", f"{cfg.model.name} uses attention sinks, which "
                                          f"{caps.name} does not serve here{note}")


def _softcap(cfg: SwaFactoryConfig, caps: Capabilities, dev: DeviceInfo,
            groups: tuple[str, ...] = ("swa", "full")) -> Iterator[Reason]:
    if cfg.model.logit_softcap is not None and not caps.softcap:
        yield _r("model.logit_softcap", f"{caps.name} has no logit soft-capping")


def _dtype(cfg: SwaFactoryConfig, caps: Capabilities, dev: DeviceInfo,
            groups: tuple[str, ...] = ("swa", "full")) -> Iterator[Reason]:
    dt = cfg.backend.kv_dtype
    if dt not in caps.kv_dtypes:
        ok = sorted(caps.kv_dtypes)
        yield _r("backend.kv_dtype", f"{caps.name} stores KV as {ok}, got {dt!r}",
                 f"backend.kv_dtype={'bfloat16' if 'bfloat16' in ok else ok[0]}")
        return
    if dt != "fp8_e4m3" or caps.fp8_max_head_dim is None or dev.kind != "cuda" or \
            dev.sm not in caps.fp8_limited_archs:
        return
    m = cfg.model
    for group, geo, layers in _served(cfg, groups):
        if geo.head_dim > caps.fp8_max_head_dim:
            note = f" ({caps.fp8_note})" if caps.fp8_note else ""
            yield _r("backend.kv_dtype",
                     f"{_the_layers(layers, group)} of {m.name} {_have(layers)} head_dim "
                     f"{geo.head_dim}; "
                     f"{caps.name} reads fp8 KV up to head_dim {caps.fp8_max_head_dim} on "
                     f"SM{dev.sm}{note}", f"backend.groups.{group}=triton")


def _cuda_graph(cfg: SwaFactoryConfig, caps: Capabilities, dev: DeviceInfo,
            groups: tuple[str, ...] = ("swa", "full")) -> Iterator[Reason]:
    if not cfg.backend.cuda_graph:
        return
    if not caps.replays_graphs(dev.kind) and caps.cuda_graph:
        yield _r("backend.cuda_graph", f"{caps.name} captures CUDA graphs, which need a CUDA "
                 f"device; this device is {dev.kind}", "backend.cuda_graph=false, or backend=torch "
                 "(replays emulated on CPU)")
    elif not caps.replays_graphs(dev.kind):
        where = "CUDA-graph path" if dev.kind == "cuda" else f"graph replay on {dev.kind}"
        yield _r("backend.cuda_graph", f"{caps.name} has no {where}", "backend.cuda_graph=false")
    if cfg.backend.tree_mask == "cascade":
        yield _r("backend.tree_mask", "a cascade's prefix/expand split depends on each batch, so "
                 "a captured graph cannot replay it", "backend.tree_mask=custom_mask")


def _resolver(cfg: SwaFactoryConfig, caps: Capabilities, dev: DeviceInfo,
            groups: tuple[str, ...] = ("swa", "full")) -> Iterator[Reason]:
    m, spec, policy = cfg.model, cfg.spec, cfg.backend.resolver
    split = bool(m.swa_layers) and m.hybrid_pool
    if not split or policy == "auto":
        return
    if policy == "allocator" and spec.draft_kv == "own_pool":
        yield _r("backend.resolver",
                 f"the {spec.algorithm} draft owns a full-index pool; resolving through the "
                 "allocator would translate its reads with the target's full→SWA mapping (the "
                 "sglang FlashInfer + DFlash and trtllm_mha + EAGLE bugs, #27737/#25103)",
                 "backend.resolver=auto")
    if policy == "active_pool" and spec.draft_kv == "target_pool":
        yield _r("backend.resolver",
                 "the frozen_kv_mtp draft's own pool is not split, so pinning the active pool would "
                 "send full indices to the target's SWA layers (sglang #26957)",
                 "backend.resolver=auto")


def _sizing(cfg: SwaFactoryConfig, caps: Capabilities, dev: DeviceInfo,
            groups: tuple[str, ...] = ("swa", "full")) -> Iterator[Reason]:
    m, w = cfg.model, cfg.workload
    if not (m.swa_layers and m.hybrid_pool and m.sliding_window) or w.swa_full_tokens_ratio == "auto":
        return
    need = min(w.context_len, swa_tokens_per_request(m.sliding_window, cfg.spec.draft_tokens_per_step,
                                                     cfg.backend.page_size))
    have = math.floor(w.context_len * w.swa_full_tokens_ratio)
    if have < need:
        ratio = math.ceil(100 * need / w.context_len) / 100
        yield _r("workload.swa_full_tokens_ratio",
                 f"the SWA pool holds {have} tokens per request (context_len {w.context_len} × "
                 f"ratio {w.swa_full_tokens_ratio}), but each request needs W + draft tokens + page "
                 f"= {need} (DESIGN invariant 6)", f"workload.swa_full_tokens_ratio={min(1.0, ratio)}")


def _parallel(cfg: SwaFactoryConfig, caps: Capabilities, dev: DeviceInfo,
            groups: tuple[str, ...] = ("swa", "full")) -> Iterator[Reason]:
    tp, m = cfg.parallel.tp, cfg.model
    if tp == 1:
        return
    kv_heads = [geo.num_kv_heads for geo in (m.swa, m.full) if geo is not None]
    # the largest smaller tp that splits the query heads and splits or replicates every KV group
    fix = "parallel.tp=" + str(max(d for d in range(1, tp) if m.num_attention_heads % d == 0
                                   and all(kv % d == 0 or d % kv == 0 for kv in kv_heads)))
    if m.num_attention_heads % tp:
        ok = [d for d in range(1, m.num_attention_heads + 1) if m.num_attention_heads % d == 0]
        yield _r("parallel.tp", f"{m.num_attention_heads} query heads of {m.name} do not split "
                                f"over {tp} ranks; tp must divide them: {ok}", fix)
    for group, geo in (("swa", m.swa), ("full", m.full)):
        if geo is None:
            continue
        kv = geo.num_kv_heads
        if kv % tp and tp % kv:
            yield _r(f"model.{group}.num_kv_heads",
                     f"{kv} KV heads neither split over {tp} ranks nor replicate evenly onto them "
                     "(need kv % tp == 0, or tp % kv == 0 to replicate)", fix)


# rules of one kernel against the groups it serves; rules of the configuration, checked once
_KERNEL_RULES = (_adapter, _device, _packages, _page_size, _head_dims, _geometry, _window, _tree,
                 _dflash, _sinks, _softcap, _dtype, _cuda_graph, draft_sink_rule)
_CONFIG_RULES = (_resolver, _sizing, _parallel, draft_window_rule, split_drafter_rule, faults_rule,
                 kernel_choice)
