"""``eager_call``: the path each public call takes (custom op, autograd.Function, dispatcher), and that the Function
path gives the custom op's outputs and gradients, for every operator with a backward."""

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.profiler import profile

import fly_lightning
from fly_lightning.ops.grouped_mm import grouped_mm_op
from fly_lightning.ops.moe_combine import moe_combine_op
from fly_lightning.ops.moe_grouped_mm import moe_grouped_mm_op
from fly_lightning.ops.moe_route import moe_route_op
from fly_lightning.ops.rms_norm import rms_norm_op
from fly_lightning.ops.swiglu import swiglu_op
from fly_lightning.ops.topk import topk_op
from fly_lightning.registry import Op


@dataclass
class Case:
    inputs: Callable[[torch.Generator], tuple]  # floating tensors first: those that may require grad
    public: Callable[..., torch.Tensor]  # the public entry; returns the differentiable output
    custom: Callable[..., torch.Tensor]  # the same through the custom op
    differentiable: int  # how many leading inputs take a gradient


def _offs():
    return torch.tensor([3, 3, 7, 10], dtype=torch.int32)


def _perm():
    return torch.tensor([4, 0, 9, 2, 7, 1, 5, 8, 3, 6], dtype=torch.int32)  # 10 slots = 5 tokens x top-2


CASES = {
    "rms_norm": Case(
        lambda g: (torch.randn(6, 32, generator=g), torch.randn(32, generator=g)),
        lambda x, w: fly_lightning.rms_norm(x, w, 1e-6),
        lambda x, w: rms_norm_op(x, w, 1e-6, 0.0, False)[0],
        2,
    ),
    "moe_route": Case(
        lambda g: (torch.randn(20, 12, generator=g),),
        lambda x: fly_lightning.moe_route(x, 3).weights_TK,
        lambda x: moe_route_op(x, 3, "softmax", True, None, 1.0, None, None, False)[0],
        1,
    ),
    "topk": Case(
        lambda g: (torch.randn(5, 40, generator=g),),
        lambda x: fly_lightning.topk(x, 4).values,
        lambda x: topk_op(x, 4)[0],
        1,
    ),
    "swiglu": Case(
        lambda g: (torch.randn(7, 24, generator=g),),
        lambda gu: fly_lightning.swiglu(gu),
        lambda gu: swiglu_op(gu, None),
        1,
    ),
    "moe_combine": Case(
        lambda g: (torch.randn(10, 16, generator=g), torch.rand(5, 2, generator=g)),
        lambda rows, w: fly_lightning.moe_combine(rows, w),
        lambda rows, w: moe_combine_op(rows, w, None, None),
        2,
    ),
    "grouped_mm": Case(
        lambda g: (torch.randn(10, 16, generator=g), torch.randn(4, 16, 8, generator=g), _offs()),
        lambda x, w, offs: fly_lightning.grouped_mm(x, w, offs),
        lambda x, w, offs: grouped_mm_op(x, w, offs, None),
        2,
    ),
    "moe_grouped_mm": Case(
        lambda g: (torch.randn(5, 16, generator=g), torch.randn(4, 16, 8, generator=g), _offs(), _perm()),
        lambda x, w, offs, perm: fly_lightning.moe_grouped_mm(x, w, offs, perm, topk=2, gather=True, scatter=True),
        lambda x, w, offs, perm: moe_grouped_mm_op(x, w, offs, perm, 2, True, True, None),
        2,
    ),
}


def _args(op: str, grads: tuple[bool, ...]) -> tuple:
    """The case's inputs, the i-th requiring grad where ``grads[i]`` (the index tensors never)."""
    args = CASES[op].inputs(torch.Generator().manual_seed(1))
    return tuple(
        a.requires_grad_(i < len(grads) and grads[i]) if a.is_floating_point() else a for i, a in enumerate(args)
    )


def _grad_patterns(op: str) -> list[tuple[bool, ...]]:
    n = CASES[op].differentiable
    return [tuple(i == j or j == n for i in range(n)) for j in range(n + 1)] if n > 1 else [(True,)]


@pytest.mark.parametrize(("op", "grads"), [(op, g) for op in sorted(CASES) for g in _grad_patterns(op)])
def test_function_path_equals_the_custom_op(op, grads):
    case = CASES[op]
    args = _args(op, grads)
    y = case.public(*args)
    assert type(y.grad_fn).__name__ == f"fly_{op}_eagerBackward"
    y_op = case.custom(*args)
    assert type(y_op.grad_fn).__name__ != type(y.grad_fn).__name__
    torch.testing.assert_close(y, y_op, rtol=0, atol=0)
    upstream = torch.randn_like(y)
    wanted = [a for a in args if a.requires_grad]
    got = torch.autograd.grad(y, wanted, upstream)
    want = torch.autograd.grad(y_op, wanted, upstream)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _paths(fn) -> set[str]:
    """Which wrappers a call went through, from the profiler: the custom op ("fly::<op>") and/or the eager
    autograd.Function ("fly_<op>_eager")."""
    with profile() as prof:
        fn()
    return {e.name for e in prof.events() if e.name.startswith(("fly::", "fly_")) and "/" not in e.name}


@pytest.mark.parametrize("op", sorted(CASES))
def test_no_gradient_needed_goes_straight_to_the_dispatcher(op):
    case = CASES[op]
    assert f"fly::{op}" in _paths(lambda: case.custom(*_args(op, ())))  # the probe sees a custom-op call
    with torch.no_grad():
        assert _paths(lambda: case.public(*_args(op, (True,)))) == set()
    assert _paths(lambda: case.public(*_args(op, ()))) == set()


def test_module_parameters_take_the_function_path():
    """A module's weight is an ``nn.Parameter``: plain data, so the eager path applies (FlyRMSNorm, expert weights)."""
    x, w = _args("rms_norm", (True, False))
    y = fly_lightning.rms_norm(x, torch.nn.Parameter(w), 1e-6)
    assert type(y.grad_fn).__name__ == "fly_rms_norm_eagerBackward"


@pytest.mark.parametrize("op", ["rms_norm", "moe_route", "swiglu"])
def test_tensor_subclasses_take_the_custom_op(op, monkeypatch):
    case = CASES[op]
    args = _args(op, ())
    want = case.public(*args).shape

    def dispatched(*_):
        raise AssertionError("reached the dispatcher: the custom op's fake implementation should have answered")

    monkeypatch.setattr(Op, "__call__", dispatched)
    with FakeTensorMode() as mode:
        y = case.public(*(mode.from_tensor(a) for a in args))
    assert type(y).__name__ == "FakeTensor" and y.shape == want


@pytest.mark.parametrize("op", ["rms_norm", "moe_route"])
def test_dispatch_modes_see_the_custom_op(op):
    """make_fx (a dispatch mode) over plain tensors records the op as one call, as before the eager path."""
    case = CASES[op]
    graph = make_fx(case.public)(*_args(op, ()))
    assert f"fly.{op}.default" in str(graph.code)


@pytest.mark.parametrize("op", ["rms_norm", "moe_route"])
def test_compiled_calls_take_the_custom_op(op):
    case = CASES[op]
    args = _args(op, (True,))
    compiled = torch.compile(case.public, backend="aot_eager", fullgraph=True)
    compiled(*args)  # compile outside the profiler
    paths = _paths(lambda: compiled(*args))
    assert f"fly::{op}" in paths and f"fly_{op}_eager" not in paths
    torch.testing.assert_close(compiled(*args), case.public(*args))
