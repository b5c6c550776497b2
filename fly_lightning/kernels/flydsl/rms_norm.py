"""FlyDSL RMSNorm forward for gfx950, registered as the ``flydsl`` backend of ``rms_norm`` (compile-verified only)."""

from __future__ import annotations

import torch

from fly_lightning.kernels.flydsl import _rms_norm_kernel as kernel
from fly_lightning.kernels.layout import copy_reason
from fly_lightning.ops.rms_norm import RMS_NORM


def _supports(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, cast: bool) -> bool | str:
    if x.device.type != "cuda" or torch.version.hip is None:
        return "tensor not on a ROCm device"
    if cast and weight is not None:
        return "Llama-style cast before scale not implemented"
    if x.numel() == 0:
        return "empty input"
    if weight is not None and weight.numel() > 1 and weight.stride(0) != 1:
        return copy_reason("weight", weight, "not contiguous")
    try:
        x2 = x.view(-1, x.shape[-1])
    except RuntimeError:
        return "leading dims not collapsible to rows (would need a copy)"
    ok, reason = kernel.supports(
        x.shape[-1], x.dtype, weight is not None, None if weight is None else weight.dtype, tuple(x2.stride())
    )
    return True if ok else reason


@RMS_NORM.implement(
    "flydsl",
    supports=_supports,
    constraints="gfx950; x bf16/fp16/fp32, weight same dtype or fp32; H <= 2^20; last dim contiguous; 16-byte "
    "vector path when H and row stride are multiples of the vector width, scalar path otherwise; no Llama cast",
    verified="compile-only",
)
def rms_norm_flydsl(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, cast_before_scale: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    h = x.shape[-1]
    y, rstd = kernel.launch_rms_norm(x.view(-1, h), weight, eps, offset)
    return y.view(x.shape), rstd.view(*x.shape[:-1], 1)
