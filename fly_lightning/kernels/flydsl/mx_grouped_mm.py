"""FlyDSL MX grouped GEMM for gfx950, the ``flydsl`` backend of ``mx_grouped_mm`` (compile-verified only).

The MX GEMM kernel's grouped form (``_mx_scaled_mm_kernel``, ``Plan.E``): both operands MX, scales applied by the
scaled MFMA, each workgroup's expert and rows read from the int32 end offsets on the device (no host sync).
Weight-only calls (bf16/fp32 ``x``) and everything else the predicate refuses run on ATen with the reason recorded.
"""

from __future__ import annotations

import torch

from fly_lightning.kernels.flydsl import _mx_scaled_mm_kernel as kernel
from fly_lightning.kernels.flydsl.mx_scaled_mm import alignment_reason, device_arch, run_or_fallback
from fly_lightning.kernels.layout import copy_reason
from fly_lightning.ops.mx_grouped_mm import MX_GROUPED_MM


def _alignment(x, x_scale, w, w_scale, offs) -> str | None:
    return alignment_reason(
        ("x", x, 16), ("x_scale", x_scale, 8), ("w", w, 16), ("w_scale", w_scale, 8), ("offs", offs, 4)
    )


def layout_reason(x, x_scale, x_fmt, w, w_scale, w_fmt, offs, out_dtype) -> str | None:
    """Why the FlyDSL kernel cannot compute ``mx_grouped_mm`` on these (validated) operands, or None."""
    for t in (x, w, offs):
        if t.device.type != "cuda" or torch.version.hip is None:
            return "tensor not on a ROCm device"
    arch = device_arch(x.device)
    if arch is not None and arch != kernel.compile_check.TARGET_ARCH:
        return f"device is {arch} (the kernel uses gfx950-only scaled MFMA {kernel.MFMA})"
    if x_fmt is None:
        return "x is high precision (weight-only MX): the scaled MFMA needs both operands in MX formats"
    for name, t in (("x", x), ("x_scale", x_scale), ("w", w), ("w_scale", w_scale), ("offs", offs)):
        if not t.is_contiguous():
            return copy_reason(name, t, "not contiguous")
    if (reason := _alignment(x, x_scale, w, w_scale, offs)) is not None:
        return reason
    k = w.shape[2] * 8 // kernel.FORMATS[w_fmt][0] if w_fmt in kernel.FORMATS else 0
    ok, reason = kernel.supports(x.shape[0], w.shape[1], k, x_fmt, w_fmt, out_dtype, w.shape[0])
    return None if ok else reason


def _supports(x, x_scale, x_fmt, w, w_scale, w_fmt, offs, out_dtype) -> bool | str:
    return layout_reason(x, x_scale, x_fmt, w, w_scale, w_fmt, offs, out_dtype) or True


@MX_GROUPED_MM.implement(
    "flydsl",
    supports=_supports,
    constraints="gfx950; x [M, K] and w [E, N, K] both MX (e4m3, e5m2, e2m1 packed; formats may differ), E8M0 "
    "scales [M, K/32] and [E, N, K/32], all contiguous; int32 end offsets read on the device, E <= 1024; K % 128 == "
    "0, N % 4 == 0; each tensor under 2 GiB; out bf16/fp16/fp32; scaled MFMA 16x16x128 (scales applied in the "
    "instruction), 128x128 or 64x128 tiles; weight-only (bf16 x) on ATen",
    verified="compile-only",
)
def mx_grouped_mm_flydsl(x, x_scale, x_fmt, w, w_scale, w_fmt, offs, out_dtype) -> torch.Tensor:
    args = (x, x_scale, x_fmt, w, w_scale, w_fmt, offs, out_dtype)
    return run_or_fallback(MX_GROUPED_MM, _alignment(x, x_scale, w, w_scale, offs), args, kernel.launch_mx_grouped_mm)
