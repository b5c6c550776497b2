"""MX fake quantisation: ``x`` cast to MX along ``axis`` and back, in ``x``'s dtype and layout, in one op.

``mx_fake_quantize(x, fmt, mode, axis)`` gives the values an MX GEMM with fp32 accumulation multiplies (every MX
element times its power-of-two scale, rounded once to ``x``'s dtype, as ``from_mx``), so a bf16 GEMM on them computes
the MX product: the emulated form of MX training (``kernel_preference``: ``FlyMXLinear``, ``FlyMoE.mx``). Equal to
``mx_dequantize(*mx_cast(x, fmt, mode, axis))`` (column-wise: of the transposed layout), without the MX bytes in
memory between the two. The gradient passes straight through (identity), as in MX training recipes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fly_lightning.dispatch import register_op
from fly_lightning.ops._eager import EagerCall
from fly_lightning.ops.mx_cast import validate_cast
from fly_lightning.quant import formats
from fly_lightning.registry import tensor_key


def mx_fake_quantize_reference(x: Tensor, fmt: str, mode: str, axis: int) -> Tensor:
    """``formats.to_mx`` then ``formats.from_mx`` along ``axis`` (torchao's arithmetic), ``x``'s shape, contiguous."""
    rows = x.t() if axis == 0 else x
    y = formats.from_mx(*formats.to_mx(rows.contiguous(), fmt, mode), fmt, dtype=x.dtype)
    return (y.t() if axis == 0 else y).contiguous()


def _signature(x: Tensor, fmt: str, mode: str, axis: int) -> tuple:
    return (tensor_key(x), fmt, mode, axis)


def _validate(x: Tensor, fmt: str, mode: str, axis: int) -> None:
    validate_cast(x, fmt, mode, axis, op="mx_fake_quantize")


MX_FAKE_QUANTIZE = register_op(
    "mx_fake_quantize",
    reference=mx_fake_quantize_reference,
    signature=_signature,
    validate=_validate,
    doc="MX cast and back along K: (x, fmt, mode, axis) -> x on the MX grid",
)


@torch.library.custom_op("fly::mx_fake_quantize", mutates_args=())
def mx_fake_quantize_op(x: Tensor, fmt: str, mode: str, axis: int) -> Tensor:
    """Dispatched fake quantisation."""
    return MX_FAKE_QUANTIZE(x, fmt, mode, axis)


@mx_fake_quantize_op.register_fake
def _(x: Tensor, fmt: str, mode: str, axis: int) -> Tensor:
    _validate(x, fmt, mode, axis)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output) -> None:
    pass


def _backward(ctx, grad: Tensor):
    return grad, None, None, None  # straight through the cast


_mx_fake_quantize_eager = EagerCall(MX_FAKE_QUANTIZE, mx_fake_quantize_op, _setup_context, _backward)


def mx_fake_quantize(x: Tensor, fmt: str = "mxfp8_e4m3", mode: str = "floor", axis: int = -1) -> Tensor:
    """``x`` on the MX grid along ``axis`` (``-1``: blocks along the last dim; ``0``: down the columns of a 2-D
    ``x``), in ``x``'s dtype; straight-through gradient (see the module docstring).

    Args:
        x: fp32/bf16 tensor whose ``axis`` dim is a multiple of 32.
        fmt: ``"mxfp8_e4m3"``, ``"mxfp8_e5m2"`` or ``"mxfp4_e2m1"``.
        mode: ``"floor"`` or ``"rceil"`` (torchao's ``ScaleCalculationMode`` values).
    """
    return _mx_fake_quantize_eager(x, fmt, formats.op_mode("mx_fake_quantize", mode).value, axis)
