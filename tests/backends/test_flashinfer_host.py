"""The flashinfer adapter on machines without FlashInfer: imports, masks, sinks and plan reuse
through `flashinfer_fake` (FlashInfer's semantics on CPU tensors); every mode, tree strategy,
sinks and soft-cap against the oracle in `test_adapters_through_fakes.py`.

The fake keeps FlashInfer's window convention (relative to the query's index in the key list) and
its base-2 LSE, so a window left to the kernel for a trimmed or tree pass, or a forgotten LSE
conversion, fails here exactly as it would on the GPU.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import swafactory
from flashinfer_fake import module as fake_flashinfer
from swafactory.backend import AttentionBackend, TargetView, model_windows
from swafactory.harness.world import World
from swafactory.kernels import flashinfer as fi
from swafactory.kernels.torch_ref import attend
from swafactory.metadata import ForwardBatch
from swafactory.registry.table import backend_module


def adapter_world(model: str, page: int, extra=(), *, tree_mask: str = "custom_mask", seed: int = 0,
                  device: str = "cpu", kv_dtype: str = "float32", via_registry: bool = False,
                  backend: str = "flashinfer"):
    """A `World` whose backend runs ``backend``'s adapter.

    via_registry: build through `build_backend` (the registry must accept the combination);
    otherwise the world is built for the torch backend and its backend swapped for one around the
    adapter (CPU tensors with a fake kernel module, or combinations the registry refuses).
    """
    adapter_cls = backend_module(backend).Adapter
    name = backend if via_registry else "torch"
    cfg = swafactory.compose([f"model={model}", f"backend={name}", f"backend.page_size={page}",
                              f"backend.tree_mask={tree_mask}", "spec=none",
                              f"backend.kv_dtype={kv_dtype}", "backend.cuda_graph=false", *extra])
    size = 64 * max(16, page) * 4
    world = World(cfg, size_full=size, size_swa=size // 2, seed=seed, device=device)
    if not via_registry:
        world.backend = AttentionBackend(cfg, adapter_cls(), TargetView(world.pool),
                                         model_windows(cfg))
    assert isinstance(world.backend.adapter, adapter_cls)
    return world, cfg


def set_policy(world, model: str, *overrides: str) -> None:
    """Give ``world``'s adapter the `KernelPolicy` a registry build would (CPU, no nvcc) for
    ``model`` with a verify pass and ``overrides`` (e.g. ``backend.kernels.swa.verify=library``)."""
    from swafactory.registry.device import DeviceInfo
    from swafactory.registry.kernel_choice import KernelPolicy, resolve_passes

    cfg = swafactory.compose([f"model={model}", "backend=flashinfer", "spec=dflash", *overrides])
    world.backend.adapter.kernels = KernelPolicy(resolve_passes(cfg, DeviceInfo("cpu"),
                                                                nvcc=False))


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer())


def test_module_imports_without_flashinfer() -> None:
    code = ("import sys; sys.modules['flashinfer'] = None; "
            "from swafactory.kernels.flashinfer import Adapter, CAPABILITIES; Adapter(); "
            "print(CAPABILITIES.name)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "flashinfer", out.stderr


def test_sink_epilogue_equals_sinks_in_the_softmax(fake) -> None:
    world, _ = adapter_world("tiny", 1, ["model.sliding_window=5"])
    world.open(0)
    world.forward("extend", [world.req(0, 0, 9)], [0])
    world.forward("target_verify", [world.req(0, 9, 3)], [0])  # writes the nodes' K/V
    batch = ForwardBatch.of("target_verify", [world.req(0, 9, 3)], world.slots.req_to_token.table,
                            world.alloc.full_id)
    t = world.backend.init_forward_metadata(batch).group(0).tables
    k, v, _ = world.pool.get_kv(0)
    q = torch.randn(3, 8, k.shape[-1])
    sinks = torch.randn(8) * 2
    o0, l0 = attend(t, q, k, v, window=5, scale=0.3)
    o1, l1 = attend(t, q, k, v, window=5, scale=0.3, sinks=sinks)
    o2, l2 = fi.apply_sinks(o0, l0, sinks)
    torch.testing.assert_close(o2, o1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(l2, l1, rtol=1e-5, atol=1e-6)


def test_custom_mask_is_structure_and_window_by_position(fake) -> None:
    """A trimmed SWA list: the first keys are outside later queries' windows; tree nodes sit at
    prefix + depth, not at their list index."""
    world, _ = adapter_world("tiny", 1, ["model.sliding_window=4"])
    world.open(0)
    world.forward("extend", [world.req(0, 0, 10)], [0])
    world.slots.extend(0, 4)  # the step's nodes have slots
    parents = (-1, -1, 0, 1)  # two roots at depth 0, one child each at depth 1
    batch = ForwardBatch.of("target_verify", [world.req(0, 10, 4, parents=parents)],
                            world.slots.req_to_token.table, world.alloc.full_id)
    t = world.backend.init_forward_metadata(batch).group(0).tables
    m = fi.custom_mask(t, 4).view(4, -1)
    kv_pos = t.kv_pos.tolist()
    assert kv_pos == [7, 8, 9, 10, 10, 11, 11]  # trimmed to 10 - 4 + 1, nodes at prefix + depth
    expect = torch.tensor([[1, 1, 1, 1, 0, 0, 0],   # root a at 10: keys 7..10, itself
                           [1, 1, 1, 0, 1, 0, 0],   # root b at 10
                           [0, 1, 1, 1, 0, 1, 0],   # a's child at 11: 8..11 on its branch
                           [0, 1, 1, 0, 1, 0, 1]], dtype=torch.bool)
    assert torch.equal(m, expect)


@pytest.mark.parametrize("layout", ["bit_offsets", "dense"])
def test_packed_mask_holds_the_bool_mask_at_each_layouts_offsets(fake, layout: str) -> None:
    """The packed mask the adapter hands FlashInfer (no ``segment_packbits``, so no read-back):
    request b's bits sit little-endian from byte ``off[b]``, and every element of every request's
    block (trees, trimmed windows, requests of several sizes) equals `custom_mask`."""
    world, _ = adapter_world("tiny", 1, ["model.sliding_window=5"])
    shapes = [(0, 13, 4, (-1, 0, 0, 1)), (1, 3, 3, None), (2, 20, 1, None), (3, 7, 5, (-1, -1, 0, 1, 3))]
    for rid, ctx, _, _ in shapes:
        world.open(rid)
        world.forward("extend", [world.req(rid, 0, ctx)], [0])
    for rid, ctx, n, parents in shapes:
        world.slots.extend(rid, n)
    batch = ForwardBatch.of("target_verify", [world.req(rid, ctx, n, parents=parents)
                                              for rid, ctx, n, parents in shapes],
                            world.slots.req_to_token.table, world.alloc.full_id)
    t = world.backend.init_forward_metadata(batch).group(0).tables
    want = fi.custom_mask(t, 5)
    packed, off = fi.packed_custom_mask(t, 5, layout)
    q = (t.qo_host[1:] - t.qo_host[:-1]).long()
    k = (t.kv_host[1:] - t.kv_host[:-1]).long()
    start = 0
    for b in range(len(shapes)):
        n = int(q[b] * k[b])
        e = torch.arange(n)
        got = (packed[int(off[b]) + e // 8].long() >> (e % 8)) & 1
        assert torch.equal(got.bool(), want[start:start + n]), f"request {b}"
        if layout == "dense":
            assert int(off[b + 1] - off[b]) == (n + 7) // 8
        else:
            assert int(off[b + 1] - off[b]) == n
        start += n
    assert packed.numel() == int(off[-1]) and start == want.numel()


def test_one_wrapper_plan_per_pass_per_forward(fake) -> None:
    """Host work once per forward: later layers of a group reuse the first layer's plan."""
    world, cfg = adapter_world("gemma4", 1, ["model.sliding_window=8", "model.num_layers=12"])
    world.open(0)
    # 40 queries: past the 64 rows per KV head of our tile at either group (2 and 8)
    world.forward("extend", [world.req(0, 0, 40)], [0, 1, 2, 5, 11])
    ad = world.backend.adapter
    assert {k[0] for k in ad._wrappers} == {"swa/w8", "full"}  # group_key: window in the key
    assert all(w.plans == 1 for w in ad._wrappers.values())
    world.forward("decode", [world.req(0, 40, 1)], [0, 1, 2, 5, 11])
    assert sorted(w.plans for w in ad._wrappers.values()) == [1, 1, 1, 1]  # decode wrappers new


def test_wrappers_are_planned_in_init_forward_metadata_and_no_lse_is_asked(fake) -> None:
    """FlashInfer's ``plan`` runs in `init_forward_metadata` (the backend knows each group's
    heads, dtypes and scale); `forward` only runs, and asks for no LSE without sinks."""
    world, cfg = adapter_world("gemma4", 1, ["model.sliding_window=8", "model.num_layers=6"])
    world.open(0)
    world.forward("extend", [world.req(0, 0, 12)], list(range(6)))
    backend, ad = world.backend, world.backend.adapter
    world.slots.extend(0, 1)
    batch = ForwardBatch.of("decode", [world.req(0, 12, 1)], world.slots.req_to_token.table,
                            world.alloc.full_id)
    backend.init_forward_metadata(batch)
    planned = {k: w.plans for k, w in ad._wrappers.items()}
    assert {k[0] for k in planned if k[2]} == {"swa/w8", "full"}  # decode wrappers, planned now
    asked = []
    for w in ad._wrappers.values():
        run = w.run
        w.run = lambda q, kv, return_lse=False, run=run: (asked.append(return_lse),
                                                          run(q, kv, return_lse))[1]
    m = cfg.model
    for layer in range(6):
        sub = world.pool.sub_pool(layer)
        q = torch.randn(1, m.num_attention_heads, sub.head_dim)
        k = torch.randn(1, sub.num_kv_heads, sub.head_dim)
        out = backend.forward(q, k, k.clone(), layer)
        assert out.shape == q.shape
    assert {k: w.plans for k, w in ad._wrappers.items()} == planned and ad.replans == 0
    assert asked == [False] * 6
    # an engine whose heads differ from q_heads: guards refuse it (test_misuse); without them
    # the adapter re-plans the pass for the heads the layer brings
    backend.guards = False
    backend.q_heads = m.num_attention_heads // 2
    backend.init_forward_metadata(batch)
    backend.forward(q, k, k.clone(), 5)
    assert ad.replans == 1


@pytest.mark.parametrize("internals", [True, False], ids=["scheduler_alone", "fast_decode_plan"])
@pytest.mark.parametrize("page", [1, 16])
def test_repeat_decode_plans_take_flashinfers_fast_path(fake, monkeypatch, page: int,
                                                        internals: bool) -> None:
    """A decode wrapper planned before with the same signature is re-planned without ``plan``
    (eager, page size 1): by its scheduler call alone where the wrapper has FlashInfer 0.6's
    internals (`flashinfer_replan`), else through ``fast_decode_plan``; either way from the
    planner's device indptr and its host twin (nothing read back), with the last full plan's
    dtypes. Outputs equal the oracle; a paged pool, or a new signature, gets a full ``plan``."""
    from test_backends_vs_oracle import assert_close, run_mode

    monkeypatch.setattr(sys.modules["flashinfer"].BatchDecodeWithPagedKVCacheWrapper,
                        "internals", internals)
    world, cfg = adapter_world("tiny", page, ["model.sliding_window=20"])
    assert_close(run_mode(world, "decode", [0, 2], 20))  # two decode steps
    ad = world.backend.adapter
    dec = [w for k, w in ad._wrappers.items() if k[2]]
    assert dec and ad.fast_plans == (len(dec) if page == 1 else 0)
    assert ad.direct_plans == (ad.fast_plans if internals else 0)
    fast = 1 if page == 1 and not internals else 0
    assert all((w.plans, w.fast) == ((1, fast) if page == 1 else (2, 0)) for w in dec)
    if internals and page == 1:  # the scheduler ran once per re-plan
        assert all(w._cached_module.calls == 1 for w in dec)
    if page == 1:  # an engine whose heads differ from the config's: a full plan, then fast again
        backend = world.backend
        world.slots.extend(0, 1)
        n = world.slots.reqs[0].kv_len - 1
        batch = ForwardBatch.of("decode", [world.req(0, n, 1)], world.slots.req_to_token.table,
                                world.alloc.full_id)
        backend.q_heads = cfg.model.num_attention_heads // 2
        backend.init_forward_metadata(batch)
        assert all(w.plans == 2 for w in dec) and ad.fast_plans == len(dec)
        backend.init_forward_metadata(batch)
        assert all(w.plans == 2 for w in dec) and ad.fast_plans == 2 * len(dec)


@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("tree_mask", ["custom_mask", "cascade"])
@pytest.mark.parametrize("mode", ["decode", "extend_prefix", "verify_chain", "verify_tree_4",
                                  "draft_decode", "dflash_block"])
def test_native_pages_reach_flashinfer(fake, page: int, tree_mask: str, mode: str) -> None:
    """At page size P the adapter hands FlashInfer the pool's own pages ([rows/P, P, Hkv, D],
    page ids, last-page lengths), never a page-size-1 view: the fake refuses a cache whose page
    size is not the planned one and records each run's. Windows start mid-page (W = 20 at P =
    16 or 64), the step's nodes share a page with committed keys, and a cascade's halves both
    start on a page; every output equals the oracle."""
    import flashinfer_fake
    from test_backends_vs_oracle import assert_close, run_mode

    flashinfer_fake.runs.clear()
    world, _ = adapter_world("tiny", page, ["model.sliding_window=20"], tree_mask=tree_mask)
    assert_close(run_mode(world, mode, [0, 2], 20))
    assert flashinfer_fake.runs and set(flashinfer_fake.runs) == {page}


def test_page_table_of_lists_that_start_on_a_page() -> None:
    """Two requests at P = 4: rows 8-13 (pages 2, 3; 2 keys in the last), none, rows 20-23."""
    kv_host = torch.tensor([0, 6, 6, 10], dtype=torch.int32)
    rows = torch.tensor([8, 9, 10, 11, 12, 13, 20, 21, 22, 23], dtype=torch.int32)
    ptr, ids, last = fi.page_table(kv_host, rows, 4)
    assert ptr.tolist() == [0, 2, 2, 3] and ids.tolist() == [2, 3, 5]
    assert last.tolist() == [2, 4, 4]  # the empty list: 0 pages, FlashInfer counts 0 keys


@pytest.mark.parametrize("swa", ["auto", "library"])
@pytest.mark.parametrize("mode", ["verify_chain", "verify_tree_2", "dflash_block"])
def test_verify_runs_our_tile_not_flashinfers_prefill(fake, mode, swa) -> None:
    """A step of at most 8 tokens on Gemma 4's layers (full: head_dim 512, group 8 = 64 rows per
    KV head; SWA: head_dim 256, group 2 = 16 rows) is planned without FlashInfer and run by the
    Triton extend tile (the reference off CUDA); ``backend.kernels.swa.verify=library`` gives the
    SWA layers back to FlashInfer's prefill. Outputs equal the oracle either way."""
    from test_backends_vs_oracle import assert_close, run_mode

    # the first 6 layers (5 sliding, then a full one): Gemma 4's 60 layers of fp32 pools at
    # head_dim 512 took 13.7 GB, enough to run a 24 GB machine out of memory beside a worker;
    # half its heads (GQA 2 / 8 and so the tiles kept, two KV heads in the full group): the
    # tile runs interpreted, one program per KV head
    world, _ = adapter_world("gemma4", 1, ["model.sliding_window=8", "model.num_layers=6",
                                           "model.num_attention_heads=16",
                                           "model.swa.num_kv_heads=8", "model.full.num_kv_heads=2"])
    ad = world.backend.adapter
    set_policy(world, "gemma4", f"backend.kernels.swa.verify={swa}")
    planned = []
    real = ad._plan_wrapper

    def spy(p, sig, device):
        planned.append((p.group, p.decode, int((p.qo_host[1:] - p.qo_host[:-1]).max())))
        return real(p, sig, device)

    ad._plan_wrapper = spy
    assert_close(run_mode(world, mode, [0, 5], 8))
    step = {g for g, dec, n in planned if not dec and n <= 8}  # the step, not the prefill
    assert step == ({"swa/w8"} if swa == "library" else set()), planned
    t = world.backend.plan.groups["full"].tables
    rows = t.max_q_len * 8  # at group 8: ours; at group 32 past 64 rows: FlashInfer's
    assert rows <= 64 and fi.uses_triton_verify((32, 4, 512), t)
    assert fi.uses_triton_verify((32, 16, 256), t) and not fi.uses_triton_verify((128, 4, 64), t)
