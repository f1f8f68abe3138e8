"""Launch a tensor-parallel conformance job: one process per rank (torch.multiprocessing), each
running `swafactory.harness.run.run_rank` on its shard (`swafactory.parallel`), rank 0's report
returned. gloo on CPU, NCCL on GPUs."""
from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

import torch

from swafactory.config.schema import SwaFactoryConfig
from swafactory.parallel import Shard

__all__ = ["launch"]


def _rank_main(rank: int, tp: int, init: str, cfg_json: str, device_kind: str, out: str,
               run_rank: Callable, environ: dict[str, str]) -> None:
    import torch.distributed as dist

    # the fork server's environment is the one it started with; a rank runs in its caller's
    os.environ.clear()
    os.environ.update(environ)
    if device_kind == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
    dist.init_process_group("nccl" if device_kind == "cuda" else "gloo",
                            init_method=init, rank=rank, world_size=tp)
    try:
        report = run_rank(SwaFactoryConfig.model_validate_json(cfg_json), Shard(rank, tp))
        if rank == 0:
            with open(out, "w") as f:
                f.write(report.model_dump_json())
    finally:
        dist.destroy_process_group()


def launch(cfg: SwaFactoryConfig, device_kind: str, run_rank: Callable):
    """Run the conformance job on ``cfg.parallel.tp`` ranks; returns rank 0's Report.
    run_rank: ``(cfg, Shard) -> Report``, one rank's run (a module-level function: each spawned
    rank unpickles it by name; passed in so that this module imports no driver)."""
    import torch.multiprocessing as mp

    from swafactory.harness.report_model import Report

    tp = cfg.parallel.tp
    if device_kind == "cuda" and torch.cuda.device_count() < tp:
        raise RuntimeError(f"parallel.tp={tp} needs {tp} GPUs; {torch.cuda.device_count()} visible")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.json")
        # the ranks meet in a file of the job's own folder: a free TCP port picked here can be
        # taken by another job before rank 0 binds it (two sweeps' ranks on one host did)
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        # ranks fork from a server that imported the driver once (a spawned rank spent about
        # 3 s of CPU importing torch and swafactory: 40 of test_parallel's 50 s). The server
        # never touches CUDA, so each rank may; it kept the environment it started with, so the
        # caller's is passed along (the one import-time read, TRITON_INTERPRET, is set earlier)
        mp.set_forkserver_preload([run_rank.__module__])
        mp.start_processes(_rank_main, args=(tp, init, cfg.model_dump_json(), device_kind, out,
                                             run_rank, dict(os.environ)),
                           nprocs=tp, join=True, start_method="forkserver")
        with open(out) as f:
            return Report.model_validate_json(f.read())
