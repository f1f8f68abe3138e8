"""Every backend with an adapter, on a GPU, in bf16, against the fp32 oracle.

Same worlds as `test_backends_vs_oracle.py` (random page order, lengths straddling the window
edges, evicted and NaN-poisoned SWA slots), built through the registry. Where the registry
refuses Gemma 4's 512-wide full layers (flex, flash_attn), the full layers are narrowed to 256 so
the two geometries are still exercised. Run on the GPU host:
``TRITON_INTERPRET=0 python3 -m pytest -q -m gpu tests/backends/test_gpu_vs_oracle.py``.
"""
from __future__ import annotations

import pytest
import torch

import swafactory
from swafactory.kernels import flash_attn
from swafactory.registry.device import detect_device
from swafactory.registry.table import get_capabilities, has_adapter, list_backends
from test_backends_vs_oracle import MODES, assert_close, run_mode
from test_flashinfer_host import adapter_world

pytestmark = pytest.mark.gpu

BF16 = 2e-2  # max abs error / max |ref| for bf16 K/V and q (observed ~3e-3)
D64 = ["model.swa.head_dim=64", "model.full.head_dim=64"]  # tiny's 16/32 are not compiled
GPU_BACKENDS = [b for b in list_backends() if has_adapter(b) and "cuda" in get_capabilities(b).devices]


def world(backend, model, extra=(), kv_dtype="bfloat16", page=1, **kw):
    """A bf16 (or ``kv_dtype``) world on the GPU built through the registry, pages of ``page``
    slots; skips with its reasons if refused."""
    overrides = [f"model={model}", f"backend={backend}", f"backend.kv_dtype={kv_dtype}",
                 "spec=none", "backend.cuda_graph=false", f"backend.page_size={page}", *extra]
    reasons = swafactory.check(swafactory.compose(overrides), detect_device("cuda"))
    if reasons:
        pytest.skip("; ".join(r.message for r in reasons))
    return adapter_world(model, page, extra, device="cuda", kv_dtype=kv_dtype,
                         via_registry=True, backend=backend, **kw)


def gemma4_extra(backend: str) -> list[str]:
    caps = get_capabilities(backend)
    narrow = caps.max_head_dim is not None and caps.max_head_dim < 512
    return ["model.sliding_window=8"] + (["model.full.head_dim=256"] if narrow else [])


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_gemma4_geometry_every_mode(backend: str, mode: str) -> None:
    w, cfg = world(backend, "gemma4", gemma4_extra(backend))
    assert cfg.model.swa != cfg.model.full
    assert_close(run_mode(w, mode, [0, 5], 8), BF16)


@pytest.mark.parametrize("backend", ["flashinfer", "triton"])
def test_gemma4_full_layer_verify_reaches_our_cuda_tile(backend: str) -> None:
    """The factory's route, not only the kernel: at `d79e545` both adapters handed the tile int64
    rows and quietly kept the Triton tile (bench_factory's verify did not move)."""
    from swafactory.kernels.cuda.launch import cuda_kernels_available
    from swafactory.kernels.cuda.verify import tile_config, verify_d512_kernel

    if backend not in GPU_BACKENDS or not cuda_kernels_available(torch.device("cuda")):
        pytest.skip(f"{backend} or the CUDA tile (nvcc) is not available here")
    kern = verify_d512_kernel(*tile_config(torch.device("cuda")))
    before = kern.launches
    w, _ = world(backend, "gemma4", ["model.sliding_window=8"])
    assert_close(run_mode(w, "verify_tree_2", [0, 5], 8), BF16)  # 6 nodes x 8 heads: 48 rows
    assert kern.launches > before


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("mode", ["verify_tree_4", "draft_decode"])
def test_trees_through_cascade(backend: str, mode: str) -> None:
    w, _ = world(backend, "tiny", [*D64, "model.sliding_window=6"], tree_mask="cascade")
    assert_close(run_mode(w, mode, [0, 2], 6), BF16)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("model,mode", [("gpt_oss_20b", "decode"), ("gpt_oss_20b", "verify_tree_2"),
                                        ("mistral_7b", "verify_chain"), ("gemma3_4b", "verify_tree_2")])
def test_shipped_models(backend: str, model: str, mode: str) -> None:
    w, _ = world(backend, model, ["model.sliding_window=7", "model.num_layers=4",
                                  "model.softmax_scale=0.1"])
    assert_close(run_mode(w, mode, [0, 1] if model != "mistral_7b" else [0], 7), BF16)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_softcap(backend: str) -> None:
    w, _ = world(backend, "tiny", [*D64, "model.logit_softcap=2.0", "model.sliding_window=5"])
    assert_close(run_mode(w, "decode", [0, 2], 5), BF16)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("model,mode", [("gpt_oss_20b", "decode"), ("gpt_oss_20b", "verify_tree_2"),
                                        ("gpt_oss_20b", "dflash_block"), ("gemma4", "decode"),
                                        ("gemma4", "verify_chain")])
def test_fp8_kv_against_the_dequantized_oracle(backend: str, model: str, mode: str) -> None:
    """fp8 e4m3 pools with per-layer scales (the harness's); the oracle reads the dequantized
    history. Backends without fp8, and FlashInfer at Gemma 4's D = 512 on SM90, skip with the
    registry's reason."""
    extra = ["model.sliding_window=7", "model.num_layers=6", "model.softmax_scale=0.1"]
    w, _ = world(backend, model, extra, kv_dtype="fp8_e4m3")
    assert_close(run_mode(w, mode, [0, 1, 5], 7), BF16)


@pytest.mark.parametrize("swa,full,kv_dtype", [("flash_attn", "flashinfer", "bfloat16"),
                                               ("flash_attn", "triton", "bfloat16"),
                                               ("flashinfer", "triton", "fp8_e4m3")])
@pytest.mark.parametrize("mode", MODES)
def test_gemma4_a_kernel_per_group(swa: str, full: str, kv_dtype: str, mode: str) -> None:
    """Gemma 4 at its real head dims, each group on its own kernel (`backend.groups.full`):
    flash-attn-4 reads the D = 256 SWA layers, FlashInfer or our Triton the D = 512 full ones;
    fp8 KV on FlashInfer's SWA layers and Triton's full ones (FlashInfer has no D = 512 fp8 on
    SM90)."""
    extra = ["model.sliding_window=8", "model.num_layers=12", f"backend.groups.full={full}"]
    w, cfg = world(swa, "gemma4", extra, kv_dtype=kv_dtype)
    assert (cfg.model.swa.head_dim, cfg.model.full.head_dim) == (256, 512)
    assert set(w.backend.adapters) == {swa, full}
    assert_close(run_mode(w, mode, [0, 5], 8), BF16)


@pytest.mark.parametrize("page", [16, 128])
@pytest.mark.parametrize("mode", ["decode", "extend_prefix", "verify_chain", "verify_tree_4",
                                  "draft_decode", "dflash_block"])
def test_flashinfer_reads_the_pools_own_pages(page: int, mode: str) -> None:
    """FlashInfer on the pool's native pages, GPT-OSS geometry with sinks:
    windows that start mid-page, nodes sharing a page with committed keys."""
    extra = ["model.sliding_window=20", "model.num_layers=4", "model.softmax_scale=0.1"]
    w, _ = world("flashinfer", "gpt_oss_20b", extra, page=page)
    assert_close(run_mode(w, mode, [0, 1], 20), BF16)
    assert w.backend.adapter._page == page  # planned on the pool's pages


@pytest.mark.parametrize("page", [16, 128])
@pytest.mark.parametrize("mode", ["decode", "extend_prefix", "verify_chain", "verify_tree_4",
                                  "draft_decode", "dflash_block"])
def test_flash_attn_reads_the_pools_own_pages(page: int, mode: str) -> None:
    """flash-attn-4 on the pool's native pages (page 128 is its TMA path),
    GPT-OSS geometry with sinks: natural passes read [rows/P, P, Hkv, D] through page ids,
    per-query key lists (trees, DFlash blocks) the page-size-1 view."""
    extra = ["model.sliding_window=20", "model.num_layers=4", "model.softmax_scale=0.1"]
    w, _ = world("flash_attn", "gpt_oss_20b", extra, page=page)
    assert_close(run_mode(w, mode, [0, 1], 20), BF16)
    a = w.backend.adapter
    assert a.runs_by_page.get(page), a.runs_by_page
    if mode in ("decode", "extend_prefix", "verify_chain"):  # ≤ 64 packed rows: the 64-row tile
        tile = flash_attn.pass_tile(8, 64, flash_attn._arch(torch.device("cuda")))
        assert (page, tile) in a.runs and a.tile_fallback is None, (a.runs, a.tile_fallback)
