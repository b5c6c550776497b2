"""MX dequantisation: OCP MX elements and their E8M0 scales (one per 32 values along the last dim) to a float tensor.

``mx_dequantize(data, scale, fmt, dtype)``: ``data`` ``[..., K / per_byte]`` (fp8 elements, or fp4 two per byte as
``mx_cast`` writes them), ``scale`` ``[..., K / 32]``; the result ``[..., K]`` in ``dtype``, each element times its
block's scale, computed in fp32 and rounded once to ``dtype`` (a NaN scale gives a NaN block). The reference is
``fly_lightning.quant.formats.from_mx``, torchao's arithmetic. Frozen MX weights run through it every step (forward
and backward), as do the MX round trips of MoE experts in training. Not differentiated (MX bytes have no gradient).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fly_lightning.dispatch import register_op
from fly_lightning.ops._eager import TracedOrDirect
from fly_lightning.quant import formats
from fly_lightning.registry import tensor_key

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _validate(data: Tensor, scale: Tensor, fmt: str, dtype: torch.dtype) -> None:
    f = formats.op_format("mx_dequantize", fmt)
    if not isinstance(data, Tensor) or not isinstance(scale, Tensor):
        raise ValueError("mx_dequantize: data and scale must be Tensors")
    if data.dtype not in (torch.uint8, formats.data_dtype(f)):
        want = " or ".join(dict.fromkeys(str(d) for d in (formats.data_dtype(f), torch.uint8)))
        raise ValueError(f"mx_dequantize: {f.name} data must be {want}, got {data.dtype}")
    if scale.dtype not in (torch.uint8, torch.float8_e8m0fnu):
        raise ValueError(f"mx_dequantize: scales must be float8_e8m0fnu or uint8, got {scale.dtype}")
    if dtype not in _DTYPES:
        raise ValueError(f"mx_dequantize: dtype must be one of {[str(d) for d in _DTYPES]}, got {dtype}")
    want = [*scale.shape[:-1], scale.shape[-1] * formats.BLOCK // f.per_byte] if scale.dim() else None
    if data.dim() == 0 or list(data.shape) != want:
        raise ValueError(
            f"mx_dequantize: {fmt} data {list(data.shape)} does not match scales {list(scale.shape)} "
            f"(one per {formats.BLOCK} values along the last dim)"
        )
    if data.device != scale.device:
        raise ValueError(f"mx_dequantize: data on {data.device}, scales on {scale.device}")


def mx_dequantize_reference(data: Tensor, scale: Tensor, fmt: str, dtype: torch.dtype) -> Tensor:
    """``formats.from_mx`` (torchao's arithmetic: fp32 products, one rounding to ``dtype``)."""
    f = formats.as_format(fmt)
    data = data.view(torch.uint8) if f.bits == 4 else data.view(f.torch_dtype)
    return formats.from_mx(data, scale.view(torch.float8_e8m0fnu), f, dtype=dtype)


def _signature(data: Tensor, scale: Tensor, fmt: str, dtype: torch.dtype) -> tuple:
    return (tensor_key(data), tensor_key(scale), fmt, dtype)


MX_DEQUANTIZE = register_op(
    "mx_dequantize",
    reference=mx_dequantize_reference,
    signature=_signature,
    validate=_validate,
    doc="MX dequantisation along K: (data, scale, fmt, dtype) -> values",
)


@torch.library.custom_op("fly::mx_dequantize", mutates_args=())
def mx_dequantize_op(data: Tensor, scale: Tensor, fmt: str, dtype: torch.dtype) -> Tensor:
    """Dispatched dequantisation."""
    return MX_DEQUANTIZE(data, scale, fmt, dtype)


@mx_dequantize_op.register_fake
def _(data: Tensor, scale: Tensor, fmt: str, dtype: torch.dtype) -> Tensor:
    _validate(data, scale, fmt, dtype)
    return data.new_empty([*scale.shape[:-1], scale.shape[-1] * formats.BLOCK], dtype=dtype)


# the custom op where something traces or a tensor subclass is given; eager calls skip its wrapper's host cost
_mx_dequantize_call = TracedOrDirect(mx_dequantize_op, MX_DEQUANTIZE)


def mx_dequantize(data: Tensor, scale: Tensor, fmt: str, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """MX ``data`` with its ``scale`` to ``dtype``, along the last dim (see the module docstring).

    Args:
        data: ``[..., K / per_byte]`` elements: fp8 (``torch.float8_*`` or uint8 bytes), or fp4 packed two per byte.
        scale: ``[..., K / 32]`` E8M0 scales (``torch.float8_e8m0fnu`` or uint8 bytes).
        fmt: ``"mxfp8_e4m3"``, ``"mxfp8_e5m2"`` or ``"mxfp4_e2m1"``.
        dtype: fp32, bf16, fp16 or fp64.
    """
    return _mx_dequantize_call(data, scale, fmt, dtype)
