"""swiglu: reference semantics, the ATen path (what stock blocks run), validation and the stock ATen backward."""

import pytest
import torch
import torch.nn.functional as F

import fly_lightning as fl
from fly_lightning.ops.swiglu import _swiglu_aten, swiglu_reference


def test_reference_rounds_once_and_aten_is_the_stock_formula():
    hid = torch.randn(40, 2 * 24, dtype=torch.bfloat16)
    g, u = hid[:, :24], hid[:, 24:]
    assert torch.equal(swiglu_reference(hid, None), (F.silu(g.float()) * u.float()).bfloat16())
    assert torch.equal(_swiglu_aten(hid, None), F.silu(g) * u)
    assert torch.equal(swiglu_reference(g, u), swiglu_reference(hid, None))


@pytest.mark.parametrize("fused", [True, False])
def test_backward_equals_stock_autograd(fused):
    hid = torch.randn(30, 2 * 16, dtype=torch.bfloat16)
    grad = torch.randn(30, 16, dtype=torch.bfloat16)
    ref_in = hid.clone().requires_grad_()
    (F.silu(ref_in[:, :16]) * ref_in[:, 16:]).backward(grad)
    x = hid.clone().requires_grad_()
    if fused:
        y = fl.swiglu(x)
    else:
        g, u = x[:, :16], x[:, 16:]
        y = fl.swiglu(g, u)
    assert y.is_contiguous() and y.shape == (30, 16)
    y.backward(grad)
    assert torch.equal(x.grad, ref_in.grad)


def test_gradcheck_fp64():
    g = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    u = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(fl.swiglu, (g, u))
    hid = torch.randn(6, 10, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(fl.swiglu, (hid,))


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.randn(4, 5),), "even last dim"),
        ((torch.randn(4, 5), torch.randn(4, 6)), "must match"),
        ((torch.randn(4, 5), torch.randn(4, 5).half()), "must match"),
        ((torch.randn(4),), "2-D"),
        ((torch.ones(4, 6, dtype=torch.int32),), "floating"),
    ],
)
def test_invalid_arguments_raise(args, match):
    with pytest.raises(ValueError, match=match):
        fl.swiglu(*args)


def test_results_are_contiguous_whatever_the_input_layout():
    # the fake promises contiguous results: every path must give them (column-major inputs run on ATen)
    from fly_lightning.ops.swiglu import swiglu_backward_op, swiglu_op

    a, b = torch.randn(6, 4).t(), torch.randn(6, 4).t()
    y = fl.swiglu(a, b)
    assert y.is_contiguous()
    torch.testing.assert_close(y, swiglu_reference(a, b))
    torch.library.opcheck(swiglu_op, (a, b))
    torch.library.opcheck(swiglu_op, (torch.randn(5, 8), None))
    torch.library.opcheck(swiglu_backward_op, (torch.randn(4, 6), a, b))
    torch.library.opcheck(swiglu_backward_op, (torch.randn(5, 4), torch.randn(5, 8), None))


def test_compiles_fullgraph():
    hid = torch.randn(8, 12)
    fn = torch.compile(fl.swiglu, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(fn(hid), swiglu_reference(hid, None))


@pytest.mark.parametrize("activation, approximate", [("gelu", "none"), ("gelu_tanh", "tanh")])
@pytest.mark.parametrize("fused", [True, False])
def test_geglu_forward_and_backward_equal_stock(activation, approximate, fused):
    hid = torch.randn(30, 2 * 16) * 3
    grad = torch.randn(30, 16)
    ref_in = hid.clone().requires_grad_()
    want = F.gelu(ref_in[:, :16], approximate=approximate) * ref_in[:, 16:]
    want.backward(grad)
    assert torch.equal(_swiglu_aten(hid, None, activation), want.detach())
    x = hid.clone().requires_grad_()
    y = fl.swiglu(x, None, activation) if fused else fl.swiglu(x[:, :16], x[:, 16:], activation)
    torch.testing.assert_close(y, want.detach(), rtol=1e-5, atol=1e-5)  # the Triton interpreter: its own erf
    y.backward(grad)
    assert torch.equal(x.grad, ref_in.grad)  # stock's ATen backward: bit-equal


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_geglu_gradcheck_double_backward_and_opcheck(activation):
    from fly_lightning.ops.swiglu import swiglu_backward_op, swiglu_op

    g = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    u = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    fn = lambda a, b: fl.swiglu(a, b, activation)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (g, u))
    assert torch.autograd.gradgradcheck(fn, (g, u))
    torch.library.opcheck(swiglu_op, (torch.randn(5, 8), None, activation))
    torch.library.opcheck(swiglu_backward_op, (torch.randn(5, 4), torch.randn(5, 8), None, activation))
    compiled = torch.compile(lambda h: fl.swiglu(h, None, activation), fullgraph=True, backend="aot_eager")
    hid = torch.randn(8, 12)
    torch.testing.assert_close(compiled(hid), swiglu_reference(hid, None, activation))


def test_unknown_activation_raises():
    with pytest.raises(ValueError, match="activation must be one of"):
        fl.swiglu(torch.randn(4, 6), None, "relu")
