"""FlyDSL grouped GEMM forward for gfx950, the ``flydsl`` backend of ``grouped_mm`` (compile-verified only).

The kernel (``_grouped_mm_kernel``) reads the int32 end offsets on the device (clamped to ``[0, M]`` and made
non-decreasing, as the Triton kernel reads them): no host sync. Backward stays on ATen (the op's own backward).
"""

from __future__ import annotations

import torch

from fly_lightning.kernels.flydsl import _grouped_mm_kernel as kernel
from fly_lightning.kernels.layout import copy_reason
from fly_lightning.ops.grouped_mm import GROUPED_MM


def device_arch(device: torch.device) -> str | None:
    """The ROCm architecture name of ``device`` (``gfx950``, ``gfx942``, ...), or None when torch cannot tell."""
    try:
        return torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]
    except (RuntimeError, AssertionError, AttributeError):
        return None


def layout_reason(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype | None) -> str | None:
    """Why the FlyDSL kernel cannot compute ``grouped_mm(x, w, offs)``, or None."""
    for t in (x, w, offs):
        if t.device.type != "cuda" or torch.version.hip is None:
            return "tensor not on a ROCm device"
    arch = device_arch(x.device)
    if arch is not None and arch != kernel.compile_check.TARGET_ARCH:
        return f"device is {arch} (the kernel uses gfx950-only 16x16x32 MFMA)"
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {x.dtype} (kernel takes bfloat16/float16)"
    m, k = x.shape
    if m > 1 and k > 1 and x.stride() != (k, 1):
        return copy_reason("x", x, "not contiguous")
    k_major = kernel.weight_layout(w)
    if k_major is None:
        return f"w strides {tuple(w.stride())}: neither N- nor K-contiguous dense experts"
    if offs.numel() > 1 and offs.stride(0) != 1:
        return copy_reason("offs", offs, "not contiguous")
    ok, reason = kernel.supports(k, w.shape[2], w.shape[0], x.dtype, out_dtype, k_major, m)
    return None if ok else reason


def _supports(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype | None) -> bool | str:
    return layout_reason(x, w, offs, out_dtype) or True


@GROUPED_MM.implement(
    "flydsl",
    supports=_supports,
    constraints="gfx950; x [M, K] bf16/fp16 contiguous x w [E, K, N] dense per expert, N- or K-contiguous; int32 "
    "end offsets (empty groups allowed), E <= 1024; K and N multiples of 8; x, w, out each under 2 GiB; out dtype = "
    "input or fp32; 16x16x32 bf16/f16 MFMA, 128x128 or 64x128 tiles, BK 64",
    verified="compile-only",
)
def grouped_mm_flydsl(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype | None
) -> torch.Tensor:
    return kernel.launch_grouped_mm(x, w, offs, out_dtype)
