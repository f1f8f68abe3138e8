"""`backend=auto` by measured speed: which kernel family serves each layer group, and which of
its kernels each pass, chosen by timing the candidates on this device at the run's geometry.

This module is the pure part: the candidates (each passes the registry), the cache key, the
on-disk cache and the choice from timings. The timer itself is the caller's
(`swafactory.backend.timing` times real passes on a GPU; tests pass a function), so the registry
stays below the kernels.

* **Candidates** (`candidates`): per layer group, each family of `AUTO_PREFERENCE` that the
  registry accepts for that group (``backend.groups.<g>=<family>``), but the torch reference and
  flex; per pass within it, the `backend.kernels` choices it accepts (`auto`, `cuda`, `triton`,
  `library`), one per distinct kernel they resolve to.
* **Choice** (`choose`): a pass of a group costs its layers' time (layers × one layer's) plus
  the step's planning under that candidate (the host planning an adapter does per forward:
  FlashInfer's ``plan``, a graph's replay planning). Per group, the family whose passes' lowest
  costs, each weighed by how many forwards of that pass the workload runs (`pass_weights`), sum
  lowest, and per pass the cheapest choice in it; a pass no candidate could time keeps `auto`.
  Under a library family, `triton` and `cuda` hand a pass to our kernels
  (`BackendSpec.family_for`), so a group can decode on ours and prefill on the library's.
* **Cache** (`TuneCache`): one JSON file, keyed by the device, the geometry per group, the KV
  dtype, page size, verify tokens, batch, context, chunk and output length, whether passes replay
  from CUDA graphs, the kernel libraries' versions and the project's (`tune_key`). An entry of another schema, or whose recorded key fields differ from
  the run's, is stale: it is measured again and replaced.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from swafactory.config.schema import SwaFactoryConfig
from swafactory.registry.check import check
from swafactory.registry.device import DeviceInfo
from swafactory.registry.kernel_choice import PASSES, resolve_passes
from swafactory.registry.select import resolve_auto
from swafactory.registry.suggest import AUTO_PREFERENCE

__all__ = ["SCHEMA", "Choice", "Tuning", "tune_key", "library_versions", "TuneCache",
           "candidates", "pass_weights", "choose", "apply", "tune"]

SCHEMA = 5
"""Bumped when what an entry holds, or how it is measured, changes: older entries are stale."""
CHOICES = ("auto", "cuda", "triton", "library")

Timer = Callable[[SwaFactoryConfig, str, str], "float | tuple[float, float] | None"]
"""(candidate config, group, pass) → median ms of that pass of one layer of the group, or (that,
the median ms of the step's planning under the candidate), or None when it cannot run (it is
then not a candidate)."""


def library_versions() -> dict[str, str | None]:
    """Versions of what the timings depend on (None: not installed)."""
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name in ("torch", "triton", "flashinfer-python", "flash-attn-4", "swafactory"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _passes(cfg: SwaFactoryConfig) -> tuple[str, ...]:
    return tuple(p for p in PASSES if p != "verify" or cfg.spec.num_draft_tokens)


def tune_key(cfg: SwaFactoryConfig, device: DeviceInfo,
             versions: Mapping[str, str | None] | None = None) -> dict:
    """The facts a tuning depends on, as a JSON-ready dict (its hash is the cache key)."""
    m, b, w = cfg.model, cfg.backend, cfg.workload
    groups = {}
    for g, geo, layers in (("swa", m.swa, m.swa_layers), ("full", m.full, m.full_layers)):
        if geo is not None and layers:
            groups[g] = {"head_dim": geo.head_dim, "kv_heads": geo.num_kv_heads // cfg.parallel.tp,
                         "q_heads": m.num_attention_heads // cfg.parallel.tp,
                         "window": m.sliding_window if g == "swa" else None}
    return {"schema": SCHEMA, "device": device.name or device.kind, "sm": device.sm,
            "groups": groups, "kv_dtype": b.kv_dtype, "page_size": b.page_size,
            "softcap": m.logit_softcap, "sinks": m.attention_sinks, "graphs": b.cuda_graph,
            "verify_tokens": cfg.spec.num_draft_tokens, "tree": cfg.spec.is_tree,
            "batch": w.max_running_requests, "context": w.context_len,
            "chunk": w.chunk_size, "output": list(w.output_len), "passes": list(_passes(cfg)),
            "versions": dict(library_versions() if versions is None else versions)}


def _digest(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]


@dataclass(frozen=True)
class Choice:
    """What serves one pass of one group, and its measured time."""

    group: str
    pass_: str
    family: str
    kernel: str
    """The `backend.kernels` choice: auto, cuda, triton or library."""
    ms: float | None
    tried: dict[str, float] = field(default_factory=dict)
    """``"<family>/<kernel>"`` → ms of every candidate timed for this pass."""
    spent: dict[str, float] = field(default_factory=dict)
    """``"<family>/<kernel>"`` → wall seconds its timing cost (building its backend, compiling
    its kernels on first use, capturing, timing): where a slow first tuning went."""
    plans: dict[str, float] = field(default_factory=dict)
    """``"<family>/<kernel>"`` → ms of the step's planning under it (where the timer gave it)."""
    cost: dict[str, float] = field(default_factory=dict)
    """``"<family>/<kernel>"`` → ms a step of this pass costs the group under it: its layers'
    time plus the planning."""

    def __str__(self) -> str:
        ms = "-" if self.ms is None else f"{self.ms:.3f} ms"
        me = f"{self.family}/{self.kernel}"
        if me in self.plans:
            ms += f", plan {self.plans[me]:.3f} ms"
        others = ", ".join(f"{k} {v:.3f}" for k, v in sorted(self.tried.items(),
                                                             key=lambda kv: kv[1]))
        why = ""
        cost = self.cost or self.tried
        cheapest = min(cost, key=cost.__getitem__, default=None)
        if self.ms is not None and cheapest and not cheapest.startswith(self.family + "/") \
                and me in cost and cost[cheapest] < cost[me]:  # it lost on the group's sum
            why = f"; {cheapest.split('/')[0]} lost on the group's weighted sum of passes"
        elif cost is self.cost and me in cost and min(self.tried.values()) < self.ms:
            why = "; planning included"  # a faster layer lost on the step's planning
        return (f"{self.pass_}/{self.group}: {self.family} {self.kernel} ({ms}; tried "
                f"{others}{why})")


@dataclass(frozen=True)
class Tuning:
    """A tuning's result: the choices, whether they came from the cache, and its cost."""

    choices: tuple[Choice, ...]
    cached: bool
    tune_s: float
    key: str

    def lines(self) -> list[str]:
        return [str(c) for c in self.choices]

    def costliest(self, n: int = 3) -> list[str]:
        """The ``n`` candidates whose timing cost the most wall time, ``"pass/group fam/k
        12.3 s"``, costliest first (the same candidate is timed once per pass)."""
        every = {f"{c.pass_}/{c.group} {k}": s for c in self.choices
                 for k, s in c.spent.items()}
        top = sorted(every.items(), key=lambda kv: -kv[1])[:n]
        return [f"{k} {s:.1f} s" for k, s in top]


class TuneCache:
    """One JSON file of tunings: key → {"fields", "choices", "tune_s", "measured_at"}."""

    def __init__(self, path: Path | str | None = None) -> None:
        default = Path(os.environ.get("SWAFACTORY_CACHE_DIR",
                                      Path.home() / ".cache" / "swafactory")) / "autotune.json"
        self.path = Path(path) if path is not None else default

    def _read(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}  # no cache yet, or a damaged one: measure again

    def get(self, fields: dict) -> Tuning | None:
        """The cached tuning of these key fields, or None (missing or stale)."""
        key = _digest(fields)
        e = self._read().get(key)
        if not e or e.get("fields") != fields or e.get("fields", {}).get("schema") != SCHEMA:
            return None
        return Tuning(tuple(Choice(**c) for c in e["choices"]), True, e["tune_s"], key)

    def put(self, fields: dict, tuning: Tuning) -> None:
        data = self._read()
        data[tuning.key] = {"fields": fields, "choices": [asdict(c) for c in tuning.choices],
                            "tune_s": tuning.tune_s, "measured_at": time.time()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(self.path)  # atomic: a concurrent reader sees the old file or the new one


def _with(cfg: SwaFactoryConfig, group: str, family: str,
          kernels: Mapping[str, str] | None = None) -> SwaFactoryConfig:
    """``cfg`` with group ``group`` on ``family`` and its passes' `backend.kernels` choices."""
    b = cfg.backend
    groups = b.groups.model_copy(update={group: family})
    kc = getattr(b.kernels, group).model_copy(update=dict(kernels or {}))
    kernels_all = b.kernels.model_copy(update={group: kc})
    name = b.name if b.name != "auto" else family
    return cfg.model_copy(update={"backend": b.model_copy(update={
        "name": name, "groups": groups, "kernels": kernels_all})})


UNTIMED = ("torch", "flex")
"""Families auto never times: the reference, and a kernel compiled per shape (its first use
would cost the tuning's whole budget)."""


def _resolved(cfg: SwaFactoryConfig, device: DeviceInfo, group: str, pass_: str) -> str:
    """What serves ``pass_`` of ``group`` under ``cfg`` (`kernel_choice.resolve_passes`)."""
    for r in resolve_passes(cfg, device, nvcc=True):
        if r.group == group and r.pass_ == pass_:
            return r.kernel
    return "-"


def candidates(cfg: SwaFactoryConfig, device: DeviceInfo) -> dict[str, dict[str, dict[str, list]]]:
    """group → family → pass → the `backend.kernels` choices the registry accepts there, one
    per distinct kernel (`auto` first: where it resolves as an explicit choice does, it stays,
    since it still follows each call's shapes)."""
    out: dict[str, dict[str, dict[str, list]]] = {}
    m = cfg.model
    groups = [g for g, layers in (("swa", m.swa_layers), ("full", m.full_layers)) if layers]
    for g in groups:
        for fam in AUTO_PREFERENCE.get(device.kind, ()):
            if fam in UNTIMED or check(_with(cfg, g, fam), device):
                continue
            passes = {}
            for p in _passes(cfg):
                seen, keep = set(), []
                for c in CHOICES:
                    cand = _with(cfg, g, fam, {p: c})
                    if c != "auto" and check(cand, device):
                        continue
                    kernel = _resolved(cand, device, g, p)
                    if kernel not in seen:
                        seen.add(kernel)
                        keep.append(c)
                passes[p] = keep
            out.setdefault(g, {})[fam] = passes
    return out


def pass_weights(cfg: SwaFactoryConfig) -> dict[str, float]:
    """Forwards of each pass one batch of the workload runs, as the timer times them
    (`swafactory.backend.timing`): extend, ``context_len`` tokens a request in chunks of ``chunk_size``
    (at most 2048), up to 4 requests a forward; decode and verify, a step per output token (the
    mean of ``output_len``; a verify step yields at least one). A family fast at prefill but slow
    at decode wins a long-prompt, short-answer workload and loses a long-answer one."""
    w = cfg.workload
    bs = w.max_running_requests
    chunks = -(-w.context_len // min(2048, w.chunk_size)) * -(-bs // min(4, bs))
    steps = sum(w.output_len) / 2
    return {"extend": float(chunks), "decode": steps, "verify": steps}


def choose(cands: Mapping[str, Mapping[str, Mapping[str, list]]], cfg: SwaFactoryConfig,
           timer: Timer) -> tuple[Choice, ...]:
    """Time every candidate with ``timer`` and pick, per group, the family with the lowest sum
    of its passes' cheapest steps (the group's layers plus the planning) weighed by
    `pass_weights`, and per pass its cheapest choice. Each `Choice` lists every candidate timed
    for its pass (all families), so the report shows what lost."""
    picked: list[Choice] = []
    weight = pass_weights(cfg)
    m = cfg.model
    for g, fams in cands.items():
        n = len(m.swa_layers if g == "swa" else m.full_layers)
        times: dict[str, dict[str, dict[str, float]]] = {}  # family → pass → "fam/k" → ms
        steps: dict[str, dict[str, dict[str, float]]] = {}  # the same → a step's ms
        plans: dict[str, dict[str, float]] = {}  # pass → "fam/k" → planning ms
        spent: dict[str, dict[str, float]] = {}  # pass → "fam/k" → wall s
        for fam, passes in fams.items():
            for p, kernels in passes.items():
                tried = times.setdefault(fam, {}).setdefault(p, {})
                step = steps.setdefault(fam, {}).setdefault(p, {})
                for k in kernels:
                    t0 = time.perf_counter()
                    got = timer(_with(cfg, g, fam, {p: k}), g, p)
                    spent.setdefault(p, {})[f"{fam}/{k}"] = time.perf_counter() - t0
                    if got is None:
                        continue
                    ms, plan = got if isinstance(got, tuple) else (got, None)
                    tried[f"{fam}/{k}"] = ms
                    step[f"{fam}/{k}"] = n * ms + (plan or 0.0)
                    if plan is not None:
                        plans.setdefault(p, {})[f"{fam}/{k}"] = plan

        def total(fam: str) -> float:
            per = steps[fam]
            return sum(weight.get(p, 1.0) * min(t.values()) if t else float("inf")
                       for p, t in per.items())

        def handed(fam: str) -> int:  # passes it would hand to our kernels: on a tie, fewer
            return sum(1 for p, t in steps[fam].items() if t and _with(
                cfg, g, fam, {p: min(t, key=t.__getitem__).split("/", 1)[1]}
            ).backend.family_for(g == "swa", p) != fam)

        if not times:
            continue
        fam = min(times, key=lambda f: (total(f), handed(f)))
        for p, tried in times[fam].items():
            every = {k: v for f in times.values() for k, v in f.get(p, {}).items()}
            costs = {k: v for f in steps.values() for k, v in f.get(p, {}).items()}
            wall = spent.get(p, {})
            if not tried:
                picked.append(Choice(g, p, fam, "auto", None, every, wall, plans.get(p, {}),
                                     costs))
                continue
            k = min(steps[fam][p], key=steps[fam][p].__getitem__)
            picked.append(Choice(g, p, fam, k.split("/", 1)[1], tried[k], every, wall,
                                 plans.get(p, {}), costs))
    return tuple(picked)


def apply(cfg: SwaFactoryConfig, choices: tuple[Choice, ...]) -> SwaFactoryConfig:
    """``cfg`` (`backend=auto`) with the tuned families and pass choices."""
    out = cfg
    for c in choices:
        out = _with(out, c.group, c.family, {c.pass_: c.kernel})
    # the backend's name is the full group's family (its adapter plans the rest)
    fams = {c.group: c.family for c in choices}
    name = fams.get("full") or fams.get("swa") or cfg.backend.name
    return out.model_copy(update={"backend": out.backend.model_copy(update={"name": name})})


def tune(cfg: SwaFactoryConfig, device: DeviceInfo, timer: Timer,
         cache: TuneCache | None = None,
         versions: Mapping[str, str | None] | None = None) -> tuple[SwaFactoryConfig, Tuning]:
    """Resolve `backend=auto` by measurement on ``device``: the cached tuning of this run's key,
    else every candidate timed with ``timer`` (then cached). Returns the tuned config (checked
    by the registry) and the `Tuning`."""
    cache = cache or TuneCache()
    fields = tune_key(cfg, device, versions)
    got = cache.get(fields)
    if got is None:
        t0 = time.perf_counter()
        choices = choose(candidates(cfg, device), cfg, timer)
        got = Tuning(choices, False, time.perf_counter() - t0, _digest(fields))
        if choices:
            cache.put(fields, got)
    tuned = apply(cfg, got.choices) if got.choices else None
    if tuned is None or check(tuned, device):  # nothing timed, or a mix the registry refuses
        return resolve_auto(cfg, device), Tuning((), got.cached, got.tune_s, got.key)
    return tuned, got
