"""The command line: what `python -m swafactory` does with a composed config, plan, run the
conformance job or generate, and the result each job leaves in its output directory (`jobs`).
The Hydra app itself, the only place that maps exceptions to exit codes, is `swafactory.__main__`;
what a job writes (job log, progress lines, report files) is `swafactory.outputs`. Nothing is
imported here: import the module you need."""

__all__ = ["jobs"]
