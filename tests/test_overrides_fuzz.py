"""Random overrides end in a valid config or a ConfigError, never anything else."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings, strategies as st

import swafactory
from swafactory import ConfigError
from swafactory.config.paths import group_options
from swafactory.registry.device import CPU, H200

GROUP_CHOICES = st.sampled_from([(g, o) for g in ("model", "spec", "backend", "workload")
                                 for o in group_options(g)] + [("backend", "flashinfr"),
                                                              ("spec", "eagle4"), ("model", "")])
FIELDS = ["spec.topk", "spec.num_steps", "spec.num_draft_tokens", "spec.block_size",
          "backend.page_size", "backend.tree_mask", "backend.resolver", "backend.kv_dtype",
          "backend.cuda_graph", "backend.name", "model.sliding_window", "model.num_layers",
          "model.layer_pattern", "model.swa.head_dim", "model.full.num_kv_heads",
          "workload.swa_full_tokens_ratio", "workload.context_len", "workload.device",
          "+backend.bogus", "~model.full", "model.attention_sinks", "run.mode", "parallel.tp"]
VALUES = st.one_of(st.integers(-3, 5000).map(str), st.sampled_from(
    ["0", "1", "16", "0.5", "1e9", "true", "null", "cascade", "custom_mask", "allocator",
     "active_pool", "SF", "SXS", "torch", "cuda", "[1,2]", "'a b'", "${model.num_layers}"]),
    st.text(alphabet="abcxyz_.=,[]{}'\"$ ", max_size=6))
OVERRIDE = st.one_of(GROUP_CHOICES.map(lambda go: f"{go[0]}={go[1]}"),
                     st.tuples(st.sampled_from(FIELDS), VALUES).map(lambda fv: f"{fv[0]}={fv[1]}"))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(OVERRIDE, max_size=4))
def test_random_overrides_succeed_or_raise_config_error(overrides: list[str]) -> None:
    try:
        cfg = swafactory.compose(overrides)
        for device in (CPU, H200):
            reasons = swafactory.check(cfg, device)
            assert all(r.field and r.message for r in reasons)
            if not reasons:
                swafactory.plan_summary(cfg, device)
            else:
                try:
                    swafactory.validate(cfg, device)
                except ConfigError as exc:
                    assert exc.reasons
                else:
                    raise AssertionError("check() found reasons but validate() passed")
    except ConfigError as exc:
        assert str(exc) and exc.reasons

