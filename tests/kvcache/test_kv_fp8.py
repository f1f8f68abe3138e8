"""fp8 KV at the pool: half the bytes, writes quantized with each layer's scales, freed rows
poisoned with e4m3's NaN, moves that keep the stored bytes, and scales refused when invalid."""
from __future__ import annotations

import pytest
import torch

import swafactory
from swafactory.kvcache.locs import Locs, translate
from swafactory.kvcache.move import move_kv
from swafactory.kvcache.pool import ReqToToken
from swafactory.kvcache.requests import RequestSlots
from swafactory.kvcache.sizing import build_pools

F8 = torch.float8_e4m3fn


def _pools(kv_dtype: str, check_mode: bool = True):
    cfg = swafactory.compose(["model=tiny", "spec=none", "backend=torch",
                              f"backend.kv_dtype={kv_dtype}"])
    return build_pools(cfg, 64, 32, check_mode=check_mode)


def test_fp8_pools_hold_half_the_bytes_of_bf16() -> None:
    (p8, _), (p16, _) = _pools("fp8_e4m3"), _pools("bfloat16")
    assert [s.dtype for s in p8.sub_pools] == [F8, F8]
    assert [s.bytes * 2 for s in p8.sub_pools] == [s.bytes for s in p16.sub_pools]


def test_writes_quantize_with_the_layer_scales_and_saturate() -> None:
    pool, alloc = _pools("fp8_e4m3")
    slots = RequestSlots(alloc, ReqToToken(2, 64))
    slots.open("a")
    slots.extend("a", 4)
    full = slots.slots("a", 0, 4)
    pool.set_kv_scales(2, 0.5, 2.0)  # layer 2: full sub-pool, local 0
    pool.set_kv_scales(5, 1.0, 1.0)
    sub = pool.sub_pool(2)
    k = torch.randn(4, sub.num_kv_heads, sub.head_dim)
    k[0, 0, 0] = 1e4  # past e4m3's 448 · 0.5: saturates instead of turning NaN
    v = torch.randn_like(k)
    pool.write(2, full, k, v)
    ks, vs = pool.read(2, full)
    assert ks.dtype == F8
    assert float(ks[0, 0, 0].float()) == 448.0
    want_k = (k / 0.5).clamp(-448, 448).to(F8).float() * 0.5
    torch.testing.assert_close(ks.float() * 0.5, want_k, rtol=0, atol=0)
    torch.testing.assert_close(vs.float() * 2.0, (v / 2.0).to(F8).float() * 2.0, rtol=0, atol=0)
    assert pool.kv_scales(2) == (0.5, 2.0) and pool.kv_scales(5) == (1.0, 1.0)


def test_freed_rows_read_nan_and_moves_keep_the_bytes() -> None:
    pool, alloc = _pools("fp8_e4m3")
    slots = RequestSlots(alloc, ReqToToken(2, 64))
    slots.open("a")
    slots.extend("a", 6)
    locs = slots.slots("a", 0, 6)
    for layer in range(6):
        sub = pool.sub_pool(layer)
        x = torch.randn(6, sub.num_kv_heads, sub.head_dim)
        dst = locs if sub.space == "full" else translate(locs, pool.mapping, sub)
        pool.write(layer, dst, x, x)
    src, dst = (Locs("full", alloc.full_id, locs.tensor[4:6]),
                Locs("full", alloc.full_id, locs.tensor[0:2]))
    before = [pool.read(layer, src if pool.sub_pool(layer).space == "full" else
                        translate(src, pool.mapping, pool.sub_pool(layer)))[0].view(torch.uint8)
              for layer in range(6)]
    move_kv(pool, src, dst)
    for layer in range(6):
        sub = pool.sub_pool(layer)
        d = dst if sub.space == "full" else translate(dst, pool.mapping, sub)
        assert torch.equal(pool.read(layer, d)[0].view(torch.uint8), before[layer])
    full_rows = locs.tensor[:2].long()
    slots.truncate("a", 0)  # frees every slot: check mode poisons the rows
    k_buf, _, _ = pool.get_kv(2)
    assert torch.isnan(k_buf[full_rows].float()).all()


def test_scales_must_be_positive_and_finite() -> None:
    pool, _ = _pools("fp8_e4m3", check_mode=False)
    with pytest.raises(ValueError, match="k_scale must be a positive finite float, got 0"):
        pool.set_kv_scales(0, 0, 1.0)
    with pytest.raises(ValueError, match="v_scale .* got inf"):
        pool.set_kv_scales(0, 1.0, float("inf"))
    v0 = pool.scales_version
    pool.set_kv_scales(0, 0.25, 0.5)
    assert pool.scales_version == v0 + 1


def test_the_backends_fast_write_quantizes_with_the_scales_set_after_it_was_built() -> None:
    """Outside check mode the backend stores K/V itself (not through `pool.write`); it must use
    each layer's current scales, also ones set after its per-layer entries were cached."""
    from swafactory.metadata.batch import ForwardBatch, ReqForward

    cfg = swafactory.compose(["model=tiny", "spec=none", "backend=torch",
                              "backend.kv_dtype=fp8_e4m3"])
    pool, alloc = build_pools(cfg, 64, 32, check_mode=False)
    slots = RequestSlots(alloc, ReqToToken(2, 64))
    slots.open("a")
    slots.extend("a", 3)
    backend = swafactory.build_backend(cfg, pools=pool)
    batch = ForwardBatch.of("extend", [ReqForward("a", slots.reqs["a"].row, 0, 3)],
                            slots.req_to_token.table, alloc.full_id)
    sub = pool.sub_pool(2)
    rows = slots.slots("a", 0, 3).tensor.long()
    for k_scale, v_scale in ((1.0, 1.0), (0.25, 4.0)):  # the second set after the first forward
        pool.set_kv_scales(2, k_scale, v_scale)
        backend.init_forward_metadata(batch)
        k = torch.randn(3, sub.num_kv_heads, sub.head_dim) * 3
        v = torch.randn_like(k) * 3
        q = torch.randn(3, cfg.model.num_attention_heads, sub.head_dim, dtype=torch.bfloat16)
        backend.forward(q, k, v, 2)
        k_buf, v_buf, _ = pool.get_kv(2)
        assert torch.equal(k_buf[rows].view(torch.uint8), (k / k_scale).to(F8).view(torch.uint8))
        assert torch.equal(v_buf[rows].view(torch.uint8), (v / v_scale).to(F8).view(torch.uint8))
