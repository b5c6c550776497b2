"""grouped_mm: numerics against an fp64 reference, torch's semantics, gradients equal to ATen's, errors, compile."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fly_lightning import DISPATCH_LOG, dispatch_config
from fly_lightning.ops.grouped_mm import aten_reason, grouped_mm, grouped_mm_reference

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _weights(e, k, n, dtype, k_major, gen=None):
    if k_major:  # the transposed view of a contiguous [E, N, K] (nn.Linear-style expert weights)
        return torch.randn(e, n, k, generator=gen).to(dtype).transpose(1, 2)
    return torch.randn(e, k, n, generator=gen).to(dtype)


def _offs(counts):
    return torch.cumsum(torch.as_tensor(counts), 0).to(torch.int32)


def _rel_err(y, ref):
    return ((y.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _last(op="grouped_mm"):
    recs = DISPATCH_LOG.records(op)
    assert recs, "no dispatch recorded"
    return recs[-1]


@settings(max_examples=20, deadline=None)
@given(
    counts=st.lists(st.sampled_from([0, 0, 1, 5, 16, 17, 33]), min_size=1, max_size=6),
    tail=st.integers(0, 3),
    k=st.sampled_from([8, 13, 32, 40, 64]),
    n=st.sampled_from([8, 24, 33, 64]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    k_major=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_matches_fp64_reference(counts, tail, k, n, dtype, k_major, seed):
    gen = torch.Generator().manual_seed(seed)
    offs = _offs(counts)
    m = int(offs[-1]) + tail  # rows past the last offset belong to no group
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = _weights(len(counts), k, n, dtype, k_major, gen)
    y = grouped_mm(x, w, offs)
    assert y.shape == (m, n) and y.dtype == dtype and y.is_contiguous()
    assert _last()["backend"] == "triton"
    end = int(offs[-1])
    if end:
        ref = grouped_mm_reference(x.double(), w.double(), offs)[:end]
        assert torch.isfinite(y[:end]).all()
        assert _rel_err(y[:end], ref) < TOL[dtype]


@pytest.mark.parametrize("k_major", [False, True])
def test_one_expert_takes_every_row_and_empty_groups(k_major):
    x = torch.randn(50, 24).half()
    w = _weights(5, 24, 40, torch.float16, k_major)
    offs = _offs([0, 0, 50, 0, 0])
    y = grouped_mm(x, w, offs)
    torch.testing.assert_close(y.float(), (x.float() @ w[2].float()), rtol=2e-3, atol=2e-3)


def test_rows_past_the_last_offset_are_left_unwritten_like_torch():
    torch.use_deterministic_algorithms(True)  # torch.empty is NaN-filled on CPU: unwritten rows stay NaN
    try:
        x = torch.randn(40, 16).half()
        w = _weights(3, 16, 8, torch.float16, False)
        offs = _offs([8, 0, 16])
        ours = grouped_mm(x, w, offs)
        assert _last()["backend"] == "triton"
        theirs = torch._grouped_mm(x, w, offs=offs)
        ref = grouped_mm_reference(x, w, offs)
        for y in (ours, theirs, ref):
            assert y[24:].isnan().all() and not y[:24].isnan().any()
    finally:
        torch.use_deterministic_algorithms(False)


def test_float32_output_and_float32_inputs():
    x = torch.randn(30, 32).bfloat16()
    w = _weights(2, 32, 16, torch.bfloat16, True)
    offs = _offs([10, 20])
    y = grouped_mm(x, w, offs, out_dtype=torch.float32)
    assert y.dtype == torch.float32 and _last()["backend"] == "triton"
    assert _rel_err(y, grouped_mm_reference(x.double(), w.double(), offs)) < 1e-5  # no bf16 rounding of the output
    xf, wf = x.float(), w.float()
    yf = grouped_mm(xf, wf, offs)
    rec = _last()
    assert rec["backend"] == "aten" and "dtype torch.float32" in rec["reason"]
    torch.testing.assert_close(yf, torch._grouped_mm(xf, wf, offs=offs))


def test_autocast_casts_fp32_operands_like_mm():
    # bf16-mixed training keeps fp32 parameters: without the cast every call would fall back on dtype
    torch.manual_seed(2)
    offs = _offs([9, 0, 15])
    x = torch.randn(24, 32, requires_grad=True)
    w = _weights(3, 32, 16, torch.float32, True).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = grouped_mm(x, w, offs)
    rec = _last()
    assert y.dtype == torch.bfloat16 and rec["dtype"] == "bfloat16" and rec["backend"] == "triton", rec
    want = grouped_mm_reference(x.detach().bfloat16().double(), w.detach().bfloat16().double(), offs)
    assert _rel_err(y, want) < TOL[torch.bfloat16]
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32  # reaches the fp32 leaves
    assert (w.grad[1] == 0).all() and w.grad.abs().sum() > 0
    y32 = grouped_mm(x.detach(), w.detach(), offs)  # autocast off again: fp32 in, fp32 out
    assert y32.dtype == torch.float32


@pytest.mark.parametrize("k_major", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gradients_equal_atens(k_major, dtype):
    torch.manual_seed(1)
    offs = _offs([7, 0, 20, 5])
    x = torch.randn(34, 24).to(dtype).requires_grad_()
    w = _weights(4, 24, 16, dtype, k_major).requires_grad_()
    g = torch.randn(34, 16).to(dtype)
    end = int(offs[-1])
    (grouped_mm(x, w, offs)[:end] * g[:end]).sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    (torch._grouped_mm(x2, w2, offs=offs)[:end] * g[:end]).sum().backward()
    torch.testing.assert_close(x.grad[:end], x2.grad[:end], rtol=0, atol=0)
    torch.testing.assert_close(w.grad, w2.grad, rtol=0, atol=0)
    assert w.grad.stride() == w.stride()  # the weight gradient keeps the weight's layout
    assert (w.grad[1] == 0).all()  # an empty group gets a zero gradient
    # and both agree with the fp64 reference
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    (grouped_mm_reference(xd, wd, offs)[:end] * g[:end].double()).sum().backward()
    assert _rel_err(w.grad, wd.grad) < TOL[dtype]
    assert _rel_err(x.grad[:end], xd.grad[:end]) < TOL[dtype]


def test_backward_does_not_run_the_kernel(monkeypatch):
    from fly_lightning.kernels.triton import _grouped_mm_kernel as gk

    launches = []
    launch = gk._launch
    monkeypatch.setattr(gk, "_launch", lambda *a, **k: (launches.append(1), launch(*a, **k))[1])
    x = torch.randn(20, 16).half().requires_grad_()
    w = _weights(2, 16, 16, torch.float16, False).requires_grad_()
    y = grouped_mm(x, w, _offs([9, 11]))
    assert len(launches) == 1
    y.float().sum().backward()
    assert len(launches) == 1 and x.grad is not None and w.grad is not None  # dX and dW ran on ATen
    (rec,) = DISPATCH_LOG.records("grouped_mm")
    assert rec["calls"] == 1 and rec["backend"] == "triton"


def test_strided_gradient_is_accepted():
    x = torch.randn(20, 16).half().requires_grad_()
    w = _weights(2, 16, 16, torch.float16, False).requires_grad_()
    offs = _offs([9, 11])
    grouped_mm(x, w, offs).sum().backward()  # an expanded (stride-0) gradient
    expected = grouped_mm_reference(torch.ones(20, 16).half(), w.detach().transpose(1, 2), offs)
    torch.testing.assert_close(x.grad, expected, rtol=2e-3, atol=2e-3)


def test_torch_compile_fullgraph_forward_and_backward():
    x = torch.randn(33, 16).half().requires_grad_()
    w = _weights(3, 16, 24, torch.float16, True).requires_grad_()
    offs = _offs([10, 0, 23])

    def f(x, w, offs):
        return (grouped_mm(x, w, offs).float() ** 2).sum()

    eager = f(x, w, offs)
    gx, gw = torch.autograd.grad(eager, (x, w))
    compiled = torch.compile(f, fullgraph=True)(x, w, offs)
    cx, cw = torch.autograd.grad(compiled, (x, w))
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(cx, gx)
    torch.testing.assert_close(cw, gw)


def test_disabled_policy_and_aten_backend_match():
    x = torch.randn(30, 16).half()
    w = _weights(3, 16, 8, torch.float16, False)
    offs = _offs([10, 10, 10])
    with dispatch_config(disabled_ops={"grouped_mm"}):
        y = grouped_mm(x, w, offs)
    assert _last()["backend"] == "aten"
    torch.testing.assert_close(y, torch._grouped_mm(x, w, offs=offs))


def test_aten_path_falls_back_to_the_reference_where_torch_refuses_the_layout():
    x = torch.randn(12, 16).half()
    w = _weights(2, 16, 7, torch.float16, False)  # N=7: row stride not a multiple of 16 bytes
    offs = _offs([5, 7])
    assert "not a multiple of 16 bytes" in aten_reason(x, w, offs)
    assert aten_reason(x, _weights(2, 16, 8, torch.float16, False), offs) is None
    with dispatch_config(backends=("aten",)):
        y = grouped_mm(x, w, offs)
    torch.testing.assert_close(y, grouped_mm_reference(x, w, offs))


def test_fallback_reasons_for_layouts_the_kernel_does_not_take():
    offs = _offs([4, 4])
    w = _weights(2, 16, 8, torch.float16, False)
    xt = torch.randn(16, 8).half().t()  # column-major activations
    grouped_mm(xt, w, offs)
    rec = _last()
    assert rec["backend"] == "aten" and "x rows not contiguous" in rec["reason"]
    w_odd = torch.randn(2, 32, 16).half()[:, ::2, ::2]  # neither K nor N contiguous
    grouped_mm(torch.randn(8, 16).half(), w_odd, offs)
    rec = _last()
    assert rec["backend"] == "aten" and "neither N nor K contiguous" in rec["reason"]
    w_n1 = torch.randn(2, 1, 32).half().transpose(1, 2)[:, ::2]  # N == 1, strides (32, 2, 32): still neither
    x = torch.randn(8, 16).half()
    y = grouped_mm(x, w_n1, offs)
    rec = _last()
    assert rec["backend"] == "aten" and "neither N nor K contiguous" in rec["reason"]
    assert _rel_err(y, grouped_mm_reference(x.double(), w_n1.double(), offs)) < 2e-3


def _bad(msg, *args, **kw):
    with pytest.raises(ValueError, match=msg):
        grouped_mm(*args, **kw)


def test_invalid_inputs_raise_before_anything_runs():
    x, w, offs = torch.randn(10, 8).half(), _weights(2, 8, 8, torch.float16, False), _offs([4, 6])
    _bad("x must be 2-D", x[None], w, offs)
    _bad("w must be 3-D", x, w[0], offs)
    _bad("contraction dims differ", x, _weights(2, 6, 8, torch.float16, False), offs)
    _bad("w dtype", x, w.float(), offs)
    _bad("bfloat16, float16 or float32", x.double(), w.double(), offs)
    _bad("offs must be int32", x, w, offs.long())
    _bad("length E=2", x, w, _offs([4, 3, 3]))
    _bad("non-decreasing", x, w, torch.tensor([6, 4], dtype=torch.int32))
    _bad("non-negative", x, w, torch.tensor([-1, 10], dtype=torch.int32))
    _bad("exceeds the number of rows", x, w, _offs([4, 7]))
    _bad("out_dtype", x, w, offs, out_dtype=torch.float64)
    _bad("must match", x, w, offs.to("meta"))
    _bad("at least one group", x, w[:0], offs[:0])
    _bad("offs must be a Tensor", x, w, [4, 10])
    assert not DISPATCH_LOG.records("grouped_mm")  # nothing was dispatched


def test_a_valid_call_does_not_let_a_later_invalid_one_through():
    """Validation runs once per signature, so the signature holds every operand's dtype, shape and device."""
    x, w, offs = torch.randn(10, 8).half(), _weights(2, 8, 8, torch.float16, False), _offs([4, 6])
    grouped_mm(x, w, offs)
    _bad("w dtype", x, w.float(), offs)
    _bad("offs must be int32", x, w, offs.long())
    _bad("non-decreasing", x, w, torch.tensor([6, 4], dtype=torch.int32))


def test_strided_offsets_fall_back_with_reason():
    x, w = torch.randn(10, 8).half(), _weights(2, 8, 8, torch.float16, False)
    grouped_mm(x, w, _offs([4, 6]))  # contiguous first: the strided call must not reuse its decision
    offs = torch.tensor([4, 0, 10, 0], dtype=torch.int32)[::2]
    y = grouped_mm(x, w, offs)
    rec = _last()
    assert rec["backend"] == "aten" and "offs not contiguous" in rec["reason"]
    assert _rel_err(y, grouped_mm_reference(x.double(), w.double(), offs)) < 2e-3


def test_offset_values_are_checked_on_every_call_also_through_the_custom_op():
    """Values are not part of the dispatch signature: the op itself checks CPU offsets on each call (compiled graphs
    call it directly, past the eager wrapper)."""
    x, w = torch.randn(10, 8).half(), _weights(2, 8, 8, torch.float16, False)
    torch.ops.fly.grouped_mm(x, w, _offs([4, 6]), None)
    for bad, msg in (([6, 4], "non-decreasing"), ([4, 99], "exceeds the number of rows"), ([-3, 10], "non-negative")):
        with pytest.raises(ValueError, match=msg):
            torch.ops.fly.grouped_mm(x, w, torch.tensor(bad, dtype=torch.int32), None)


def test_autocast_casts_a_half_operand_beside_fp32_weights_like_mm():
    x, w = torch.randn(10, 8).half(), torch.randn(2, 8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (x @ w[0]).dtype == torch.bfloat16  # what mm does
        y = grouped_mm(x, w, _offs([4, 6]))
    assert y.dtype == torch.bfloat16 and _last()["backend"] == "triton"


def test_autocast_leaves_float64_alone_like_mm():
    # autocast casts fp32 and 16-bit operands only: fp64 ones are refused as without autocast, not run in bf16
    x, w = torch.randn(10, 8, dtype=torch.float64), torch.randn(2, 8, 8, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (x @ w[0]).dtype == torch.float64
        with pytest.raises(ValueError, match="got torch.float64"):
            grouped_mm(x, w, _offs([4, 6]))
