"""Which kernel serves each pass × layer group (`backend.kernels`): what our own kernels can
serve (data), the registry rule that refuses a choice with every reason, and the resolution
`run=plan`, the backend and report.json show ("verify/full: cuda verify_d512 + triton extend tile
(auto: nvcc present)").

Our kernels, by pass, inside the family `backend.groups` gives a group:
- decode, family triton: the CUDA cluster decode (`decode_d64`: bf16 pool at head_dim 64;
  `decode_fp8`: fp8_e4m3 pool at head_dim 256/512), GQA group ≤ 8, no soft-cap, SM 9.x;
  else the Triton decode.
- verify, family triton or flashinfer: the CUDA dense run `verify_d512` (bf16, head_dim 512,
  group 8, ≤ 64 rows per KV head, no soft-cap, SM ≥ 8.0) beside the Triton extend tile. Under
  flashinfer our tiles serve verify of ≤ 64 rows per KV head, eagerly and in CUDA graphs
  (`kernels.flashinfer.uses_triton_verify`); FlashInfer's prefill serves wider ones.
- extend: the family's kernel (no CUDA kernel of ours holds a prefill chunk).

Under a library family, `triton` or `cuda` on a pass it serves with its own kernel (decode,
extend; any pass outside FlashInfer) hands the pass to the triton family's adapter
(`BackendSpec.family_for`, `routed`): the pass is then resolved and checked as the triton
family's, so a group can decode on our kernels and prefill on FlashInfer's.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

from swafactory.config.schema import SwaFactoryConfig, hands_to_ours
from swafactory.errors import Reason
from swafactory.metadata.batch import MODE_PASS
from swafactory.registry.device import DeviceInfo
from swafactory.registry.table import get_capabilities

__all__ = ["TILE_MAX_ROWS", "PASSES", "MODE_PASS", "PassResolution", "KernelPolicy",
           "cuda_kernel", "routed", "ours_serve", "kernel_choice", "resolve_passes", "group_facts",
           "worker_lines"]

TILE_MAX_ROWS = 64
"""Most rows per KV head (queries × GQA group) of a multi-query pass our tile serves: its query
tile (`kernels.flashinfer_passes.uses_triton_verify`). Declared here, where the policy reads it,
so the registry imports no kernel module (the adapter imports it from here)."""

PASSES = ("decode", "verify", "extend")


@dataclass(frozen=True)
class GroupFacts:
    group: str
    family: str
    head_dim: int
    gqa: int
    kv_dtype: str
    softcap: bool
    verify_tokens: int


def group_facts(cfg: SwaFactoryConfig) -> list[GroupFacts]:
    """The layer groups the model has, with what decides our kernels (per rank under tp)."""
    m, b, tp = cfg.model, cfg.backend, cfg.parallel.tp
    out = []
    for group, geo, layers in (("swa", m.swa, m.swa_layers), ("full", m.full, m.full_layers)):
        if geo is None or not layers:
            continue
        gqa = (m.num_attention_heads // tp) // max(1, geo.num_kv_heads // tp)
        out.append(GroupFacts(group, b.kernel_for(group == "swa"), geo.head_dim, gqa,
                              b.kv_dtype, m.logit_softcap is not None,
                              cfg.spec.num_draft_tokens))
    return out


def routed(g: GroupFacts, pass_: str, choice: str) -> GroupFacts:
    """``g`` as the adapter running ``pass_`` under ``choice`` sees it: the triton family where
    the choice hands a library family's pass to our kernels (`BackendSpec.family_for`)."""
    return replace(g, family="triton") if hands_to_ours(g.family, pass_, choice) else g


def ours_serve(g: GroupFacts, pass_: str) -> bool:
    """Whether our kernels (Triton, CUDA) serve this pass of a group in its family."""
    if g.family == "triton":
        return True
    rows = g.verify_tokens * g.gqa
    return g.family == "flashinfer" and pass_ == "verify" and rows <= TILE_MAX_ROWS


def cuda_kernel(g: GroupFacts, pass_: str, device: DeviceInfo) -> tuple[str | None, list[str]]:
    """(our CUDA kernel for this pass of the group, or None with every reason it has none)."""
    why: list[str] = []
    if device.kind != "cuda":
        why.append(f"our CUDA kernels need a CUDA device, this is {device.describe()}")
    if pass_ == "extend":
        return None, why + ["no CUDA kernel of ours holds a prefill chunk (the verify tile "
                            "holds 64 rows per KV head)"]
    if g.softcap:
        why.append("the model has a logit soft-cap, which our CUDA kernels do not apply")
    if pass_ == "decode":
        name = ("decode_d64" if g.kv_dtype == "bfloat16" and g.head_dim == 64 else
                "decode_fp8" if g.kv_dtype == "fp8_e4m3" and g.head_dim in (256, 512) else None)
        if g.family != "triton":
            why.append(f"{g.family} runs its own decode kernel (our CUDA decode serves "
                       f"backend.groups.{g.group}=triton)")
        if name is None:
            why.append(f"the CUDA decode serves head_dim 64 over bfloat16 or 256/512 over "
                       f"fp8_e4m3; group {g.group} has head_dim {g.head_dim} over {g.kv_dtype}")
        if not 1 <= g.gqa <= 8:
            why.append(f"the CUDA decode holds a GQA group ≤ 8, group {g.group} has {g.gqa}")
        if device.kind == "cuda" and (device.sm or 0) // 10 != 9:
            why.append(f"the CUDA decode needs thread-block clusters on SM 9.x, this is "
                       f"SM{device.sm}")
        return (name if not why else None), why
    rows = g.verify_tokens * g.gqa
    if g.verify_tokens == 0:
        why.append("the spec has no verify pass (spec=none)")
    if g.family not in ("triton", "flashinfer"):
        why.append(f"{g.family} runs its own kernel for verify")
    elif g.family == "flashinfer" and g.verify_tokens and not ours_serve(g, "verify"):
        why.append(f"under flashinfer our verify tiles serve ≤ {TILE_MAX_ROWS} rows per KV head; "
                   f"group {g.group} has {g.verify_tokens} tokens × group {g.gqa} = {rows}")
    if g.kv_dtype != "bfloat16" or g.head_dim != 512 or g.gqa != 8:
        why.append(f"the CUDA verify tile serves a bfloat16 pool at head_dim 512 and GQA group 8; "
                   f"group {g.group} has {g.kv_dtype}, head_dim {g.head_dim}, group {g.gqa}")
    elif rows > 64:
        why.append(f"the CUDA verify tile holds 64 rows per KV head; {g.verify_tokens} tokens × "
                   f"group {g.gqa} = {rows}")
    if device.kind == "cuda" and (device.sm or 0) < 80:
        why.append(f"the CUDA verify tile needs SM ≥ 80, this is SM{device.sm}")
    return (None if why else "verify_d512"), why


def _library_kernel(family: str, pass_: str) -> str:
    if family == "flashinfer":
        return "flashinfer BatchDecode" if pass_ == "decode" else "flashinfer BatchPrefill"
    return get_capabilities(family).kernel


def kernel_choice(cfg: SwaFactoryConfig, caps, device: DeviceInfo,
                       groups: tuple[str, ...] = ()) -> Iterator[Reason]:
    """Every `backend.kernels` choice this backend and geometry cannot run, each with what would
    work instead (registry rule, checked once per configuration)."""
    del caps, groups
    facts = {g.group: g for g in group_facts(cfg)}
    kc = cfg.backend.kernels
    for group in ("swa", "full"):
        choice = getattr(kc, group)
        for pass_ in PASSES:
            c = getattr(choice, pass_)
            if c == "auto":
                continue
            field = f"backend.kernels.{group}.{pass_}"
            g = facts.get(group)
            if g is None:
                yield Reason("backend", field, f"{c}: {cfg.model.name} has no "
                             f"{'sliding' if group == 'swa' else 'full'} layers", f"{field}=auto",
                             rule="kernel_choice")
                continue
            gp = routed(g, pass_, c)  # a library's decode or extend handed to our kernels
            if c == "library" and g.family == "triton":
                yield Reason("backend", field, "library: group " + group + " runs on triton, "
                             "our own kernels; `library` picks a kernel library's (flashinfer, "
                             "flash_attn, …)", f"{field}=auto", rule="kernel_choice")
            elif c == "triton" and not ours_serve(gp, pass_):
                yield Reason("backend", field, f"triton: {g.family} serves group {group}'s "
                             f"{pass_} passes with its own kernel", f"backend.groups.{group}"
                             f"=triton or {field}=auto", rule="kernel_choice")
            elif c == "cuda":
                name, why = cuda_kernel(gp, pass_, device)
                if name is None:
                    alt = replace_family(g, "triton")
                    ok = (cuda_kernel(alt, pass_, device)[0] is not None
                          and g.family != "triton")
                    fix = (f"backend.groups.{group}=triton" if ok else f"{field}=auto")
                    yield Reason("backend", field, "cuda: " + "; ".join(why), fix,
                                 rule="kernel_choice")


def replace_family(g: GroupFacts, family: str) -> GroupFacts:
    return replace(g, family=family)


@dataclass(frozen=True)
class PassResolution:
    """What serves one pass of one layer group, and why."""

    pass_: str
    group: str
    kernel: str
    why: str
    cuda: bool
    """Our CUDA kernel serves it (where a call's shapes fit)."""
    ours: bool
    """Our kernels (Triton or CUDA) serve it rather than the family's library."""
    cuda_name: str | None = None
    allow_cuda: bool = False
    """The adapter may hand a call to our CUDA kernel where its shapes fit: not where the config
    says `triton`/`library`, a benchmark override is set, or the kernel did not build."""

    def __str__(self) -> str:
        return f"{self.pass_}/{self.group}: {self.kernel} ({self.why})"


def resolve_passes(cfg: SwaFactoryConfig, device: DeviceInfo, *, nvcc: bool,
                   override: Mapping[str, str | None] | None = None,
                   failures: Mapping[tuple[str, str], str] | None = None
                   ) -> tuple[PassResolution, ...]:
    """Each pass × group of ``cfg`` on ``device``: the kernel and why (`auto` resolved).

    nvcc: whether nvcc was found; override: pass → the benchmark environment variable switching
    our CUDA kernels off (`kernels.cuda.launch.env_override`); failures: (pass, group) → why its
    CUDA kernel did not build (filled by `kernels.cuda.prepare`)."""
    out = []
    override, failures = override or {}, failures or {}
    for gf in group_facts(cfg):
        choice = getattr(cfg.backend.kernels, gf.group)
        for pass_ in PASSES:
            if pass_ == "verify" and gf.verify_tokens == 0:
                continue
            c = getattr(choice, pass_)
            g = routed(gf, pass_, c)  # resolved as the adapter that runs it sees it
            beside = "" if g is gf else f", beside {gf.family}"
            ours = ours_serve(g, pass_) and c != "library"
            tri = ("triton decode" if pass_ == "decode" else "triton extend tile")
            if not ours:
                # auto: the call's shapes still decide (flashinfer's `uses_triton_verify`)
                out.append(PassResolution(pass_, g.group, _library_kernel(g.family, pass_),
                                          "library" if c == "auto" else "config", False,
                                          c == "auto", allow_cuda=c == "auto"))
                continue
            name, _ = cuda_kernel(g, pass_, device)
            words = f"cuda {name}" + (" + triton extend tile" if pass_ == "verify" else "")
            if name is None and pass_ == "extend" and g.family == "triton" and c == "auto":
                name, _ = cuda_kernel(g, "verify", device)  # the dense run of ≤ 64-row chunks
                words = f"triton extend tile + cuda {name} for chunks of ≤ 64 rows per KV head"
            if name is None or c == "triton":
                why = ("config" + beside if c == "triton" else "auto: cpu"
                       if device.kind != "cuda" else "auto: no CUDA kernel for this pass")
                out.append(PassResolution(pass_, g.group, tri, why, False, True,
                                          allow_cuda=c != "triton"))
                continue
            blocked = (override.get(pass_) and f"override: {override[pass_]}"
                       or (not nvcc and "fallback: no nvcc on PATH or CUDA_HOME")
                       or (failures.get((pass_, g.group)) and
                           f"fallback: {failures[(pass_, g.group)]}"))
            if blocked:
                out.append(PassResolution(pass_, g.group, tri, blocked, False, True,
                                          name))
            else:
                why = "config" + beside if c == "cuda" else "auto: nvcc present"
                out.append(PassResolution(pass_, g.group, words, why, True, True, name, True))
    return tuple(out)


class KernelPolicy:
    """The resolution an adapter consults per pass: whether our CUDA kernel may serve
    (`cuda`: None = where a call's shapes fit, False = never) and whether our tiles serve rather
    than the library (`ours`). Built once by `kernels.cuda.prepare.prepare_kernels`."""

    def __init__(self, resolved: tuple[PassResolution, ...]) -> None:
        self.resolved = resolved
        self._by = {(r.pass_, r.group): r for r in resolved}

    def _get(self, mode: str | None, sliding: bool) -> PassResolution | None:
        return self._by.get((MODE_PASS.get(mode or "", "extend"), "swa" if sliding else "full"))

    def cuda(self, mode: str | None, sliding: bool) -> bool | None:
        r = self._get(mode, sliding)
        return None if r is None or r.allow_cuda else False

    def ours(self, mode: str | None, sliding: bool) -> bool:
        r = self._get(mode, sliding)
        return r is None or r.ours

    def lines(self) -> list[str]:
        return [str(r) for r in self.resolved]


def worker_lines(workers) -> list[str]:
    """``"<worker> <pass>/<group>: <kernel> (<why>)"`` for each worker (``.name``, ``.backend``)
    whose backend carries a `KernelPolicy` (report.json's ``kernels``)."""
    return [f"{w.name} {line}" for w in workers
            if getattr(getattr(w, "backend", None), "kernels", None) is not None
            for line in w.backend.kernels.lines()]
