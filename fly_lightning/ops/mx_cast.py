"""MX cast: a bf16/fp32 tensor to OCP MX elements and one E8M0 scale per 32 values along K (forward only).

``mx_cast(x, fmt, mode, axis)`` quantises along ``axis``: ``-1`` (row-wise: blocks along the last dim, an activation
``[M, K]``) or ``0`` (column-wise, 2-D: blocks along the first dim, a weight ``[K, N]``). Outputs keep ``x``'s layout:
``data`` is ``x``'s shape with the blocked dim halved for fp4 (two elements per byte, uint8), ``scale`` has that dim
divided by 32 (``float8_e8m0fnu``). The reference is ``fly_lightning.quant.formats.to_mx`` (bit-exact with torchao),
so every backend is checked bit-exact against torchao's cast. Quantisation is not differentiated (no autograd).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fly_lightning.dispatch import register_op
from fly_lightning.ops._eager import TracedOrDirect
from fly_lightning.quant import formats
from fly_lightning.registry import tensor_key


def validate_cast(x: Tensor, fmt: str, mode: str, axis: int, op: str = "mx_cast") -> None:
    """What a cast along ``axis`` takes (``mx_cast``, ``mx_fake_quantize``: ``op`` names it in the errors): named
    errors before any kernel."""
    if not isinstance(x, Tensor):
        raise ValueError(f"{op}: x must be a Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{op}: x must be float32 or bfloat16, got {x.dtype}")
    formats.op_format(op, fmt)
    formats.op_mode(op, mode)
    if axis not in (-1, 0) or (axis == 0 and x.dim() != 2) or x.dim() < 1:
        raise ValueError(f"{op}: axis must be -1, or 0 for a 2-D x; got axis={axis!r} for shape {list(x.shape)}")
    if x.shape[axis] % formats.BLOCK:
        raise ValueError(f"{op}: dim {axis} of {list(x.shape)} must be a multiple of {formats.BLOCK}")


def mx_cast_reference(x: Tensor, fmt: str, mode: str, axis: int) -> tuple[Tensor, Tensor]:
    """``formats.to_mx`` along ``axis``, outputs in ``x``'s layout (contiguous)."""
    if axis == 0:
        data, scale = formats.to_mx(x.t().contiguous(), fmt, mode)
        return data.t().contiguous(), scale.t().contiguous()
    return formats.to_mx(x.contiguous(), fmt, mode)


def _shapes(x: Tensor, fmt: str, axis: int) -> tuple[list[int], list[int]]:
    f = formats.as_format(fmt)
    data, scale = list(x.shape), list(x.shape)
    data[axis] //= f.per_byte
    scale[axis] //= formats.BLOCK
    return data, scale


def _signature(x: Tensor, fmt: str, mode: str, axis: int) -> tuple:
    return (tensor_key(x), fmt, mode, axis)


MX_CAST = register_op(
    "mx_cast",
    reference=mx_cast_reference,
    signature=_signature,
    validate=validate_cast,
    doc="MX cast along K: (x, fmt, mode, axis) -> (data, scale)",
)


@torch.library.custom_op("fly::mx_cast", mutates_args=())
def mx_cast_op(x: Tensor, fmt: str, mode: str, axis: int) -> tuple[Tensor, Tensor]:
    """Dispatched cast: ``(data, scale)``."""
    return MX_CAST(x, fmt, mode, axis)


@mx_cast_op.register_fake
def _(x: Tensor, fmt: str, mode: str, axis: int) -> tuple[Tensor, Tensor]:
    validate_cast(x, fmt, mode, axis)
    data, scale = _shapes(x, fmt, axis)
    return x.new_empty(data, dtype=formats.data_dtype(fmt)), x.new_empty(scale, dtype=torch.float8_e8m0fnu)


# the custom op where something traces or a tensor subclass is given; eager calls skip its wrapper's host cost
_mx_cast_call = TracedOrDirect(mx_cast_op, MX_CAST)


def mx_cast(x: Tensor, fmt: str = "mxfp8_e4m3", mode: str = "floor", axis: int = -1) -> tuple[Tensor, Tensor]:
    """Quantise ``x`` to MX along ``axis`` (``-1`` row-wise, ``0`` column-wise for 2-D): ``(data, scale)``.

    Args:
        x: fp32/bf16 tensor whose ``axis`` dim is a multiple of 32.
        fmt: ``"mxfp8_e4m3"``, ``"mxfp8_e5m2"`` or ``"mxfp4_e2m1"``.
        mode: ``"floor"`` or ``"rceil"`` (torchao's ``ScaleCalculationMode`` values).
    """
    mode = formats.op_mode("mx_cast", mode).value  # torchao's enum or ours: the op takes the string
    if isinstance(x, Tensor):
        x = x.detach()  # a cast has no gradient
    return _mx_cast_call(x, fmt, mode, axis)
