"""Eager calls without the custom op's host cost, with the same autograd formula.

Every operator is a ``torch.library`` custom op, which ``torch.compile`` and tensor subclasses (FakeTensor, DTensor)
need. In eager mode its Python wrapper is costly: on the H200 host a routing call with logits that require grad
measured 175 us through the custom op, 107-108 us through an ``autograd.Function`` around the dispatcher with the
same setup and backward, 80-81 us through the dispatcher alone; RMSNorm with grad 133 us against 87
(``benchmarks/probe_route_host.py`` -> ``route_host.md``). ``eager_call`` picks per call: the custom op when tracing
or given a tensor subclass, the ``autograd.Function`` when a gradient is needed, the dispatcher otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from fly_lightning.registry import Op


def eager_call(
    op: Op,
    custom_op: Callable[..., Any],
    setup_context: Callable[..., None],
    backward: Callable[..., Any],
) -> Callable[..., Any]:
    """``f(*args)`` running ``op`` the cheapest way that keeps ``custom_op``'s semantics (``setup_context`` and
    ``backward`` are the ones registered with ``custom_op.register_autograd``)."""

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
        if torch.compiler.is_compiling() or any(type(t) is not Tensor for t in tensors):
            return custom_op(*args)
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return function.apply(*args)
        return op(*args)

    return call
