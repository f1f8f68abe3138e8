"""``run.oracle=true``: `run=generate` checks its attention rows against the fp32 oracle.

`attach_oracle(parts, gen)` puts a `harness.watch.AttentionWatch` on the target's and the draft's
backends, right after the generator is built: every forward's written K/V (``[total_q, Hkv, D]``)
goes into each request's logical history, and the output rows (``[total_q, Hq, D]``) of sampled
passes (``run.oracle_rate``; the first of each runner × mode × eager/replay always) are compared
with the oracle over it: target extend, decode and verify, draft decode and draft extend, graph
replays included. The histories follow the generator's commits (``on_commit``) and finished
requests (``slots.finish``). A row beyond the harness's tolerance raises
`harness.watch.OracleMismatch`, which ends the run failed, naming runner, mode, layer, request
and error.

What each layer must compute is stated from the config, never read back from the backend:

* the target: the model's layer types, window, scale and soft-cap (`world.target_layer_specs`);
* a self-speculating copy (``models.build.copies``): the target's layers, its own pool;
* a FROZEN_KV draft: layer j is the target layer it is bound to
  (`layout.frozen_draft_binding`), read from the target's histories;
* any other own-pool draft (DFlash, EAGLE/MTP heads, distilled or saved drafts): the windows
  of its pool's layer types (`runner_windows`), the geometry of the pool the config builds, and
  the attention its backend was configured with (an EAGLE or DFlash head is a Llama/Qwen3 layer:
  head_dim^-0.5, no soft-cap). Sinks are the ones the model passes with each call.

Every draft layer's window is then narrowed by ``spec.draft_window`` (`window.narrowed`).
"""
from __future__ import annotations

from dataclasses import replace

from swafactory.config.schema import SwaFactoryConfig
from swafactory.models.build import Parts, copies
from swafactory.harness.run import tolerance_for
from swafactory.harness.watch import AttentionWatch
from swafactory.harness.workers import LayerSpec
from swafactory.harness.world import target_layer_specs
from swafactory.resolve.layout import frozen_draft_binding
from swafactory.resolve.runner_windows import runner_windows
from swafactory.window import narrowed

__all__ = ["attach_oracle", "draft_layer_specs"]


def draft_layer_specs(parts: Parts) -> dict[int, LayerSpec]:
    """The oracle's spec of each draft layer (backend layer id → `LayerSpec`); the draft's
    ``history_layer`` keys its own histories, or the target's for a FROZEN_KV reader."""
    cfg: SwaFactoryConfig = parts.cfg
    s, m = cfg.spec, cfg.model
    target = target_layer_specs(cfg)

    def windowed(spec: LayerSpec) -> LayerSpec:  # spec.draft_window narrows every draft layer
        w = narrowed(spec.window, s.draft_window)
        return replace(spec, window=w, sink=s.draft_sink if w is not None else 0)
    if s.draft_kv == "target_pool":
        return {j: windowed(target[t]) for j, t in enumerate(frozen_draft_binding(cfg))}
    if copies(s):
        return {i: windowed(spec) for i, spec in target.items()}
    own = parts.draft.backend.cfg.model  # the attention the draft's layers do (build_serving's)
    held = runner_windows(cfg, parts.draft.backend.view, draft_window=False)
    out = {}
    for j, w in held.items():  # windowed: an SWA layer of a split own pool (swa geometry)
        geo = m.swa if w is not None else (m.full or m.swa)
        dw = narrowed(w, s.draft_window)
        out[j] = LayerSpec(dw, m.num_attention_heads, geo.num_kv_heads,
                           geo.head_dim, own.softmax_scale or geo.head_dim ** -0.5,
                           own.logit_softcap, j, s.draft_sink if dw is not None else 0)
    return out


def attach_oracle(parts: Parts, gen) -> AttentionWatch | None:
    """Watch ``parts``' runners under ``gen`` (a `Generator`) when ``run.oracle`` is on; returns
    the watch (also kept as ``gen.oracle``), or None when the flag is off."""
    cfg = parts.cfg
    if not cfg.run.oracle:
        return None
    watch = AttentionWatch(tolerance_for(cfg), rate=cfg.run.oracle_rate, seed=cfg.workload.seed)
    hist_t: dict = {}
    t = parts.target
    watch.watch(t.name, t.backend, target_layer_specs(cfg), hist_t, writes=t.writes,
                role="target")
    d = parts.draft
    if d is not None:
        watch.watch(d.name, d.backend, draft_layer_specs(parts), {} if d.writes else hist_t,
                    writes=d.writes, role="draft" if d.writes else "reader")
    commit, finish = gen.on_commit, parts.slots.finish

    def on_commit(rid, committed: int, path: list[int]) -> None:
        out = commit(rid, committed, path)
        watch.commit(rid, committed, path)
        return out

    def finished(rid) -> None:
        watch.finish(rid)
        finish(rid)

    gen.on_commit, parts.slots.finish = on_commit, finished
    gen.oracle = watch
    return watch
