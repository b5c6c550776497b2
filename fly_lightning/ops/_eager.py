"""Eager calls without the custom op's host cost, with the same autograd formula.

Every operator is a ``torch.library`` custom op, which ``torch.compile`` and tensor subclasses (FakeTensor, DTensor)
need. In eager mode its Python wrapper is costly: on the H200 host a routing call with logits that require grad
measured 161-175 us through the custom op, 102-108 us through an ``autograd.Function`` around the dispatcher with
the same setup and backward, 76-81 us through the dispatcher alone (two runs); RMSNorm with grad 129-133 us against
87-94 (``benchmarks/probe_route_host.py`` -> ``route_host.md``, ``route_host_a886c46.md``). ``eager_call`` picks per
call: the custom op when traced (see ``_traced``) or given a tensor subclass, the ``autograd.Function`` when a
gradient is needed, the dispatcher otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from fly_lightning.registry import Op

_PLAIN = (Tensor, torch.nn.Parameter)  # a module's weights are Parameters: plain data, no __torch_function__


def _traced() -> bool:
    """Whether something above the call must see the op as one custom op: ``torch.compile``, a dispatch mode
    (``make_fx``, FakeTensorMode, FlopCounterMode, ...) or a functorch transform (vmap, grad, jvp), whose wrapped
    tensors are plain-typed. The kernels themselves are invisible to all of them."""
    return (
        torch.compiler.is_compiling()
        or torch._C._len_torch_dispatch_stack() > 0
        or torch._C._functorch.peek_interpreter_stack() is not None
    )


def eager_call(
    op: Op,
    custom_op: Callable[..., Any],
    setup_context: Callable[..., None],
    backward: Callable[..., Any],
) -> Callable[..., Any]:
    """Register ``setup_context`` and ``backward`` as ``custom_op``'s autograd formula, and return ``f(*args)``
    running ``op`` the cheapest way that keeps ``custom_op``'s semantics: both paths share that one formula."""
    custom_op.register_autograd(backward, setup_context=setup_context)

    def forward(ctx, *args: Any) -> Any:
        out = op(*args)
        setup_context(ctx, args, out)
        return out

    def backward_(ctx, *grads: Any) -> Any:
        return backward(ctx, *grads)

    # named for the op: grad_fn and profiler events say which path ran ("fly_moe_route_eagerBackward")
    namespace = {"forward": staticmethod(forward), "backward": staticmethod(backward_)}
    function = type(f"fly_{op.name}_eager", (torch.autograd.Function,), namespace)

    def call(*args: Any) -> Any:
        tensors = [a for a in args if isinstance(a, Tensor)]
        if _traced() or any(type(t) not in _PLAIN for t in tensors):
            return custom_op(*args)
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return function.apply(*args)
        return op(*args)

    return call
