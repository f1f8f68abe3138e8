"""The registry's rules: every reason at once, alternatives, auto selection, pinned policies."""
from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import swafactory
from swafactory import ConfigError
from swafactory.registry import CPU, H200, get_capabilities, list_backends, register_backend
from swafactory.registry.device import B200, DeviceInfo
from swafactory.registry.matrix import shipped_config
from swafactory.registry.select import AUTO_PREFERENCE, resolve_auto, validate
from swafactory.registry.table import has_adapter


def rules(cfg, device) -> set[str]:
    """The reasons as `rule@field`, leaving out the adapter rule (which follows what is built,
    not what the kernels can do; tested on its own below)."""
    return {f"{r.rule}@{r.field}" for r in swafactory.check(cfg, device) if r.rule != "adapter"}


def test_flash_attn_gemma4_on_cpu_names_512_and_the_gpu_and_suggests() -> None:
    cfg = shipped_config("flash_attn", "eagle3", "gemma4")
    with pytest.raises(ConfigError) as info:
        validate(cfg, CPU)
    err = info.value
    text = str(err)
    assert "head_dim 512" in text and "≤ 256" in text
    assert "needs a CUDA GPU" in text
    assert err.alternatives == ("torch",) and "backend=torch" in (err.suggestion or "")


def test_flash_attn_gemma4_on_h200_is_refused_only_for_head_dim() -> None:
    assert rules(shipped_config("flash_attn", "none", "gemma4"), H200) == {"head_dims@model.full.head_dim"}


def test_trtllm_eagle3_gives_sm100_and_topk_reasons() -> None:
    cfg = shipped_config("trtllm_mha", "eagle3", "gemma4")
    got = rules(cfg, H200)
    assert {"device@backend.name", "tree@spec.topk"} <= got
    text = str(pytest.raises(ConfigError, validate, cfg, H200).value)
    assert "SM100" in text and "topk=4" in text
    assert rules(cfg, B200) == {"tree@spec.topk"}
    assert not rules(shipped_config("trtllm_mha", "eagle", "gemma4"), B200)


def test_a_backend_without_an_adapter_is_refused_everywhere() -> None:
    # trtllm_mha is declared for validation only: on its own arch the missing adapter remains
    reasons = swafactory.check(shipped_config("trtllm_mha", "eagle", "gemma4"), B200)
    assert [r.rule for r in reasons] == ["adapter"]
    assert "no adapter" in reasons[0].message


def test_sinks_are_refused_where_the_backend_cannot_serve_them(monkeypatch) -> None:
    import sys
    import types

    from swafactory.registry import table
    from swafactory.registry.capabilities import Capabilities

    # flashinfer serves sinks on SM90 through its LSE epilogue
    assert rules(shipped_config("flashinfer", "none", "gpt_oss_20b"), H200) == set()
    mod = types.ModuleType("nosinks_backend")
    mod.CAPABILITIES = Capabilities(name="nosinks", summary="test", kernel="test",
                                    devices=frozenset({"cpu"}), sinks_note="not here")
    mod.Adapter = object
    monkeypatch.setitem(sys.modules, "nosinks_backend", mod)
    monkeypatch.setattr(table, "BACKENDS", {**table.BACKENDS, "nosinks": "nosinks_backend"})
    table.get_capabilities.cache_clear()
    table.has_adapter.cache_clear()
    cfg = shipped_config("torch", "none", "gpt_oss_20b")
    cfg = cfg.model_copy(update={"backend": cfg.backend.model_copy(update={"name": "nosinks",
                                                                            "kv_dtype": "bfloat16"})})
    reasons = swafactory.check(cfg, CPU)
    assert [r.field for r in reasons] == ["model.attention_sinks"] and "not here" in reasons[0].message
    assert not swafactory.check(cfg.model_copy(update={"model": cfg.model.model_copy(
        update={"attention_sinks": False})}), CPU)


def test_missing_package_is_a_reason_with_the_install_fix() -> None:
    no_pkgs = DeviceInfo("cuda", sm=90, name="H200 without packages")
    reasons = swafactory.check(shipped_config("flashinfer", "none", "gemma4"), no_pkgs)
    assert [r.rule for r in reasons] == ["packages"]
    assert reasons[0].fix == "pip install 'swafactory[flashinfer]'"


def test_triton_runs_on_cpu_only_under_the_interpreter() -> None:
    cfg = shipped_config("triton", "none", "tiny")
    assert rules(cfg, CPU) == {"device@backend.name", "packages@backend.name"}
    interp = DeviceInfo("cpu", packages=frozenset({"triton"}), triton_interpret=True)
    assert rules(cfg.model_copy(update={"backend": cfg.backend.model_copy(
        update={"kv_dtype": "float16"})}), interp) == set()
    # the interpreter's bf16 tl.dot is off by ~1e10: triton's default kv_dtype is refused there
    assert cfg.backend.kv_dtype == "bfloat16"
    assert rules(cfg, interp) == {"device@backend.kv_dtype"}


@pytest.mark.parametrize("spec", ["eagle", "eagle3", "nextn", "dflash", "standalone"])
def test_allocator_policy_is_refused_for_own_pool_drafts(spec: str) -> None:
    cfg = swafactory.compose(["backend=torch", f"spec={spec}", "backend.resolver=allocator"])
    reasons = swafactory.check(cfg, CPU)
    assert [r.field for r in reasons] == ["backend.resolver"]
    assert reasons[0].fix == "backend.resolver=auto"


def test_active_pool_policy_is_refused_for_frozen_kv() -> None:
    bad = swafactory.compose(["backend=torch", "spec=frozen_kv_mtp", "backend.resolver=active_pool"])
    assert [r.rule for r in swafactory.check(bad, CPU)] == ["resolver"]
    ok = swafactory.compose(["backend=torch", "spec=frozen_kv_mtp", "backend.resolver=allocator"])
    assert swafactory.check(ok, CPU) == []
    # a model without a split pool has nothing to translate: any policy is fine
    plain = swafactory.compose(["backend=torch", "spec=eagle", "model=gemma3_4b",
                                "backend.resolver=allocator"])
    assert swafactory.check(plain, CPU) == []


def test_sizing_rule_refuses_a_too_small_swa_pool_and_gives_the_ratio() -> None:
    cfg = swafactory.compose(["backend=torch", "workload.swa_full_tokens_ratio=0.05"])
    (r,) = swafactory.check(cfg, CPU)
    assert r.rule == "sizing" and r.fix == "workload.swa_full_tokens_ratio=0.13"
    fixed = swafactory.compose(["backend=torch", "workload.swa_full_tokens_ratio=0.13"])
    assert swafactory.check(fixed, CPU) == []


def test_tree_rules_strategy_and_paged_trees() -> None:
    """No shipped backend limits its tree strategy today: the rule is checked on declared data
    (an FA3-like backend: cascade only, trees only at page size 1)."""
    from dataclasses import replace

    import importlib

    chk = importlib.import_module("swafactory.registry.check")
    from swafactory.registry.table import get_capabilities

    caps = replace(get_capabilities("flash_attn"), tree_masks=frozenset({"cascade"}),
                   paged_trees=False)
    cfg = swafactory.compose(["backend=flash_attn", "model=gpt_oss_20b", "backend.tree_mask=custom_mask",
                              "backend.page_size=16"])
    assert {r.field for r in chk._tree(cfg, caps, H200)} == {"backend.tree_mask", "backend.page_size"}
    chain = swafactory.compose(["backend=flash_attn", "model=gpt_oss_20b", "spec=eagle",
                                "backend.page_size=16"])
    assert list(chk._tree(chain, caps, H200)) == []


def test_cuda_graph_and_dtype_rules() -> None:
    cfg = swafactory.compose(["backend=torch", "backend.cuda_graph=true", "backend.kv_dtype=fp8_e4m3"])
    assert rules(cfg, CPU) == set()  # torch reads fp8 with scales, and emulates graphs on CPU
    assert rules(cfg, H200) == {"cuda_graph@backend.cuda_graph"}  # but captures none on CUDA
    on_cpu = swafactory.compose(["backend=flashinfer", "backend.cuda_graph=true"])
    why = [r for r in swafactory.check(on_cpu, CPU) if r.field == "backend.cuda_graph"]
    assert len(why) == 1 and "need a CUDA device" in why[0].message
    assert "backend=torch" in why[0].fix  # the CPU way to run the graph contract
    flex = swafactory.compose(["backend=flex", "backend.kv_dtype=fp8_e4m3", "model=gpt_oss_20b"])
    assert "dtype@backend.kv_dtype" in rules(flex, CPU)
    graphs = swafactory.compose(["backend=flashinfer", "backend.cuda_graph=true"])
    assert rules(graphs, H200) == set()  # swafactory.graphs.replay serves flashinfer decode/verify
    decode = swafactory.compose(["backend=triton", "backend.cuda_graph=true", "spec=none"])
    assert rules(decode, H200) == set()  # triton replays decode buckets
    spec = swafactory.compose(["backend=triton", "backend.cuda_graph=true", "spec=eagle3"])
    assert rules(spec, H200) == set()  # and verify/draft buckets (static tables with a mask)


def test_auto_picks_torch_on_cpu_and_the_fastest_on_h200() -> None:
    cfg = swafactory.compose([])
    assert cfg.backend.name == "auto"
    assert resolve_auto(cfg, CPU).backend.name == "torch"
    for model in ("gemma4", "gpt_oss_20b"):
        c = swafactory.compose([f"model={model}", "spec=none"])
        want = next(b for b in AUTO_PREFERENCE["cuda"]
                    if not swafactory.check(c.model_copy(update={"backend": c.backend.model_copy(
                        update={"name": b})}), H200))
        got = resolve_auto(c, H200).backend.name
        assert got == want and has_adapter(got)


def test_auto_keeps_the_user_fields() -> None:
    cfg = swafactory.compose(["backend.page_size=16", "backend.kv_dtype=float32"])
    got = resolve_auto(cfg, CPU).backend
    assert (got.name, got.page_size, got.kv_dtype) == ("torch", 16, "float32")


def test_capabilities_import_without_gpu_packages() -> None:
    code = ("import sys; sys.modules['flashinfer'] = None; sys.modules['triton'] = None; "
            "sys.modules['flash_attn'] = None; from swafactory.registry import get_capabilities, "
            "list_backends; print(len([get_capabilities(b) for b in list_backends()]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(len(list_backends()))


@pytest.mark.parametrize("name", list_backends())
def test_every_backend_declares_capabilities_under_its_key(name: str) -> None:
    caps = get_capabilities(name)
    assert caps.name == name and caps.devices and caps.kv_dtypes


def test_register_backend_refuses_duplicates_and_accepts_new(monkeypatch) -> None:
    from swafactory.registry import table

    monkeypatch.setattr(table, "BACKENDS", dict(table.BACKENDS))
    with pytest.raises(ValueError, match="already registered"):
        register_backend("torch", "x.y")
    register_backend("mine", "swafactory.kernels.torch_ref")
    with pytest.raises(ValueError, match="registered as 'mine'"):
        get_capabilities("mine")  # the module declares another key
    get_capabilities.cache_clear()
    importlib.import_module("swafactory.kernels.torch_ref")


def test_flashinfer_fp8_is_refused_for_the_512_layers_on_sm90_only() -> None:
    """FlashInfer 0.6.18 has no fp8-KV kernel at head_dim 512 below SM100: Gemma 4's full layers
    are refused on the H200, naming the group and offering triton; GPT-OSS (D = 64) is not."""
    fp8 = ["backend=flashinfer", "backend.kv_dtype=fp8_e4m3", "spec=none"]
    gemma = swafactory.compose([*fp8, "model=gemma4"])
    assert rules(gemma, H200) == {"dtype@backend.kv_dtype"}
    err = pytest.raises(ConfigError, validate, gemma, H200).value
    assert "the 10 full layers of gemma4 have head_dim 512" in str(err)
    assert "up to head_dim 256 on SM90" in str(err) and "triton" in err.alternatives
    assert rules(gemma, B200) == set()
    assert rules(swafactory.compose([*fp8, "model=gpt_oss_20b"]), H200) == set()


def test_the_triton_interpreter_still_gets_bf16_dots_wrong(tmp_path) -> None:
    """Why the rule above exists. When a Triton release fixes its interpreter's bf16 tl.dot, this
    fails: then lift the kv_dtype rule in `registry.check._device`."""
    pytest.importorskip("triton")
    import subprocess
    import sys

    script = tmp_path / "dot.py"
    script.write_text('''import os
os.environ["TRITON_INTERPRET"] = "1"
import torch, triton, triton.language as tl

@triton.jit
def dot(a_ptr, b_ptr, c_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    a = tl.load(a_ptr + i[:, None] * N + i[None, :])
    b = tl.load(b_ptr + i[:, None] * N + i[None, :])
    tl.store(c_ptr + i[:, None] * N + i[None, :], tl.dot(a, b))

for dt in (torch.float16, torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(16, 16, generator=g).to(dt) for _ in range(2))
    c = torch.empty(16, 16)
    dot[(1,)](a, b, c, N=16)
    print(dt, float((c - a.float() @ b.float()).abs().max()))
''')
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120)
    errs = dict(line.split() for line in out.stdout.splitlines())
    assert float(errs["torch.float16"]) < 1e-3, out.stdout + out.stderr
    assert float(errs["torch.bfloat16"]) > 1.0, out.stdout


@pytest.mark.parametrize("model,refused", [("tiny", True), ("gemma4", True),
                                           ("gpt_oss_20b", False)])
def test_a_window_retained_pool_is_refused_where_its_drafter_cannot_share_the_swa_geometry(
        model: str, refused: bool) -> None:
    """run=generate's EAGLE-3 head is one Llama geometry (the target's full layers'); a
    window-retained draft pool puts it on the target's SWA sub-pool. Where the two differ the
    run is refused before anything is built, with the fix; GPT-OSS's groups share one geometry.
    A split DFlash pool is served everywhere: its drafter takes the SWA geometry for its sliding
    layers (`drafts.dflash`; tests/engine/test_draft_formats.py)."""
    base = ["run=generate", "backend=torch", f"model={model}", "spec.draft_weights=distilled"]
    cfg = swafactory.compose([*base, "spec=eagle3", "spec.draft_kv_retention=window",
                              "spec.draft_window=16"])
    reasons = [r for r in swafactory.check(cfg, CPU) if r.field == "spec.draft_kv_retention"]
    assert len(reasons) == int(refused), reasons
    if refused:
        assert reasons[0].fix == "spec.draft_kv_retention=full"
        assert "SWA geometry" in reasons[0].message and f"model={model}" in reasons[0].message
        with pytest.raises(ConfigError, match="spec.draft_kv_retention"):
            validate(cfg, CPU)
    for weights in ("distilled", "target"):
        dflash = swafactory.compose([*base, "spec=dflash", "spec.draft_pool_split=true",
                                     f"spec.draft_weights={weights}"])
        assert not [r for r in swafactory.check(dflash, CPU)
                    if r.field == "spec.draft_pool_split"]
