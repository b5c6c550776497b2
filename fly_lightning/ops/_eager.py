"""Eager calls without the custom op's host cost, with the same autograd formula.

Every operator is a ``torch.library`` custom op, which ``torch.compile`` and tensor subclasses (FakeTensor, DTensor)
need. In eager mode its Python wrapper is costly: on the H200 host a routing call with logits that require grad
measured 161-175 us through the custom op, 102-108 us through an ``autograd.Function`` around the dispatcher with
the same setup and backward, 76-81 us through the dispatcher alone (two runs); RMSNorm with grad 129-133 us against
87-94. ``EagerCall`` picks per call: the custom op when traced (see ``_traced``) or given a tensor subclass, the
``autograd.Function`` when a gradient is needed, the dispatcher otherwise. Eager backward passes likewise call their
ATen formulas directly, the backward custom ops only when traced (``TracedOrDirect``).

Forward-mode AD and ``torch.func``'s differentiating transforms run the op's plain-torch reference instead, recorded
as a fallback: a custom op has no forward-mode formula (under ``torch.func.jvp`` it returned a zero tangent, and the
kernels' outputs carry no tangent under ``torch.autograd.forward_ad``), and ``torch.func.grad`` refuses the
autograd formula of a custom op. The reference is built from ATen ops that all transforms support.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch._C._functorch import TransformType, get_interpreter_stack, peek_interpreter_stack
from torch._dynamo.comptime import comptime
from torch.autograd import forward_ad

from fly_lightning import policy
from fly_lightning.dispatch import Op, record_fallback, record_inductor
from fly_lightning.dtensor import is_dtensor, replicate_plain

_PLAIN = (Tensor, torch.nn.Parameter)  # a module's weights are Parameters: plain data, no __torch_function__


def _traced() -> bool:
    """Whether something above the call must see the op as one custom op: ``torch.compile``, a dispatch mode
    (``make_fx``, FakeTensorMode, FlopCounterMode, ...) or a functorch transform (vmap, grad, jvp), whose wrapped
    tensors are plain-typed. The kernels themselves are invisible to all of them."""
    return (
        torch.compiler.is_compiling()
        or torch._C._len_torch_dispatch_stack() > 0
        or peek_interpreter_stack() is not None
    )


def _opaque(tensors: list[Tensor]) -> bool:
    """Whether the custom op must run: something traces the call, a tensor is a subclass (FakeTensor, DTensor) or
    on the meta device (shape inference: the op's fake implementation answers it)."""
    return _traced() or any(type(t) not in _PLAIN or t.is_meta for t in tensors)


_DIFFERENTIATING = (TransformType.Grad, TransformType.Jvp)


def _differentiated(tensors: list[Tensor]) -> str | None:
    """Why the call must run the reference: forward-mode AD or a ``torch.func`` transform that differentiates
    through it; None otherwise. Costs one attribute read and one stack peek when neither is active. Private APIs:
    torch exposes neither the current dual level nor the functorch transform stack publicly. Eager only: under
    ``torch.compile`` the transforms still reach the custom op (Dynamo cannot trace the stack query)."""
    if peek_interpreter_stack() is not None and not torch.compiler.is_compiling():
        kinds = {i.key() for i in get_interpreter_stack()}.intersection(_DIFFERENTIATING)
        if kinds:
            names = ", ".join(sorted(k.name.lower() for k in kinds))
            return f"torch.func transform ({names}): a custom op cannot be differentiated there; the reference runs"
    if forward_ad._current_level >= 0 and any(forward_ad.unpack_dual(t).tangent is not None for t in tensors):
        return "forward-mode AD (dual tensors): kernels compute no tangent; the reference runs"
    return None


def _run_reference(op: Op, args: tuple, reason: str) -> Any:
    """Validate (shapes and values, as a dispatched call would), record the fallback, run the reference."""
    if op.validate is not None:
        op.validate(*args)
    if op.check is not None:
        op.check(*args)
    tensors = tuple((tuple(a.shape), a.dtype) for a in args if isinstance(a, Tensor))
    record_fallback(op, (reason, tensors), args, reason)
    return op.reference(*args)


def create_graph_grads(
    reference: Callable[..., Any], inputs: tuple, needs: tuple[bool, ...], grads: tuple[Tensor | None, ...]
) -> tuple[Tensor | None, ...]:
    """Gradients for a backward pass run with ``create_graph=True`` (double backward), by differentiating
    ``reference(*inputs)`` (plain torch), so that they can be differentiated again. The fast formulas cannot serve
    there: RMSNorm's treats the saved ``rstd`` as a constant (a wrong second derivative), others write into ``out=``
    buffers (which autograd refuses). ``needs[i]``: whether ``inputs[i]`` (a tensor when True) wants a gradient."""
    wanted = [t for t, need in zip(inputs, needs, strict=True) if need]
    with torch.enable_grad():
        outs = reference(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if g is not None and o.requires_grad]
    got = iter(
        torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], create_graph=True, allow_unused=True)
        if pairs and wanted
        else [None] * len(wanted)
    )
    return tuple(next(got) if need else None for need in needs)


class TracedOrDirect:
    """``f(*args)``: ``custom_op`` where something traces the call or a tensor subclass is given (a backward op that
    ``torch.compile`` must see as one opaque call), else ``impl``, the function the custom op wraps, called directly
    (eager backward passes: a small MoE block's step took 8-23% less host time on the H200 host).

    ``forward_only``: the op's name when it has no autograd formula (the MX GEMMs). A call that would need one (grad
    mode on, an input requiring grad) raises before any kernel runs: otherwise the gradient would be dropped or kept
    depending on which backend ran."""

    def __init__(
        self, custom_op: Callable[..., Any], impl: Callable[..., Any], forward_only: str | None = None
    ) -> None:
        self.custom_op = custom_op
        self.impl = impl
        self.forward_only = forward_only

    def __call__(self, *args: Any) -> Any:
        tensors = [a for a in args if isinstance(a, Tensor)]
        if self.forward_only is not None and torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            raise ValueError(
                f"{self.forward_only}: forward only (no gradient formula), but an input requires grad; call it under "
                "torch.no_grad(), or train through the MX layers (FlyMXLinear, MXExperts), which have one"
            )
        if _opaque(tensors):
            return self.custom_op(*args)
        return self.impl(*args)


class EagerCall:
    """``f(*args)`` running ``op`` the cheapest way that keeps ``custom_op``'s semantics.

    Registers ``setup_context`` and ``backward`` as ``custom_op``'s autograd formula, and builds one
    ``autograd.Function`` (named for the op, so grad_fn and profiler events say which path ran:
    ``fly_moe_route_eagerBackward``) with the same two functions: both paths share that one formula. Per call, in
    order: a differentiating transform or dual tensors run the reference (recorded); something tracing, or a tensor
    subclass, gets the custom op (DTensors the reference, recorded, as they have no sharding rule); a call that needs a
    gradient goes through the ``autograd.Function``; anything else calls the dispatcher.
    """

    def __init__(
        self,
        op: Op,
        custom_op: Callable[..., Any],
        setup_context: Callable[..., None],
        backward: Callable[..., Any],
    ) -> None:
        custom_op.register_autograd(backward, setup_context=setup_context)
        self.op = op
        self.custom_op = custom_op
        self.function = _autograd_function(op, setup_context, backward)

    def __call__(self, *args: Any) -> Any:
        tensors = [a for a in args if isinstance(a, Tensor)]
        if (reason := _differentiated(tensors)) is not None:
            return _run_reference(self.op, args, reason)
        if _opaque(tensors):
            compiling = torch.compiler.is_compiling()
            if compiling and self.op.traced is not None and self.op.name in policy.get_dispatch_config().inductor_ops:
                return _left_to_inductor(self.op, args, tensors)
            if not compiling and any(is_dtensor(t) for t in tensors):
                return _run_reference(self.op, replicate_plain(args), _NO_SHARD_RULE)
            return self.custom_op(*args)
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return self.function.apply(*args)
        return self.op(*args)


_SHAPES: list[str] = []  # shapes noted while Dynamo traces one call of ``_left_to_inductor`` (compile-time only)


def _note_shape(t: Tensor) -> None:
    """At trace time (``comptime``: plain Python, no graph node, nothing run), note ``t``'s traced shape: a symbolic
    dim (dynamic shapes: ``dynamic=True``, or automatically after a recompile) as its hint, ``?`` without one.
    Formatting the dims in the traced code would break the graph at every symbolic dim."""

    @comptime
    def _(ctx) -> None:
        dims = [n.node.hint if isinstance(n, torch.SymInt) else n for n in ctx.get_local("t").as_fake().shape]
        _SHAPES.append("x".join("?" if n is None else str(n) for n in dims))


def _record_noted(name: str, dtype: str) -> None:
    @comptime
    def _(ctx) -> None:
        shape = ", ".join(_SHAPES)
        _SHAPES.clear()
        record_inductor(ctx.get_local("name").as_python_constant(), shape, ctx.get_local("dtype").as_python_constant())


def _left_to_inductor(op: Op, args: tuple, tensors: list[Tensor]) -> Any:
    """Under ``torch.compile``: validate, record the decision while Dynamo traces (``record_inductor``: ``calls``
    counts the graphs holding the op) and return the op's traced form, which Inductor compiles with its
    neighbours."""
    if op.validate is not None:
        op.validate(*args)
    for t in tensors:
        _note_shape(t)
    _record_noted(op.name, str(tensors[0].dtype).removeprefix("torch.") if tensors else "-")
    return op.traced(*args)


def _autograd_function(
    op: Op, setup_context: Callable[..., None], backward: Callable[..., Any]
) -> type[torch.autograd.Function]:
    """A ``torch.autograd.Function`` subclass named ``fly_<op>_eager`` whose forward dispatches ``op``."""

    def forward(ctx, *args: Any) -> Any:
        out = op(*args)
        setup_context(ctx, args, out)
        return out

    def backward_(ctx, *grads: Any) -> Any:
        return backward(ctx, *grads)

    namespace = {"forward": staticmethod(forward), "backward": staticmethod(backward_)}
    return type(f"fly_{op.name}_eager", (torch.autograd.Function,), namespace)


# The custom ops have no DTensor sharding rule (only ``rms_norm`` runs on local shards, ``fly_lightning.dtensor``):
# without this the call would fail in DTensor's dispatch with "does not have a sharding strategy registered".
_NO_SHARD_RULE = "DTensor input: this op has no local-shard rule; the reference runs on the DTensors"
