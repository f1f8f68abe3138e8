"""An engine's mistakes raise in its terms, before any kernel runs and before anything is
written (`build_backend(..., guards=True)`, the default; `swafactory.guards`).

One table: each case builds a forward the way an engine would get it wrong (a q of the wrong
heads, dtype or rows; k/v missing or of the wrong shape; a request whose row has no slots;
the `ReqToToken` for its table; a tensor on another device) and asserts the exception's type, a
fragment of its message, and that every pool buffer is as it was. On CPU positions without a
slot raise in `init_forward_metadata`; the GPU twin checks the deferred path
(`raise_pending`) and the device and dtype cases against CUDA pools."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

import swafactory
from swafactory.errors import SwaFactoryError
from swafactory.kvcache import ReqToToken, RequestSlots
from swafactory.kvcache.factory import build_pools
from swafactory.metadata import ForwardBatch, ReqForward

ALLOWED = (ValueError, TypeError, IndexError, KeyError, SwaFactoryError)


@dataclass
class Rig:
    """A tiny target (layers 0, 1 sliding: 4 KV heads × 16; 2, 3 full: 2 × 32; 8 q heads) with
    request "a" holding positions 0..9, request "f" finished and one row never opened."""

    device: str
    check_mode: bool = False
    cfg: object = field(init=False)

    def __post_init__(self) -> None:
        self.cfg = swafactory.validate(swafactory.compose(
            ["model=tiny", "backend=torch", "spec=none", f"workload.device={self.device}"]))
        self.pool, alloc = build_pools(self.cfg, 256, 128, self.device,
                                       check_mode=self.check_mode)
        self.book = RequestSlots(alloc, ReqToToken(4, 64, self.device))
        self.backend = swafactory.build_backend(self.cfg, pools=self.pool)
        self.row = self.book.open("a").row
        self.book.extend("a", 10)
        self.frow = self.book.open("f").row
        self.book.extend("f", 6)
        self.book.finish("f")
        self.free_row = next(r for r in range(4) if r not in (self.row, self.frow))
        g = torch.Generator(device=self.device).manual_seed(0)
        self.rand = lambda *s, dtype=torch.float32: torch.randn(
            *s, generator=g, device=self.device).to(dtype)

    def batch(self, reqs, mode="extend", table=None):
        t = self.book.req_to_token.table if table is None else table
        return ForwardBatch.of(mode, reqs, t, self.book.allocator.full_id)

    def snapshot(self) -> list[torch.Tensor]:
        return [b.clone() for sp in self.pool.sub_pools for b in (*sp.k_bufs, *sp.v_bufs)]

    def qkv(self, rows=10, layer=2, hq=8, dtype=torch.float32):
        hkv, d = (2, 32) if layer in (2, 3) else (4, 16)
        return (self.rand(rows, hq, d, dtype=dtype), self.rand(rows, hkv, d),
                self.rand(rows, hkv, d))


def _plan_then_forward(rig: Rig, reqs, mode="extend", rows=None, **over):
    """Plan ``reqs`` and run layer 2 with q, k, v as an engine would (``over`` replaces any)."""
    rig.backend.init_forward_metadata(rig.batch(reqs, mode))
    # CUDA defers the slot check to the engine's sync point: this engine reads back before it
    # launches, so nothing is written either (a no-op on CPU, which raised while planning)
    rig.backend.raise_pending()
    q, k, v = rig.qkv(rows if rows is not None else sum(r.q_len for r in reqs))
    args = {"q": q, "k": k, "v": v, "layer_id": 2, **over}
    return rig.backend.forward(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("layer_id"),
                               **args)


def _ok(rig):
    return [ReqForward("a", rig.row, 0, 10)]


def _with_sinks(rig):
    """``rig`` with a backend whose model has attention sinks (tiny with
    ``model.attention_sinks=true``, over the same pools): its layers take ``sinks=``, so what
    is checked is their kind, shape, dtype and device (tiny itself refuses any)."""
    m = rig.cfg.model.model_copy(update={"attention_sinks": True})
    rig.backend = swafactory.build_backend(rig.cfg.model_copy(update={"model": m}),
                                           pools=rig.pool)
    return rig


def _sinks(rig, sinks):
    return lambda: _plan_then_forward(_with_sinks(rig), _ok(rig), sinks=sinks)


def _q(rig, **kw):
    return lambda: _plan_then_forward(rig, _ok(rig), q=rig.qkv(**kw)[0])


CASES = {
    # name: (build the call from a rig, exception type, message fragment)
    "q_4_heads": (lambda r: _q(r, hq=4), ValueError, "q has 4 heads, expected 8"),
    "q_12_heads": (lambda r: _q(r, hq=12), ValueError, "q has 12 heads, expected 8"),
    "q_int64": (lambda r: lambda: _plan_then_forward(
        r, _ok(r), q=torch.ones(10, 8, 32, dtype=torch.int64, device=r.device)),
        TypeError, "accepted dtypes: float16, bfloat16, float32"),
    "q_rows_8_of_10": (lambda r: _q(r, rows=8), ValueError, "q has 8 rows, but the plan has 10"),
    "q_wrong_head_dim": (lambda r: lambda: _plan_then_forward(r, _ok(r), q=r.rand(10, 8, 16)),
                         ValueError, "q has head_dim 16, expected 32"),
    "q_not_3d": (lambda r: lambda: _plan_then_forward(r, _ok(r), q=r.rand(10, 8 * 32)),
                 ValueError, "q must be 3-D"),
    "kv_none_save_kv": (lambda r: lambda: _plan_then_forward(r, _ok(r), k=None, v=None),
                        ValueError, "pass k and v, or save_kv=False"),
    "k_wrong_heads": (lambda r: lambda: _plan_then_forward(r, _ok(r), k=r.rand(10, 4, 32)),
                      ValueError, "k/v must be [10, 2, 32]"),
    "v_wrong_shape": (lambda r: lambda: _plan_then_forward(r, _ok(r), v=r.rand(10, 2, 16)),
                      ValueError, "k/v must be [10, 2, 32]"),
    "sinks_wrong_length": (lambda r: _sinks(r, r.rand(4)), ValueError, "sinks must be [8]"),
    "layer_not_planned": (lambda r: lambda: _plan_then_forward(r, _ok(r), layer_id=99),
                          KeyError, "layer 99 is not in this plan"),
    "row_never_opened": (lambda r: lambda: _plan_then_forward(
        r, [ReqForward("x", r.free_row, 0, 4)]), ValueError, "reads position 0"),
    "row_finished": (lambda r: lambda: _plan_then_forward(
        r, [ReqForward("f", r.frow, 0, 6)]), ValueError, "request 'f' (row"),
    "nodes_15_of_10": (lambda r: lambda: _plan_then_forward(
        r, [ReqForward("a", r.row, 0, 15)]), ValueError, "reads position 10"),
    "decode_past_allocation": (lambda r: lambda: _plan_then_forward(
        r, [ReqForward("a", r.row, 10, 1)], mode="decode"), ValueError, "reads position 10"),
    "second_request_unallocated": (lambda r: lambda: _plan_then_forward(
        r, [*_ok(r), ReqForward("x", r.free_row, 0, 3)]), ValueError, "request 'x'"),
    "req_to_token_object_wrong_type": (lambda r: lambda: r.batch(_ok(r), table=[[0]]),
                                       TypeError, "ReqToToken.table"),
    "extend_negative": (lambda r: lambda: r.book.extend("a", -4), ValueError,
                        "request 'a': cannot extend by -4 positions"),
    # found beyond the reported table
    "forward_before_plan": (lambda r: lambda: r.backend.forward(*r.qkv(), 2), RuntimeError,
                            "call init_forward_metadata(batch)"),
    "sinks_int64": (lambda r: _sinks(r, torch.ones(8, dtype=torch.int64, device=r.device)),
                    TypeError, "sinks are int64"),
    "q_a_list": (lambda r: lambda: _plan_then_forward(r, _ok(r), q=[[0.0]]), TypeError,
                 "q must be a tensor [10, 8, 32], got list"),
    "sinks_a_list": (lambda r: _sinks(r, [0.0] * 8), TypeError, "sinks must be a tensor [8]"),
    "row_twice_in_batch": (lambda r: lambda: _plan_then_forward(
        r, [ReqForward("a", r.row, 0, 5), ReqForward("b", r.row, 5, 5)]), ValueError,
        "requests 'a' and 'b' both use req_to_token row"),
    "decode_two_queries": (lambda r: lambda: _plan_then_forward(
        r, [ReqForward("a", r.row, 8, 2)], mode="decode"), ValueError,
        "request 'a' has 2: use mode='extend'"),
    "table_of_floats": (lambda r: lambda: r.backend.init_forward_metadata(
        r.batch(_ok(r), table=r.book.req_to_token.table.float())), TypeError,
        "req_to_token must be a 2-D int32/int64 tensor"),
    "past_table_width": (lambda r: lambda: r.backend.init_forward_metadata(
        r.batch([ReqForward("a", r.row, 60, 10)])), IndexError,
        "reaches position 69, past req_to_token's 64 columns"),
}


def _run_case(rig: Rig, name: str) -> None:
    make, exc, fragment = CASES[name]
    before = rig.snapshot()
    with pytest.raises(exc) as info:
        make(rig)()
        rig.backend.raise_pending()  # CUDA: the deferred slot check reports here
    assert isinstance(info.value, ALLOWED) and not isinstance(info.value, AttributeError)
    assert fragment in str(info.value), str(info.value)
    for a, b in zip(before, rig.snapshot()):
        assert torch.equal(a.nan_to_num(), b.nan_to_num()), f"{name}: a pool buffer was written"


@pytest.mark.parametrize("check_mode", [False, True])
@pytest.mark.parametrize("name", sorted(CASES))
def test_misuse_raises_in_the_callers_terms(name: str, check_mode: bool) -> None:
    _run_case(Rig("cpu", check_mode), name)


def test_slot_error_names_request_row_and_position() -> None:
    rig = Rig("cpu")
    with pytest.raises(ValueError) as info:
        _plan_then_forward(rig, [*_ok(rig), ReqForward("x", rig.free_row, 0, 3)])
    msg = str(info.value)
    assert f"request 'x' (row {rig.free_row}) reads position 0" in msg and "extend" in msg


def test_req_to_token_object_is_its_table() -> None:
    rig = Rig("cpu")
    b = rig.batch(_ok(rig), table=rig.book.req_to_token)
    assert b.req_to_token is rig.book.req_to_token.table
    rig.backend.init_forward_metadata(b)
    q, k, v = rig.qkv()
    assert torch.isfinite(rig.backend.forward(q, k, v, 2)).all()


def test_strided_q_k_v_give_the_dense_result() -> None:
    """q, k, v split from one fused qkv projection (rows strided) are what an engine passes:
    they are read as the dense tensors they stand for."""
    out = []
    for strided in (False, True):
        rig = Rig("cpu")
        q, k, v = rig.qkv()
        if strided:
            qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], 1)
            q, k, v = (x.view(10, -1, 32) for x in qkv.split([8 * 32, 2 * 32, 2 * 32], 1))
            assert not q.is_contiguous()
        out.append(_plan_then_forward(rig, _ok(rig), q=q, k=k, v=v))
    torch.testing.assert_close(out[0], out[1])


def test_device_mismatch_names_both_devices() -> None:
    """q, k or v on another device than the pool (meta tensors stand in for a GPU's)."""
    for arg in ("q", "k", "v"):
        rig = Rig("cpu")
        before = rig.snapshot()
        q, k, v = rig.qkv()
        over = {"q": q, "k": k, "v": v}
        over[arg] = over[arg].to("meta")
        with pytest.raises(ValueError, match=f"{arg} is on meta, the layer's pool on cpu"):
            _plan_then_forward(rig, _ok(rig), **over)
        assert all(torch.equal(a, b) for a, b in zip(before, rig.snapshot()))


def test_guards_off_skip_every_check() -> None:
    """guards=False is the bare kernels: a wrong head count is not looked at (it runs)."""
    rig = Rig("cpu")
    rig.backend = swafactory.build_backend(rig.cfg, pools=rig.pool, guards=False)
    rig.backend.init_forward_metadata(rig.batch([ReqForward("a", rig.row, 0, 15)]))
    assert not rig.backend._pending
    q, k, v = rig.qkv(15)
    assert rig.backend.forward(q, k, v, 2).shape == (15, 8, 32)


# --- the GPU twin: deferred slot checks, devices and dtypes against CUDA pools ------------------

GPU_CASES = sorted(CASES)


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_CASES)
def test_misuse_raises_on_cuda(name: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _run_case(Rig("cuda"), name)


@pytest.mark.gpu
@pytest.mark.parametrize("arg", ["q", "k", "v", "sinks"])
def test_host_tensor_for_cuda_pool(arg: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    rig = _with_sinks(Rig("cuda")) if arg == "sinks" else Rig("cuda")
    before = rig.snapshot()
    q, k, v = rig.qkv()
    over = {"q": q, "k": k, "v": v, **({"sinks": torch.zeros(8)} if arg == "sinks" else {})}
    over[arg] = over[arg].cpu()
    with pytest.raises(ValueError, match=f"{arg} (is|are) on cpu, the layer's pool on cuda"):
        _plan_then_forward(rig, _ok(rig), **over)
    assert all(torch.equal(a, b) for a, b in zip(before, rig.snapshot()))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float64])
def test_q_dtype_on_cuda(dtype: torch.dtype) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    rig = Rig("cuda")
    with pytest.raises(TypeError, match="accepted dtypes"):
        _plan_then_forward(rig, _ok(rig), q=torch.ones(10, 8, 32, device="cuda").to(dtype))


@pytest.mark.gpu
def test_slot_check_is_deferred_on_cuda() -> None:
    """Planning raises nothing and reads nothing back; `raise_pending` reports the position."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    rig = Rig("cuda")
    batch = rig.batch([ReqForward("a", rig.row, 0, 15)])
    rig.backend.init_forward_metadata(batch)  # warm-up
    rig.backend._pending.clear()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rig.backend.init_forward_metadata(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with pytest.raises(ValueError, match="request 'a' .* reads position 10"):
        rig.backend.raise_pending()
    rig.backend.raise_pending()  # drained: nothing left
    rig.backend.init_forward_metadata(rig.batch(_ok(rig)))
    rig.backend.raise_pending()  # a clean forward raises nothing


def test_slot_check_without_a_full_space_list() -> None:
    """A runner whose layers are all SWA has no full-space list: the check gathers each row's
    ``[0, end)`` from the table itself, and names the same position."""
    from swafactory.guards import slot_check

    rig = Rig("cpu")
    batch = rig.batch([*_ok(rig), ReqForward("a2", rig.row, 0, 12)])
    err = slot_check(batch, None, None, None, None).error()
    assert err is not None and "request 'a2' (row 0) reads position 10" in str(err)
    assert slot_check(rig.batch(_ok(rig)), None, None, None, None).error() is None
