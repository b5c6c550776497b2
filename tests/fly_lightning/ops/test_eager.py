"""``eager_call``: the path each call takes (custom op, autograd.Function, dispatcher), and that the Function path
gives the custom op's outputs and gradients."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fly_lightning
from fly_lightning.ops.moe_route import moe_route_op
from fly_lightning.ops.rms_norm import rms_norm_op


def _rms(x, w):
    return fly_lightning.rms_norm(x, w, 1e-6)


def _rms_op(x, w):
    return rms_norm_op(x, w, 1e-6, 0.0, False)[0]


def _route(x, bias=None):
    return fly_lightning.moe_route(x, 3, bias_E=bias).weights_TK


def _route_op(x, bias=None):
    return moe_route_op(x, 3, "softmax", True, bias, 1.0, None, None, False)[0]


def _inputs(op: str, grads: tuple[bool, bool]):
    g = torch.Generator().manual_seed(1)
    if op == "rms_norm":
        x, w = torch.randn(6, 32, generator=g), torch.randn(32, generator=g)
    else:
        x, w = torch.randn(20, 12, generator=g), torch.randn(12, generator=g) * 0.1
    return x.requires_grad_(grads[0]), w.requires_grad_(grads[1])


CASES = {"rms_norm": (_rms, _rms_op), "moe_route": (_route, _route_op)}


# (x, w) requiring grad; moe_route's second tensor is the selection bias, which takes no gradient
GRADS = [
    ("rms_norm", (True, True)),
    ("rms_norm", (True, False)),
    ("rms_norm", (False, True)),
    ("moe_route", (True, False)),
]


@pytest.mark.parametrize(("op", "grads"), GRADS)
def test_function_path_equals_the_custom_op(op, grads):
    public, custom = CASES[op]
    x, w = _inputs(op, grads)
    y = public(x, w)
    assert type(y.grad_fn).__name__ == f"fly_{op}_eagerBackward"
    y_op = custom(x, w)
    assert type(y_op.grad_fn).__name__ != type(y.grad_fn).__name__
    torch.testing.assert_close(y, y_op, rtol=0, atol=0)
    upstream = torch.randn_like(y)
    wanted = [t for t in (x, w) if t.requires_grad]
    got = torch.autograd.grad(y, wanted, upstream)
    want = torch.autograd.grad(y_op, wanted, upstream)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("op", sorted(CASES))
def test_no_gradient_needed_goes_straight_to_the_dispatcher(op):
    public, _ = CASES[op]
    x, w = _inputs(op, (True, False))
    with torch.no_grad():
        assert public(x, w).grad_fn is None
    x, w = _inputs(op, (False, False))
    assert public(x, w).grad_fn is None


@pytest.mark.parametrize("op", sorted(CASES))
def test_tensor_subclasses_take_the_custom_op(op):
    public, _ = CASES[op]
    x, w = _inputs(op, (False, False))
    with FakeTensorMode() as mode:  # only the custom op has a fake implementation
        y = public(mode.from_tensor(x), mode.from_tensor(w))
    assert type(y).__name__ == "FakeTensor" and y.shape == (x.shape[0], x.shape[1] if op == "rms_norm" else 3)


@pytest.mark.parametrize("op", sorted(CASES))
def test_compiled_calls_take_the_custom_op(op):
    public, _ = CASES[op]
    x, w = _inputs(op, (True, False))
    compiled = torch.compile(public, backend="aot_eager", fullgraph=True)
    y = compiled(x, w)
    assert "eager" not in type(y.grad_fn).__name__
    torch.testing.assert_close(y, public(x, w))
