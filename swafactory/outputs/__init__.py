"""What a job writes, one way for every payload: the console teed into Hydra's job log
(`job_log`), when a plain progress line is due (`progress_lines`), the report files (`report_files`)
and the verdict of a run whose fault never acted (`inert`). Leaves the payloads import; the fault
counters themselves stay at the package root (`swafactory.fault_counts`), since storage and
planning code counts into them. Nothing is imported here: import the module you need."""

__all__ = ["inert", "job_log", "progress_lines", "report_files"]
