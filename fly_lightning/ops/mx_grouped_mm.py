"""MX grouped GEMM for MoE experts: ``y[s_e:offs[e]] = dequant(x)[s_e:offs[e]] @ dequant(w[e])^T`` (ragged groups).

Group semantics are ``grouped_mm``'s (``torch._grouped_mm``'s 2D x 3D case): int32 end offsets ``offs`` ``[E]``,
non-decreasing, ``offs[-1] <= M``, empty groups allowed, rows at and past ``offs[-1]`` left unwritten (unspecified).

Operands, one E8M0 scale per 32 values along K (OCP MX):

- ``x`` ``[M, K]``: MX (``x_fmt`` names its format, ``x_scale`` ``[M, K / 32]`` its scales; ``mx_cast(x)`` row-wise
  gives both) or high precision (``x_fmt=None``: bf16 or fp32 activations times MX weights, "weight-only");
- ``w`` always MX, ``[E, N, K / per_byte]`` with scales ``[E, N, K / 32]``: the layout of transformers' and
  ``nn.Linear``-style expert weights ``[E, N, K]`` (K contiguous) cast along K, i.e. ``mx_cast`` of its ``[E * N, K]``
  rows reshaped. The blocks then run along each output column's contraction dim, as the MX GEMM needs; an ``[E, K,
  N]`` (N-contiguous) weight is cast through its transposed rows the same way (``MXGroupedProjection``).

Formats: ``mxfp8_e4m3``, ``mxfp8_e5m2``, ``mxfp4_e2m1`` (two elements per byte along K, element ``2j`` in the low
nibble). Forward only, as ``mx_scaled_mm``; no autograd here (the MoE block's straight-through backward runs the bf16
grouped GEMM on the dequantised operands).

The reference dequantises to fp32 and multiplies per group in fp32 (the oracle); the ATen path is torchao's emulated
one: dequantise to bf16, then ``torch._grouped_mm`` (on CUDA; a per-group fp32 GEMM on CPU, where bf16 matmul is
slow). Kernels register as further backends.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fly_lightning.dispatch import register_op
from fly_lightning.ops._eager import TracedOrDirect
from fly_lightning.ops.grouped_mm import _check_offsets, aten_reason, clamp_offsets, grouped_mm_reference
from fly_lightning.quant import formats
from fly_lightning.registry import tensor_key

_OUT = (torch.bfloat16, torch.float16, torch.float32)
_OP = "mx_grouped_mm"


def _validate(
    x: Tensor,
    x_scale: Tensor | None,
    x_fmt: str | None,
    w: Tensor,
    w_scale: Tensor,
    w_fmt: str,
    offs: Tensor,
    out_dtype: torch.dtype,
) -> None:
    """Shapes, dtypes, formats and devices; offset values only where readable without a device sync (``check``)."""
    kw = formats.check_operand(_OP, "w", w, w_scale, w_fmt, 3)
    if w.shape[0] < 1:
        raise ValueError(f"{_OP}: w needs at least one group (E >= 1)")
    if x_fmt is None:
        if not isinstance(x, Tensor) or x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"{_OP}: a high-precision x must be a 2-D bf16/fp32 tensor")
        if x_scale is not None:
            raise ValueError(f"{_OP}: x_scale given without x_fmt")
        kx = x.shape[1]
    else:
        if x_scale is None:
            raise ValueError(f"{_OP}: an MX x needs x_scale")
        kx = formats.check_operand(_OP, "x", x, x_scale, x_fmt, 2)
    if kx != kw:
        raise ValueError(f"{_OP}: x has K={kx}, w has K={kw}")
    if not isinstance(offs, Tensor) or offs.dtype != torch.int32:
        raise ValueError(f"{_OP}: offs must be an int32 tensor, got {getattr(offs, 'dtype', type(offs).__name__)}")
    if offs.dim() != 1 or offs.shape[0] != w.shape[0]:
        raise ValueError(f"{_OP}: offs must be 1-D of length E={w.shape[0]}, got shape {list(offs.shape)}")
    if x.device != w.device or x.device != offs.device:
        raise ValueError(f"{_OP}: x on {x.device}, w on {w.device}, offs on {offs.device}: must match")
    if out_dtype not in _OUT:
        raise ValueError(f"{_OP}: out_dtype must be one of {_OUT}, got {out_dtype}")


def _check_values(x, x_scale, x_fmt, w, w_scale, w_fmt, offs, out_dtype) -> None:
    _check_offsets(offs, x.shape[0], _OP)


def dequantised(x, x_scale, x_fmt, w, w_scale, w_fmt, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(x [M, K], w [E, K, N])`` in ``dtype``: ``w`` as the transposed view of the dequantised ``[E, N, K]``
    (K-contiguous, a layout ``torch._grouped_mm`` takes)."""
    dx = x.to(dtype) if x_fmt is None else formats.from_mx(x, x_scale, x_fmt, dtype)
    return dx, formats.from_mx(w, w_scale, w_fmt, dtype).transpose(1, 2)


def mx_grouped_mm_reference(x, x_scale, x_fmt, w, w_scale, w_fmt, offs, out_dtype) -> Tensor:
    """The oracle: both operands dequantised to fp32, an fp32 GEMM per group (offsets read on the host), one rounding
    to ``out_dtype``; rows at and past ``offs[-1]`` left as ``torch.empty`` leaves them."""
    dx, dw = dequantised(x, x_scale, x_fmt, w, w_scale, w_fmt, torch.float32)
    return grouped_mm_reference(dx, dw, offs, out_dtype)


def _mx_grouped_mm_aten(x, x_scale, x_fmt, w, w_scale, w_fmt, offs, out_dtype) -> Tensor:
    """torchao's emulated path: dequantise to bf16, ``torch._grouped_mm`` (device offsets clamped, never read on the
    host); for an fp32 or fp16 output in fp32 (the values are the same: ``_grouped_mm`` gives its input dtype, and
    its fp32 sums are then rounded once, not through bf16). ATen's fp32 grouped GEMM reads the offsets on the host
    (a sync, no CUDA-graph capture), as for stock fp32 experts. On CPU, or where ATen refuses the layout, the
    per-group reference GEMM."""
    dtype = torch.bfloat16 if x.is_cuda and out_dtype == torch.bfloat16 else torch.float32
    dx, dw = dequantised(x, x_scale, x_fmt, w, w_scale, w_fmt, dtype)
    if x.is_cuda and hasattr(torch, "_grouped_mm") and aten_reason(dx, dw, offs) is None:
        return torch._grouped_mm(dx, dw, offs=clamp_offsets(offs, x.shape[0])).to(out_dtype)
    return grouped_mm_reference(dx, dw, offs, out_dtype)


def _signature(x, x_scale, x_fmt, w, w_scale, w_fmt, offs, out_dtype) -> tuple:
    keys = tuple(tensor_key(t) for t in (x, x_scale, w, w_scale, offs))
    return (*keys, x_fmt, w_fmt, out_dtype)


MX_GROUPED_MM = register_op(
    _OP,
    reference=mx_grouped_mm_reference,
    aten=_mx_grouped_mm_aten,
    signature=_signature,
    validate=_validate,
    check=_check_values,
    doc="MX grouped GEMM by int32 group end offsets: (x, x_scale, x_fmt, w [E,N,K], w_scale, w_fmt, offs, out_dtype) "
    "-> y [M, N]",
)


@torch.library.custom_op("fly::mx_grouped_mm", mutates_args=())
def mx_grouped_mm_op(
    x: Tensor,
    x_scale: Tensor | None,
    x_fmt: str | None,
    w: Tensor,
    w_scale: Tensor,
    w_fmt: str,
    offs: Tensor,
    out_dtype: torch.dtype,
) -> Tensor:
    """Dispatched MX grouped GEMM."""
    return MX_GROUPED_MM(x, x_scale, x_fmt, w, w_scale, w_fmt, offs, out_dtype)


@mx_grouped_mm_op.register_fake
def _(x, x_scale, x_fmt, w, w_scale, w_fmt, offs, out_dtype) -> Tensor:
    _validate(x, x_scale, x_fmt, w, w_scale, w_fmt, offs, out_dtype)
    return x.new_empty((x.shape[0], w.shape[1]), dtype=out_dtype)


# the custom op where something traces or a tensor subclass is given; eager calls skip its wrapper's host cost
_mx_grouped_mm_call = TracedOrDirect(mx_grouped_mm_op, MX_GROUPED_MM, forward_only=_OP)


def mx_grouped_mm(
    x_MK: Tensor,
    w_ENK: Tensor,
    w_scale: Tensor,
    w_fmt: str,
    offs_E: Tensor,
    *,
    x_scale: Tensor | None = None,
    x_fmt: str | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """Per group e, ``x[rows of e] @ dequant(w[e]).T``: MX expert weights times MX or bf16/fp32 activations.

    Args:
        x_MK: ``[M, K]`` rows sorted by group: MX data when ``x_fmt`` is given (``x_scale`` ``[M, K / 32]``), else
            bf16/fp32 (weight-only).
        w_ENK: MX expert weights ``[E, N, K / per_byte]`` (``mx_cast`` of ``[E * N, K]`` rows, reshaped).
        w_scale: ``[E, N, K / 32]`` ``float8_e8m0fnu``.
        w_fmt: ``"mxfp8_e4m3"``, ``"mxfp8_e5m2"`` or ``"mxfp4_e2m1"`` (also ``x_fmt``).
        offs_E: int32 ``[E]`` group end offsets, non-decreasing, ``offs[-1] <= M`` (checked on the CPU only).

    Returns:
        ``[M, N]`` in ``out_dtype``; rows at and past ``offs[-1]`` are unspecified, as in ``grouped_mm``.
    """
    return _mx_grouped_mm_call(x_MK, x_scale, x_fmt, w_ENK, w_scale, w_fmt, offs_E, out_dtype)
