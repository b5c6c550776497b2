"""Triton MX dequantisation, registered as the ``triton`` backend of ``mx_dequantize``.

The MX GEMMs' prepass kernel (``_mx_dequant.dequantize``: bit placement and power-of-two multiplies, exact, bf16
rounding of the products as ``from_mx``'s ``.to(bfloat16)``; the GPU tests compare it on every code and scale) on
rows of any leading shape: one pass, 1 (fp8) or 0.5 (fp4) byte read and 2 written per element, where the ATen path
goes through fp32 tensors (``from_mx``: four kernels, about 14 bytes per element).
"""

from __future__ import annotations

import torch

from fly_lightning.kernels import outputs
from fly_lightning.kernels.layout import copy_reason
from fly_lightning.kernels.triton._mx_dequant import dequantize
from fly_lightning.kernels.triton._support import ON_HIP, device_reason
from fly_lightning.ops.mx_dequantize import MX_DEQUANTIZE
from fly_lightning.quant import formats


def _rows(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as 2-D rows without a copy, or None."""
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return None


def _supports(data: torch.Tensor, scale: torch.Tensor, fmt: str, dtype: torch.dtype) -> bool | str:
    if (reason := device_reason(data, scale)) is not None:
        return reason
    if ON_HIP:
        return "ROCm (the kernel's bf16 rounding is checked on NVIDIA only)"
    if data.is_cuda and torch.cuda.get_device_capability(data.device) < (8, 0):
        return "GPU older than sm80 (bf16)"
    if dtype != torch.bfloat16:
        return f"{dtype} output (the kernel writes bf16)"
    for name, t in (("data", data), ("scale", scale)):
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            return copy_reason(name, t)
        if _rows(t) is None:
            return copy_reason(name, t, "leading dims not collapsible to rows")
    return True


@MX_DEQUANTIZE.implement(
    "triton",
    supports=_supports,
    constraints="bf16 output; e4m3, e5m2, e2m1 (packed); last dims contiguous, leading dims collapsible to rows; "
    "other dtypes and ROCm on ATen",
)
def mx_dequantize_triton(data: torch.Tensor, scale: torch.Tensor, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    k = scale.shape[-1] * formats.BLOCK
    if data.numel() == 0:
        return outputs.empty(*scale.shape[:-1], k, dtype=dtype, device=data.device)
    out = dequantize(_rows(data).view(torch.uint8), _rows(scale).view(torch.uint8), fmt)
    # under the interpreter the kernel writes the fp32 products (its bf16 rounding is unreliable): rounded here once
    return out.view(*scale.shape[:-1], k).to(dtype)
