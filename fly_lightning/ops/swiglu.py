"""SwiGLU activation of the MoE experts: ``silu(gate) * up``, or GeGLU ``gelu(gate) * up`` (``activation``).

``swiglu(gate, up)`` takes two ``[S, I]`` tensors; ``swiglu(hidden)`` takes the fused gate/up projection's output
``[S, 2I]`` with the gate columns first (transformers v5's ``gate_up_proj``). Rows may be strided (a column slice of
a wider tensor); the last dim must be the contiguous one for the kernels.

Numerics: the reference computes ``silu(gate) * up`` in fp32 and rounds once. The ATen path runs what the stock
blocks run (``F.silu(gate) * up`` in the input dtype: two roundings for bf16), so the kernels are at least as close to
the exact value as stock. Backward runs those stock ATen ops (``silu_backward`` and two products), writing a fused
input's two gradient halves into one tensor.

``activation`` (one of ``ACTIVATIONS``): ``"silu"`` (SwiGLU), ``"gelu"`` (GeGLU, exact erf GELU: ``F.gelu``,
transformers' ``gelu``) or ``"gelu_tanh"`` (GeGLU with the tanh approximation: ``F.gelu(approximate="tanh")``,
transformers' ``gelu_pytorch_tanh`` / ``gelu_new``). The backward of a GELU runs ATen's ``gelu_backward``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fly_lightning.dispatch import register_op
from fly_lightning.ops._eager import EagerCall, TracedOrDirect, create_graph_grads
from fly_lightning.registry import tensor_key

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
_GELU_APPROX = {"gelu": "none", "gelu_tanh": "tanh"}


def _validate(gate: Tensor, up: Tensor | None, activation: str = "silu") -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"swiglu: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if not isinstance(gate, Tensor) or gate.dim() != 2:
        raise ValueError(f"swiglu: gate must be a 2-D tensor, got {getattr(gate, 'shape', gate)}")
    if gate.dtype not in _FLOATS:
        raise ValueError(f"swiglu: inputs must be floating, got {gate.dtype}")
    if up is None:
        if gate.shape[1] % 2:
            raise ValueError(f"swiglu: a fused gate/up input needs an even last dim, got {gate.shape[1]}")
        return
    if not isinstance(up, Tensor) or up.shape != gate.shape or up.dtype != gate.dtype or up.device != gate.device:
        raise ValueError(
            f"swiglu: up must match gate's shape, dtype and device: {list(gate.shape)} {gate.dtype} {gate.device}, "
            f"got {getattr(up, 'shape', up)} {getattr(up, 'dtype', '')} {getattr(up, 'device', '')}"
        )


def split_gate_up(gate: Tensor, up: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(gate, up)`` views: a fused input's halves (gate columns first), else the two tensors."""
    if up is not None:
        return gate, up
    i = gate.shape[1] // 2
    return gate[:, :i], gate[:, i:]


def act(x: Tensor, activation: str = "silu") -> Tensor:
    """The gate's activation, as the stock experts apply it (``F.silu`` / ``F.gelu``)."""
    if activation == "silu":
        return F.silu(x)
    return F.gelu(x, approximate=_GELU_APPROX[activation])


def swiglu_reference(gate: Tensor, up: Tensor | None, activation: str = "silu") -> Tensor:
    """The oracle: ``act(gate) * up`` in fp32 (fp64 for fp64), rounded once."""
    g, u = split_gate_up(gate, up)
    acc = torch.promote_types(g.dtype, torch.float32)
    return (act(g.to(acc), activation) * u.to(acc)).to(g.dtype).contiguous()


def _swiglu_aten(gate: Tensor, up: Tensor | None, activation: str = "silu") -> Tensor:
    """What the stock blocks run, into a contiguous result (as the fake and the kernels give, whatever the layout)."""
    g, u = split_gate_up(gate, up)
    return torch.mul(act(g, activation), u, out=torch.empty(g.shape, dtype=g.dtype, device=g.device))


def _signature(gate: Tensor, up: Tensor | None, activation: str = "silu") -> tuple:
    return (tensor_key(gate), tensor_key(up), activation)


SWIGLU = register_op(
    "swiglu",
    reference=swiglu_reference,
    traced=swiglu_reference,
    aten=_swiglu_aten,
    signature=_signature,
    validate=_validate,
    doc="silu(gate) * up (or gelu / gelu_tanh: GeGLU) of the MoE experts, from two tensors or one fused [S, 2I] "
    "(gate first)",
)


@torch.library.custom_op("fly::swiglu", mutates_args=())
def swiglu_op(gate: Tensor, up: Tensor | None, activation: str = "silu") -> Tensor:
    """Dispatched forward."""
    return SWIGLU(gate, up, activation)


@swiglu_op.register_fake
def _(gate: Tensor, up: Tensor | None, activation: str = "silu") -> Tensor:
    _validate(gate, up, activation)
    g, _ = split_gate_up(gate, up)
    return g.new_empty(g.shape)


def swiglu_backward(grad: Tensor, gate: Tensor, up: Tensor | None, activation: str = "silu") -> tuple[Tensor, Tensor]:
    """Stock ATen backward of ``act(g) * u``; a fused input gets one ``[S, 2I]`` gradient (second is empty)."""
    g, u = split_gate_up(gate, up)
    grad = grad.to(g.dtype)
    if up is None:
        d = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        d_g, d_u = split_gate_up(d, None)
    else:
        d_g = torch.empty_like(g, memory_format=torch.contiguous_format)
        d_u = torch.empty_like(u, memory_format=torch.contiguous_format)
    torch.mul(grad, act(g, activation), out=d_u)
    if activation == "silu":
        torch.ops.aten.silu_backward.grad_input(grad * u, g, grad_input=d_g)
    else:
        torch.ops.aten.gelu_backward.grad_input(grad * u, g, approximate=_GELU_APPROX[activation], grad_input=d_g)
    return (d, gate.new_empty(0)) if up is None else (d_g, d_u)


# ``(d gate, d up)`` as an opaque op; for a fused input ``d gate`` is ``[S, 2I]`` and ``d up`` empty
swiglu_backward_op = torch.library.custom_op("fly::swiglu_backward", mutates_args=())(swiglu_backward)
_swiglu_backward_call = TracedOrDirect(swiglu_backward_op, swiglu_backward)


@swiglu_backward_op.register_fake
def _(grad: Tensor, gate: Tensor, up: Tensor | None, activation: str = "silu") -> tuple[Tensor, Tensor]:
    return gate.new_empty(gate.shape), (gate.new_empty(0) if up is None else up.new_empty(up.shape))


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[:2])
    ctx.activation = inputs[2] if len(inputs) > 2 else "silu"


def _backward(ctx, grad: Tensor):
    gate, up = ctx.saved_tensors
    activation = ctx.activation
    if torch.is_grad_enabled():  # create_graph=True: the formula writes into out= buffers
        needs = (ctx.needs_input_grad[0], up is not None and ctx.needs_input_grad[1])
        reference = lambda g, u: swiglu_reference(g, u, activation)  # noqa: E731
        return (*create_graph_grads(reference, (gate, up), needs, (grad,)), None)
    d_gate, d_up = _swiglu_backward_call(grad, gate, up, activation)
    return d_gate, (None if up is None else d_up), None


_swiglu_eager = EagerCall(SWIGLU, swiglu_op, _setup_context, _backward)


def swiglu(gate_SI: Tensor, up_SI: Tensor | None = None, activation: str = "silu") -> Tensor:
    """``act(gate) * up``: ``[S, I]`` (contiguous) in the inputs' dtype.

    Args:
        gate_SI: ``[S, I]`` gate projection, or ``[S, 2I]`` gate and up projections side by side (gate first) when
            ``up_SI`` is None.
        up_SI: ``[S, I]`` up projection.
        activation: ``"silu"`` (SwiGLU), ``"gelu"`` (GeGLU, erf) or ``"gelu_tanh"`` (GeGLU, tanh approximation).
    """
    return _swiglu_eager(gate_SI, up_SI, activation)
