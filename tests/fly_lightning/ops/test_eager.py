"""``EagerCall``: the path each public call takes (custom op, autograd.Function, dispatcher), and that the Function
path gives the custom op's outputs and gradients, for every operator with a backward."""

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.profiler import profile

import fly_lightning
from fly_lightning.dispatch import Op
from fly_lightning.ops.grouped_mm import grouped_mm_op
from fly_lightning.ops.moe_combine import moe_combine_op, moe_dispatch_op
from fly_lightning.ops.moe_grouped_mm import moe_grouped_mm_op
from fly_lightning.ops.moe_route import moe_route_op
from fly_lightning.ops.rms_norm import rms_norm_op
from fly_lightning.ops.swiglu import swiglu_op
from fly_lightning.ops.topk import topk_op
from fly_lightning.policy import DispatchConfig, dispatch_config, set_dispatch_config


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
    "moe_dispatch": Case(
        lambda g: (torch.randn(5, 16, generator=g), torch.rand(5, 2, generator=g), _perm()),
        lambda x, w, perm: fly_lightning.moe_dispatch(x, perm, 2, w),
        lambda x, w, perm: moe_dispatch_op(x, perm, 2, w, None),
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


VARIANTS = {  # variants whose create_graph path differs from the default case's (tests of double backward)
    "rms_norm_gemma_llama": Case(
        lambda g: (torch.randn(6, 32, generator=g), torch.randn(32, generator=g)),
        lambda x, w: fly_lightning.rms_norm(x, w, 1e-6, offset=1.0, cast_before_scale=True),
        lambda x, w: rms_norm_op(x, w, 1e-6, 1.0, True)[0],
        2,
    ),
    "moe_combine_index_fp32": Case(
        lambda g: (torch.randn(10, 16, generator=g), torch.rand(5, 2, generator=g), _perm()),
        lambda rows, w, idx: fly_lightning.moe_combine(rows, w, idx, out_dtype=torch.float32),
        lambda rows, w, idx: moe_combine_op(rows, w, idx, torch.float32),
        2,
    ),
}


def _case(op: str) -> Case:
    return CASES[op] if op in CASES else VARIANTS[op]


def _args(op: str, grads: tuple[bool, ...]) -> tuple:
    """The case's inputs, the i-th requiring grad where ``grads[i]`` (the index tensors never)."""
    args = _case(op).inputs(torch.Generator().manual_seed(1))
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
    torch._dynamo.reset()
    with dispatch_config(inductor_ops=()), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(*args)  # compile outside the profiler
    assert not [str(w.message) for w in caught if "fly_lightning" in str(w.message)]  # e.g. Dynamo on a cached helper
    with dispatch_config(inductor_ops=()):
        paths = _paths(lambda: compiled(*args))
        assert f"fly::{op}" in paths and f"fly_{op}_eager" not in paths
        torch.testing.assert_close(compiled(*args), case.public(*args))


TRACEABLE = sorted(name for name, op in fly_lightning.registry.OPS.items() if op.traced is not None)


def test_default_inductor_ops_are_traceable():
    assert TRACEABLE and DispatchConfig().inductor_ops <= set(TRACEABLE)
    with pytest.raises(ValueError, match="no traced form"):
        set_dispatch_config(inductor_ops={"grouped_mm"})  # its reference reads offsets on the host


@pytest.mark.parametrize("op", TRACEABLE)
def test_compiled_calls_left_to_inductor_trace_the_plain_form(op):
    """An op the policy leaves to Inductor: no custom op in the compiled graph, forward and gradients equal to the
    opaque op's, and the decision in the dispatch log with backend ``inductor`` and its reason."""
    case = CASES[op]
    every = (True,) * case.differentiable
    results = {}
    for left in (True, False):
        torch._dynamo.reset()
        fly_lightning.DISPATCH_LOG.reset()
        args = _args(op, every)
        with dispatch_config(inductor_ops={op} if left else ()):
            compiled = torch.compile(case.public, backend="aot_eager", fullgraph=True)
            compiled(*args)  # compile outside the profiler
            paths = _paths(lambda: compiled(*args).sum().backward())  # noqa: B023
        assert (f"fly::{op}" in paths) is not left
        backends = {r["backend"] for r in fly_lightning.DISPATCH_LOG.records(op)}
        assert (backends == {"inductor"}) if left else ("inductor" not in backends and backends)
        y = compiled(*args)
        results[left] = (y, [a.grad for a in args if isinstance(a, torch.Tensor) and a.requires_grad])
    if left := [r for r in fly_lightning.DISPATCH_LOG.records(op) if r["backend"] == "inductor"]:
        assert "left to Inductor" in left[0]["reason"]
    torch.testing.assert_close(results[True][0], results[False][0], rtol=1e-5, atol=1e-5)
    for a, b in zip(results[True][1], results[False][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_inductor_decisions_are_recorded():
    torch._dynamo.reset()
    fly_lightning.DISPATCH_LOG.reset()
    x, w = _args("rms_norm", (True,))
    with dispatch_config(inductor_ops={"rms_norm"}):
        torch.compile(CASES["rms_norm"].public, backend="aot_eager", fullgraph=True)(x, w)
    (rec,) = fly_lightning.DISPATCH_LOG.records("rms_norm")
    assert rec["backend"] == "inductor" and "left to Inductor" in rec["reason"]
    assert fly_lightning.DISPATCH_LOG.summary()["rms_norm"]["specialised_share"] == 0.0


def test_dynamic_shapes_left_to_inductor_stay_in_one_graph():
    """Under dynamic shapes (``dynamic=True``, or automatically after a recompile for a new shape) the op stays in the
    graph (the recorded shape is the one traced); before, formatting a symbolic dim broke it (fullgraph: an error)."""
    torch._dynamo.reset()
    fly_lightning.DISPATCH_LOG.reset()
    x, w = _args("rms_norm", (True,))
    with dispatch_config(inductor_ops={"rms_norm"}):
        f = torch.compile(CASES["rms_norm"].public, backend="aot_eager", fullgraph=True, dynamic=True)
        y1 = f(x, w)
        y2 = f(torch.cat([x, x]), w)
    (rec,) = fly_lightning.DISPATCH_LOG.records("rms_norm")
    assert rec["backend"] == "inductor" and rec["shape"].startswith("x".join(map(str, x.shape)))
    torch.testing.assert_close(y2, torch.cat([y1, y1]))


# --- differentiation the custom op cannot serve: forward-mode AD and torch.func --------------------------------------


def _jvp_from_backward(op: str, primals: tuple, tangents: tuple, rest: tuple) -> torch.Tensor:
    """J @ t from the Jacobian that the production backward formula gives (through the custom op): a check of the
    reference's forward-mode tangent that shares none of its code."""
    jac = torch.autograd.functional.jacobian(lambda *p: CASES[op].custom(*p, *rest), primals)
    return sum(torch.tensordot(j, t, dims=t.dim()) for j, t in zip(jac, tangents, strict=True))


def _primals(op: str) -> tuple[tuple, tuple, tuple]:
    """(differentiable inputs, their tangents, the other inputs)."""
    args = _args(op, ())
    n = _case(op).differentiable
    g = torch.Generator().manual_seed(3)
    return args[:n], tuple(torch.randn(a.shape, generator=g) for a in args[:n]), args[n:]


def _fallbacks(op: str) -> list[str]:
    """Reasons of the calls that ran the reference for differentiation (not the kernels' own support fallbacks)."""
    return [r["reason"] for r in fly_lightning.DISPATCH_LOG.records(op) if "the reference runs" in r["reason"]]


@pytest.mark.parametrize("mode", ["forward_ad", "func_jvp"])
@pytest.mark.parametrize("op", sorted(CASES))
def test_forward_mode_ad_runs_the_reference_with_its_tangent(op, mode):
    """The kernels compute no tangent (the custom op gave zeros under torch.func.jvp, the Triton path none under
    forward_ad): those calls run the reference, recorded as a fallback."""
    primals, tangents, rest = _primals(op)
    case = CASES[op]
    if mode == "forward_ad":
        with fwAD.dual_level():
            y = case.public(*(fwAD.make_dual(p, t) for p, t in zip(primals, tangents, strict=True)), *rest)
            y, tangent = fwAD.unpack_dual(y)
    else:
        y, tangent = torch.func.jvp(lambda *p: case.public(*p, *rest), primals, tangents)
    (reason,) = _fallbacks(op)
    assert ("forward-mode AD" if mode == "forward_ad" else "torch.func transform (jvp)") in reason
    assert tangent is not None
    torch.testing.assert_close(y, case.public(*primals, *rest))
    torch.testing.assert_close(tangent, _jvp_from_backward(op, primals, tangents, rest), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("op", sorted(CASES))
def test_func_grad_runs_the_reference(op):
    """torch.func.grad refuses a custom op's autograd formula: the call runs the reference, with the same gradients
    as autograd through the custom op."""
    primals, _, rest = _primals(op)
    case = CASES[op]
    upstream = torch.randn(case.public(*primals, *rest).shape, generator=torch.Generator().manual_seed(5))
    argnums = tuple(range(len(primals)))
    got = torch.func.grad(lambda *p: (case.public(*p, *rest) * upstream).sum(), argnums=argnums)(*primals)
    leaves = [p.clone().requires_grad_() for p in primals]
    want = torch.autograd.grad((case.custom(*leaves, *rest) * upstream).sum(), leaves)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    (reason,) = _fallbacks(op)
    assert "torch.func transform (grad)" in reason


def test_plain_tensors_inside_a_dual_level_keep_the_kernels():
    """A dual level alone (no tangent on the inputs) changes nothing: the call is dispatched as usual."""
    x, w = _args("rms_norm", ())
    with fwAD.dual_level():
        fly_lightning.rms_norm(x, w, 1e-6)
    assert _fallbacks("rms_norm") == []
    assert [r["backend"] for r in fly_lightning.DISPATCH_LOG.records("rms_norm")] == ["triton"]


def test_vmap_alone_keeps_the_custom_op():
    """vmap does not differentiate: its batching fallback runs the custom op per sample, no reference fallback."""
    x, w = _args("rms_norm", ())
    paths = _paths(lambda: torch.func.vmap(lambda r: fly_lightning.rms_norm(r, w, 1e-6))(x))
    assert "fly::rms_norm" in paths
    y = torch.func.vmap(lambda r: fly_lightning.rms_norm(r, w, 1e-6))(x)
    torch.testing.assert_close(y, fly_lightning.rms_norm(x, w, 1e-6))
    assert _fallbacks("rms_norm") == []


@pytest.mark.parametrize("mode", ["forward_ad", "func_grad"])
def test_reference_path_still_checks_values(mode):
    """The reference path runs the op's per-call value checks too: offsets past the rows raise, as in a plain call."""
    x, w, _ = _args("grouped_mm", ())
    bad = torch.tensor([3, 3, 7, 12], dtype=torch.int32)  # 12 > the 10 rows
    with pytest.raises(ValueError):
        fly_lightning.grouped_mm(x, w, bad)
    with pytest.raises(ValueError):
        if mode == "forward_ad":
            with fwAD.dual_level():
                fly_lightning.grouped_mm(fwAD.make_dual(x, torch.ones_like(x)), w, bad)
        else:
            torch.func.grad(lambda a: fly_lightning.grouped_mm(a, w, bad).sum())(x)


@pytest.mark.parametrize("op", ["grouped_mm", "moe_combine", "moe_grouped_mm", "swiglu"])
def test_backward_op_is_opaque_only_when_traced(op):
    """The eager backward calls its ATen formula directly; under torch.compile it stays one opaque custom op."""
    case = CASES[op]
    every = (True,) * case.differentiable

    def backward_events(y: torch.Tensor) -> set[str]:
        with profile() as prof:
            y.backward(torch.ones_like(y))
        return {e.name for e in prof.events() if e.name.startswith(f"fly::{op}_backward")}

    args = _args(op, every)
    assert backward_events(case.public(*args)) == set()
    eager_grads = [a.grad for a in args if a.requires_grad]
    args = _args(op, every)
    compiled = torch.compile(case.public, backend="aot_eager", fullgraph=True)
    with dispatch_config(inductor_ops=()):
        assert backward_events(compiled(*args)) == {f"fly::{op}_backward"}
    for a, b in zip([a.grad for a in args if a.requires_grad], eager_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("op", sorted(CASES | VARIANTS))
def test_create_graph_first_gradient_equals_the_plain_one(op):
    """The differentiable first gradient (create_graph=True) equals the one a plain backward gives."""
    primals, _, rest = _primals(op)
    case = _case(op)
    leaves = [p.clone().requires_grad_() for p in primals]
    plain = torch.autograd.grad(case.public(*leaves, *rest).square().sum(), leaves)
    graph = torch.autograd.grad(case.public(*leaves, *rest).square().sum(), leaves, create_graph=True)
    for a, b in zip(graph, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", sorted(CASES | VARIANTS))
def test_double_backward_equals_the_references(op):
    """create_graph=True: the first gradient must itself be differentiable and right. RMSNorm's formula treated the
    saved rstd as a constant (a wrong second derivative, silently); SwiGLU's and the combine's wrote into ``out=``
    buffers (autograd refused). The expected values come from torch.func over the references."""
    primals, _, rest = _primals(op)
    case = _case(op)
    n = len(primals)

    def first_grad_norm(*p: torch.Tensor, public=case.public) -> torch.Tensor:
        (g,) = torch.autograd.grad(public(*p, *rest).square().sum(), p[0], create_graph=True)
        return g.square().sum()

    leaves = [p.clone().requires_grad_() for p in primals]
    got = torch.autograd.grad(first_grad_norm(*leaves), leaves, allow_unused=True)
    want = torch.func.grad(
        lambda *p: torch.func.grad(lambda *q: case.public(*q, *rest).square().sum())(*p).square().sum(),
        argnums=tuple(range(n)),
    )(*primals)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(torch.zeros_like(b) if a is None else a, b, rtol=1e-4, atol=1e-4)
