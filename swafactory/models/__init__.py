"""HF model building for the generate run: a target's and a draft's model definitions from
`conf/model/<key>.yaml` and the attention geometry read back from the model code (`hf`), the
generator's parts built from a config, target and draft runners on the serving core (`build`), and
the adapter that lets transformers' model code call swafactory's attention (`transformers`, the
`models` extra). transformers is imported when a run starts, never at import time."""

__all__ = ["build", "hf", "transformers"]
