"""Build the CUDA kernels a configuration's passes will use, when the backend is built.

`prepare_kernels(cfg, device)` resolves `backend.kernels` (`registry.kernel_choice`), compiles or
loads from the cache exactly the kernels that resolution picked, with nvcc bounded by
`backend.kernels.build_timeout_s`, and returns the `KernelPolicy` the adapters consult per pass.
A kernel that does not build (no nvcc, an unwritable cache, a timeout, nvcc or the driver
refusing, an OSError) leaves its passes to the Triton kernel with one warning naming the cause,
unless the config asked for `cuda` there: then it raises here, before any forward.
"""
from __future__ import annotations

import torch

from swafactory.config.schema import SwaFactoryConfig
from swafactory.errors import ConfigError, Reason
from swafactory.kernels.cuda import launch
from swafactory.registry.device import DeviceInfo, detect_device
from swafactory.registry.kernel_choice import KernelPolicy, group_facts, resolve_passes

__all__ = ["prepare_kernels", "start_adapters", "kernels_for"]


def kernels_for(cfg: SwaFactoryConfig, pass_: str, group: str, name: str,
                device: torch.device) -> list[launch.CudaKernel]:
    """The `CudaKernel`s a resolved pass needs (every cluster size a decode may launch)."""
    g = next(f for f in group_facts(cfg) if f.group == group)
    if name == "verify_d512":
        from swafactory.kernels.cuda.verify import tile_config, verify_d512_kernel
        return [verify_d512_kernel(*tile_config(device))]
    if name == "decode_d64":
        from swafactory.kernels.cuda.decode import decode_d64_kernel, tile
        bn, stages, _ = tile(0, 1)
        return [decode_d64_kernel(g.gqa, c, bn, stages) for c in (1, 2, 4, 8)]
    if name == "decode_fp8":
        from swafactory.kernels.cuda.decode_fp8 import decode_fp8_kernel, fp8_tile
        bn, stages, _ = fp8_tile(g.head_dim)
        return [decode_fp8_kernel(g.head_dim, g.gqa, c, bn, stages) for c in (1, 2, 4, 8)]
    raise ValueError(f"no CUDA kernel named {name!r}")


def _overrides() -> dict[str, str | None]:
    return {"decode": launch.env_override(decode=True), "verify": launch.env_override(),
            "extend": launch.env_override()}


def prepare_kernels(cfg: SwaFactoryConfig, device: torch.device,
                    info: DeviceInfo | None = None) -> KernelPolicy:
    """Resolve `backend.kernels` on ``device`` and build what it picked. Raises `ConfigError`
    where the config asked for `cuda` and the kernel did not build; never raises otherwise."""
    launch.set_build_timeout(cfg.backend.kernels.build_timeout_s)
    if info is None:
        info = detect_device("cuda" if device.type == "cuda" else "cpu")
    nvcc = launch.nvcc_path() is not None
    first = resolve_passes(cfg, info, nvcc=nvcc, override=_overrides())
    failures: dict[tuple[str, str], str] = {}
    built: dict[tuple, str | None] = {}
    refused = []
    for r in first:
        chose = getattr(getattr(cfg.backend.kernels, r.group), r.pass_)
        if chose == "cuda" and not r.cuda:  # no nvcc, or a benchmark override switched it off
            refused.append(Reason("backend", f"backend.kernels.{r.group}.{r.pass_}",
                                  f"cuda: {r.why}", f"backend.kernels.{r.group}.{r.pass_}=auto",
                                  rule="kernel_build"))
        if not r.cuda or device.type != "cuda":
            continue
        try:
            kerns = kernels_for(cfg, r.pass_, r.group, r.cuda_name, device)
            key = tuple(launch.kernel_key(k) for k in kerns)
            if key not in built:  # verify and extend may share one kernel: built once
                built[key] = launch.load_kernels(kerns, device.index)
            cause = built[key]
        except (RuntimeError, OSError, ValueError) as exc:  # e.g. a malformed tile override
            cause = str(exc) or type(exc).__name__
        if cause is None:
            continue
        failures[(r.pass_, r.group)] = cause
        if chose == "cuda":
            refused.append(Reason("backend", f"backend.kernels.{r.group}.{r.pass_}",
                                  f"cuda: {r.cuda_name} did not build ({cause})",
                                  f"backend.kernels.{r.group}.{r.pass_}=auto",
                                  rule="kernel_build"))
    if refused:
        raise ConfigError(refused, combination=cfg.combination)
    warn = dict(failures)
    if not nvcc and device.type == "cuda":  # resolved to the fallback already: warn all the same
        warn.update({(r.pass_, r.group): "no nvcc on PATH or CUDA_HOME" for r in first
                     if r.cuda_name and r.why.startswith("fallback: no nvcc")})
    for cause in dict.fromkeys(warn.values()):  # one warning per cause and process
        which = ", ".join(f"{p}/{g}" for (p, g), c in warn.items() if c == cause)
        launch.warn_once(cause, f"swafactory: our CUDA kernels did not build, so the Triton "
                                f"kernels serve {which} ({cause})")
    if not failures:
        return KernelPolicy(first)
    return KernelPolicy(resolve_passes(cfg, info, nvcc=nvcc, override=_overrides(),
                                       failures=failures))


def start_adapters(cfg: SwaFactoryConfig, adapters: dict, device: torch.device,
                   info: DeviceInfo | None = None) -> KernelPolicy:
    """When a backend is built: `prepare_kernels`, the policy handed to every adapter
    (``adapter.kernels``), then each adapter's own start-up check (``adapter.start(device)``:
    FlashInfer's version and mask layout)."""
    policy = prepare_kernels(cfg, device, info)
    for ad in adapters.values():
        if hasattr(ad, "kernels"):
            ad.kernels = policy
        if hasattr(ad, "start"):
            ad.start(device)
    return policy
