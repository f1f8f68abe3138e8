"""The FlashInfer the adapter was tested with, checked when it starts.

Why a pin: the adapter re-plans decode through the wrappers' private fields and
``_cached_module.plan`` called by position (`flashinfer_replan`), and its eager masks are laid out
at the *bit* offsets FlashInfer 0.6.18's plan hands the kernel for a packed mask
(`flashinfer_tables.packed_custom_mask`). Another version can misplan without an error, so:

- `check_version()`: a FlashInfer outside ``PIN`` is refused with the reason (at `Adapter`
  construction, where flashinfer is importable).
- `check_mask_layout(device)`: on CUDA, once per process, a two-request masked prefill through
  the adapter's packed-mask path (`packed_custom_mask`, ``plan(packed_custom_mask=…)``) against
  the fp32 reference (`torch_ref.attention_reference`); a different answer raises.
"""
from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import math
import re
import sys
from types import SimpleNamespace

import torch

from swafactory.errors import ConfigError, Reason, SwaFactoryError

__all__ = ["PIN", "SUPPORTED", "FlashInferLayoutError", "installed_version", "check_version",
           "check_mask_layout", "check_at_start"]

SUPPORTED = ((0, 6, 18), (0, 7, 0))
"""[lowest, first refused) versions the adapter was tested with."""
PIN = "flashinfer-python>=0.6.18,<0.7"
_WHY = ("swafactory's FlashInfer adapter writes the wrappers' private plan fields, calls "
        "_cached_module.plan by position and lays its eager masks out at FlashInfer 0.6.18's "
        "bit offsets; another version can misplan without an error")


class FlashInferLayoutError(SwaFactoryError, RuntimeError):
    """The installed FlashInfer reads the packed custom mask differently from the adapter."""


def installed_version() -> str | None:
    """The importable FlashInfer's version (the module's own ``__version__`` where it is
    imported already, else the distribution's), or None where flashinfer is not importable."""
    if "flashinfer" in sys.modules:
        mod = sys.modules["flashinfer"]
        return None if mod is None else str(getattr(mod, "__version__", "unknown"))
    try:
        return importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        if importlib.util.find_spec("flashinfer") is None:
            return None
    except (ImportError, ValueError):
        return None
    import flashinfer
    return str(getattr(flashinfer, "__version__", "unknown"))


def _parse(version: str) -> tuple[int, int, int] | None:
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    return tuple(int(x) for x in m.groups()) if m else None


def check_version(version: str | None = None) -> str | None:
    """Raises `ConfigError` where the importable FlashInfer (or ``version``) is outside
    ``PIN``; returns the version (None: flashinfer is not importable, nothing to check)."""
    version = installed_version() if version is None else version
    if version is None:
        return None
    _refuse_unless_pinned(version)
    return version


@functools.cache
def _refuse_unless_pinned(version: str) -> None:
    parsed = _parse(version)
    if parsed is not None and SUPPORTED[0] <= parsed < SUPPORTED[1]:
        return
    what = "an unknown version" if parsed is None else "outside the tested range"
    raise ConfigError([Reason("backend", "backend.name",
                              f"flashinfer {version} is installed, {what}: the adapter is tested "
                              f"with {PIN} only ({_WHY})",
                              f"pip install '{PIN}', or backend=triton",
                              rule="flashinfer_version")],
                      headline="swafactory refuses this FlashInfer:")


def _case(device: torch.device, seed: int = 0):
    """Two requests of different query and key counts under a random mask (every row sees at
    least one key): (tables, q, k_buf, v_buf) on ``device``; bf16, 4 q heads, 2 KV heads, 128."""
    g = torch.Generator().manual_seed(seed)
    q_lens, kv_lens, hq, hkv, d = (3, 5), (7, 12), 4, 2, 128
    total_q, total_kv = sum(q_lens), sum(kv_lens)
    masks = []
    for nq, nk in zip(q_lens, kv_lens):
        m = torch.rand(nq, nk, generator=g) < 0.5
        m[torch.arange(nq), torch.randint(0, nk, (nq,), generator=g)] = True
        masks.append(m.reshape(-1))
    qo = torch.tensor([0, q_lens[0], total_q], dtype=torch.int32)
    kv = torch.tensor([0, kv_lens[0], total_kv], dtype=torch.int32)
    rows = 1 + torch.randperm(total_kv, generator=g).to(torch.int32)  # row 0: the dummy
    kv_pos = torch.cat([torch.arange(n) for n in kv_lens]).to(torch.int32)
    q_pos = torch.cat([torch.arange(nk - nq, nk) for nq, nk in zip(q_lens, kv_lens)])
    mask_off = torch.tensor([0, q_lens[0] * kv_lens[0], q_lens[0] * kv_lens[0]
                             + q_lens[1] * kv_lens[1]], dtype=torch.int32)
    dev = lambda t: t.to(device)  # noqa: E731
    tables = SimpleNamespace(qo_host=qo, kv_host=kv, qo_indptr=dev(qo), kv_indptr=dev(kv),
                             kv_indices=dev(rows), q_pos=dev(q_pos.to(torch.int32)),
                             kv_pos=dev(kv_pos), mask=dev(torch.cat(masks)),
                             mask_indptr=dev(mask_off))
    bf = dict(dtype=torch.bfloat16)
    q = torch.randn(total_q, hq, d, generator=g).to(device, **bf)
    k_buf = torch.randn(total_kv + 1, hkv, d, generator=g).to(device, **bf)
    v_buf = torch.randn(total_kv + 1, hkv, d, generator=g).to(device, **bf)
    return tables, q, k_buf, v_buf


def _run_flashinfer(tables, q, k_buf, v_buf, scale: float):
    """The adapter's eager masked-prefill path on ``tables``: (o, lse natural log)."""
    import flashinfer

    from swafactory.kernels.flashinfer_tables import packed_custom_mask

    hq, hkv, d = q.shape[1], k_buf.shape[1], q.shape[2]
    mask, _ = packed_custom_mask(tables, None, "bit_offsets")
    ws = torch.zeros(32 * 1024 * 1024, dtype=torch.uint8, device=q.device)
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    last = torch.ones(tables.qo_host.numel() - 1, dtype=torch.int32)
    w.plan(tables.qo_host, tables.kv_host, tables.kv_indices, last, hq, hkv, d, 1,
           packed_custom_mask=mask, window_left=-1, q_data_type=q.dtype,
           kv_data_type=k_buf.dtype, sm_scale=scale)
    paged = (k_buf.view(k_buf.shape[0], 1, hkv, d), v_buf.view(v_buf.shape[0], 1, hkv, d))
    o, lse2 = w.run(q, paged, return_lse=True)
    return o, lse2 * math.log(2.0)  # FlashInfer's LSE is base 2


def check_mask_layout(device: torch.device, *, atol: float = 3e-2) -> float:
    """Runs the two-request masked prefill through FlashInfer and the fp32 reference; returns
    the largest |o| difference, or raises `FlashInferLayoutError` where they differ."""
    from swafactory.kernels.torch_ref import attention_reference

    tables, q, k_buf, v_buf = _case(device)
    scale = q.shape[-1] ** -0.5
    o, lse = _run_flashinfer(tables, q, k_buf, v_buf, scale)
    t = tables
    o_ref, lse_ref = attention_reference(q.float(), k_buf.float(), v_buf.float(), t.qo_indptr,
                                         t.kv_indptr, t.kv_indices, t.q_pos, t.kv_pos,
                                         mask=t.mask, mask_indptr=t.mask_indptr, scale=scale)
    err_o = (o.float() - o_ref).abs().max().item()  # start-up, off the hot path: reads back
    err_l = (lse.float() - lse_ref).abs().max().item()
    if not (err_o <= atol and err_l <= atol):
        raise FlashInferLayoutError(
            f"flashinfer {installed_version()} reads the adapter's packed custom mask "
            f"differently: a two-request masked prefill differs from the fp32 reference by "
            f"{err_o:.3g} in o and {err_l:.3g} in the LSE (tolerance {atol}). The adapter lays "
            f"masks out at FlashInfer 0.6.18's bit offsets (flashinfer_tables."
            f"packed_custom_mask); install '{PIN}' or use backend=triton")
    return err_o


_done: set[int] = set()


def check_at_start(device: torch.device) -> None:
    """The version, then on CUDA (once per process and GPU, never inside a capture) the mask
    layout. Called by the adapter's `start` when the backend is built."""
    if check_version() is None or device.type != "cuda":
        return
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx in _done or torch.cuda.is_current_stream_capturing():
        return
    with torch.cuda.device(idx):
        check_mask_layout(torch.device("cuda", idx))
    _done.add(idx)
