"""rms_norm: numerics against an fp64 reference, gradients against ATen, fallbacks, errors, compile, determinism."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import fly_lightning
from fly_lightning import DISPATCH_LOG, dispatch_config
from fly_lightning.ops.rms_norm import rms_norm, rms_norm_op, rms_norm_reference

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _ref64(x, w, eps, offset=0.0, cast_before_scale=False):
    """fp64 oracle; for the Llama cast, the cast happens in x's dtype as the model does."""
    if cast_before_scale and w is not None:
        xhat = rms_norm_reference(x.double(), None, eps)[0].to(x.dtype).double()
        return xhat * (w + offset).double()
    return rms_norm_reference(x.double(), None if w is None else w.double() + offset, eps)[0]


def _rel_err(y, ref):
    return ((y.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _last(op="rms_norm"):
    recs = DISPATCH_LOG.records(op)
    assert recs, "no dispatch recorded"
    return recs[-1]


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(0, 9),
    h=st.sampled_from([1, 3, 8, 31, 64, 100, 257, 1000, 4096, 4097, 8200]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    has_w=st.booleans(),
    variant=st.sampled_from(["torch", "gemma", "llama"]),
    scale=st.sampled_from([1e-3, 1.0, 300.0]),
)
def test_matches_fp64_reference(rows, h, dtype, has_w, variant, scale):
    x = (torch.randn(rows, h) * scale).to(dtype)
    w = torch.randn(h).to(dtype) if has_w else None
    offset = 1.0 if variant == "gemma" else 0.0
    cast = variant == "llama"
    y = rms_norm(x, w, 1e-6, offset=offset, cast_before_scale=cast)
    assert y.shape == x.shape
    assert y.dtype == (torch.promote_types(x.dtype, w.dtype) if cast and has_w else x.dtype)
    assert _last()["backend"] == "triton"
    if rows:
        ref = _ref64(x, w, 1e-6, offset, cast)
        assert torch.isfinite(y).all()
        assert _rel_err(y, ref) < TOL[dtype]


def test_leading_dims_and_large_values():
    x = torch.randn(2, 3, 5, 1536, dtype=torch.bfloat16) * 3e4  # squares overflow bf16/fp16 ranges: fp32 accumulation
    w = torch.randn(1536, dtype=torch.bfloat16)
    y = rms_norm(x, w, 1e-5)
    assert _rel_err(y, _ref64(x, w, 1e-5)) < 1e-2
    xh = (torch.randn(4, 512).clamp(-2, 2) * 3e4).half()  # finite inputs whose squares overflow fp16
    assert torch.isfinite(rms_norm(xh, None, 1e-5)).all()


def test_wide_rows_take_the_chunked_path():
    x = torch.randn(2, 40000)
    w = torch.randn(40000)
    y = rms_norm(x, w, 1e-6)
    assert _last()["backend"] == "triton"
    assert _rel_err(y, _ref64(x, w, 1e-6)) < 1e-5


def test_eps_none_uses_dtype_eps_like_torch():
    x = torch.randn(4, 64) * 1e-4
    torch.testing.assert_close(rms_norm(x), F.rms_norm(x, (64,)), rtol=1e-5, atol=1e-6)


def test_non_contiguous_rows_are_handled_in_place():
    base = torch.randn(6, 160)
    x = base[:, :100]  # row stride 160, last dim contiguous
    w = torch.randn(100)
    y = rms_norm(x, w, 1e-6)
    assert _last()["backend"] == "triton"
    assert _rel_err(y, _ref64(x, w, 1e-6)) < 1e-5


def test_non_contiguous_last_dim_falls_back_with_reason():
    x = torch.randn(64, 6).t()  # [6, 64], last-dim stride 6
    w = torch.randn(64)
    y = rms_norm(x, w, 1e-6)
    rec = _last()
    assert rec["backend"] == "aten" and rec["fallback"]
    assert "last dim not contiguous" in rec["reason"]
    assert _rel_err(y, _ref64(x, w, 1e-6)) < 1e-5


def test_fp64_falls_back_with_reason():
    x = torch.randn(3, 8, dtype=torch.float64)
    y = rms_norm(x, None, 1e-6)
    rec = _last()
    assert rec["backend"] == "aten" and "dtype torch.float64" in rec["reason"]
    torch.testing.assert_close(y, F.rms_norm(x, (8,), eps=1e-6))


def test_disabled_op_runs_aten_with_reason():
    x = torch.randn(3, 8)
    with dispatch_config(disabled_ops={"rms_norm"}):
        rms_norm(x, None, 1e-6)
    rec = _last()
    assert rec["backend"] == "aten" and "op disabled by policy" in rec["reason"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(x=torch.randn(4, 8), weight=torch.randn(7)), "weight must have shape"),
        (dict(x=torch.randn(4, 8), eps=-1.0), "eps must be finite"),
        (dict(x=torch.randn(4, 8), eps=float("nan")), "eps must be finite"),
        (dict(x=torch.tensor(3.0)), "at least one dimension"),
        (dict(x=torch.ones(4, 8, dtype=torch.int32)), "floating"),
        (dict(x=torch.randn(4, 8), weight=torch.randn(2, 4)), "weight must have shape"),
        (dict(x=torch.randn(4, 8), offset=float("inf")), "offset must be finite"),
        (dict(x=torch.randn(4, 8), weight=[1.0] * 8), "weight must be a Tensor"),
    ],
)
def test_invalid_arguments_raise_before_dispatch(kwargs, match):
    x = kwargs.pop("x")
    with pytest.raises(ValueError, match=match):
        rms_norm(x, **kwargs)
    assert DISPATCH_LOG.records() == []


@pytest.mark.parametrize("variant", ["torch", "gemma", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_match_aten(variant, dtype):
    offset, cast = (1.0 if variant == "gemma" else 0.0), variant == "llama"
    x0 = torch.randn(5, 3, 72).to(dtype)
    w0 = torch.randn(72).to(dtype)
    g = torch.randn(5, 3, 72).to(dtype)

    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    rms_norm(x, w, 1e-6, offset=offset, cast_before_scale=cast).backward(g)

    xr, wr = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    if variant == "torch":
        yr = F.rms_norm(xr, (72,), wr, 1e-6)
    else:
        yr = rms_norm_reference(xr, wr, 1e-6, offset, cast)[0]  # the HF formulas, through autograd
    yr.backward(g)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(x.grad, xr.grad, **tol)
    torch.testing.assert_close(w.grad, wr.grad, **tol)


def test_gradcheck_fp64_through_custom_op():
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, b, 1e-6), (x, w))
    assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, b, 1e-6, offset=1.0), (x, w))


def test_opcheck():
    x, w = torch.randn(4, 40, requires_grad=True), torch.randn(40, requires_grad=True)
    torch.library.opcheck(rms_norm_op, (x, w, 1e-6, 0.0, False))


@pytest.mark.parametrize("left_to_inductor", [False, True])
def test_torch_compile_fullgraph_forward_and_backward(left_to_inductor):
    torch._dynamo.reset()
    fn = torch.compile(lambda x, w: rms_norm(x, w, 1e-6).sum(), fullgraph=True, backend="aot_eager")
    x = torch.randn(8, 96, requires_grad=True)
    w = torch.randn(96, requires_grad=True)
    with dispatch_config(inductor_ops={"rms_norm"} if left_to_inductor else ()):
        fn(x, w).backward()
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    F.rms_norm(xr, (96,), wr, 1e-6).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w.grad, wr.grad, rtol=1e-4, atol=1e-5)
    assert _last()["backend"] == ("inductor" if left_to_inductor else "triton")


def test_torch_compile_inductor_fullgraph():
    torch._dynamo.reset()
    fn = torch.compile(lambda x, w: rms_norm(x, w, 1e-6) * 2, fullgraph=True)
    x, w = torch.randn(4, 64), torch.randn(64)
    torch.testing.assert_close(fn(x, w), 2 * F.rms_norm(x, (64,), w, 1e-6), rtol=1e-5, atol=1e-5)


def test_compile_validates_at_trace_time():
    torch._dynamo.reset()
    fn = torch.compile(lambda x, w: rms_norm(x, w, 1e-6), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="weight must have shape"):
        fn(torch.randn(4, 8), torch.randn(5))


def test_deterministic_algorithms_same_result_and_all_outputs_written():
    x, w = torch.randn(7, 4097, dtype=torch.bfloat16), torch.randn(4097, dtype=torch.bfloat16)
    y0 = rms_norm(x, w, 1e-6)
    torch.use_deterministic_algorithms(True)  # outputs are poisoned (NaN, tests/conftest.py): unwritten ones would show
    try:
        fly_lightning.DISPATCH_LOG.reset()
        y1 = rms_norm(x, w, 1e-6)
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.isfinite(y1).all()
    assert torch.equal(y0, y1)


def test_the_all_outputs_written_check_catches_a_kernel_that_skips_a_row(monkeypatch):
    """The check above, run against a Triton RMSNorm whose launch skips the last row: that row keeps its poison
    (``fly_lightning.kernels.outputs``, on for the test session), and the check fails."""
    import fly_lightning.kernels.triton.rms_norm as triton_rms_norm

    real_launch, launched = triton_rms_norm._launch, []

    def skip_the_last_row(plan, x2, w, y, rstd, n_rows, eps, offset):
        launched.append((n_rows, plan.cfg.kernel))
        real_launch(plan, x2, w, y, rstd, n_rows - 1, eps, offset)

    monkeypatch.setattr(triton_rms_norm, "_launch", skip_the_last_row)
    with pytest.raises(AssertionError, match="isfinite"):
        test_deterministic_algorithms_same_result_and_all_outputs_written()
    assert _last()["backend"] == "triton" and launched == [(7, "unaligned")] * 2  # the broken kernel ran, twice
    x, w = torch.randn(7, 4097, dtype=torch.bfloat16), torch.randn(4097, dtype=torch.bfloat16)
    y = rms_norm(x, w, 1e-6)
    assert y[-1].isnan().all() and y[:-1].isfinite().all()  # exactly the skipped row shows


def test_a_valid_call_does_not_let_a_later_invalid_one_through():
    """Validation runs once per signature, so the signature holds everything it checks (eps, the weight's shape)."""
    x, w = torch.randn(4, 32), torch.randn(32)
    rms_norm(x, w, 1e-6)
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, w, -1.0)
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm(x, torch.randn(64)[:31], 1e-6)


def test_strided_weight_falls_back_with_reason():
    x, w_wide = torch.randn(4, 32), torch.randn(64)
    rms_norm(x, w_wide[:32], 1e-6)  # contiguous first: the strided call must not reuse its decision
    w = w_wide[::2]
    y = rms_norm(x, w, 1e-6)
    rec = _last()
    assert rec["backend"] == "aten" and "weight not contiguous" in rec["reason"]
    assert _rel_err(y, _ref64(x, w, 1e-6)) < 1e-5


def test_llama_cast_with_an_offset_differentiates_the_forward_it_runs():
    # the forward adds the offset in the weight's dtype (rounded); the backward must use that weight too
    torch.manual_seed(0)
    x = torch.randn(4, 64, requires_grad=True)
    w = torch.randn(64).bfloat16()
    y = rms_norm(x, w, 1e-6, offset=1.0, cast_before_scale=True)
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, g)
    (want,) = torch.autograd.grad(rms_norm_reference(x, w, 1e-6, 1.0, True)[0], x, g)
    torch.testing.assert_close(gx, want, rtol=1e-5, atol=1e-6)
