"""Draft models and what makes them: the drafters the spec step calls (`drafters`, `dflash`), the
draft checkpoint formats (`formats`), the target's hidden features a draft reads (`features`), and
distillation and training of a draft on the target (`distill`, `distill_features`, `train`,
`language`). Nothing is imported here: import the module you need."""

__all__ = ["dflash", "distill", "distill_features", "drafters", "features", "formats", "language",
           "train"]
