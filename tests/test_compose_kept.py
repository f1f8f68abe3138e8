"""tests/conftest.py keeps each Hydra composition (about 60 ms each, a third of the suite's
thousand are repeats); what it hands out must be what Hydra composes."""
from __future__ import annotations

import swafactory


def test_the_suites_kept_compositions_equal_fresh_ones() -> None:
    """tests/conftest.py keeps each composition: a kept one equals a fresh one, and a change
    to what a test got is not seen by the next."""
    import hydra

    assert hasattr(hydra.compose, "original"), "the conftest cache is not installed"
    overrides = ["model=gemma4", "spec=eagle3", "backend=flashinfer", "spec.num_steps=4"]
    first = swafactory.compose(overrides)
    assert swafactory.compose(overrides) == first  # the kept one
    real, hydra.compose = hydra.compose, hydra.compose.original
    try:
        assert swafactory.compose(overrides) == first
    finally:
        hydra.compose = real
    from hydra import compose as hc, initialize_config_dir

    from swafactory.config.paths import conf_dir
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        got = hc(config_name="config", overrides=overrides)
        got.spec.num_steps = 7
        assert hc(config_name="config", overrides=overrides).spec.num_steps == 4
