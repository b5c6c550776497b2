"""FlyDSL MX GEMM for gfx950, the ``flydsl`` backend of ``mx_scaled_mm`` (compile-verified only).

Both operands MX (``mxfp8_e4m3``, ``mxfp8_e5m2``, ``mxfp4_e2m1``, formats may differ), E8M0 scales per 32 along K
applied by the scaled MFMA ``v_mfma_scale_f32_16x16x128_f8f6f4`` (kernel in ``_mx_scaled_mm_kernel``). Weight-only
calls (bf16/fp32 ``a``) and everything else the predicate refuses run on ATen with the reason recorded.
"""

from __future__ import annotations

import torch

from fly_lightning.dispatch import record_fallback
from fly_lightning.kernels.flydsl import _mx_scaled_mm_kernel as kernel
from fly_lightning.kernels.layout import copy_reason
from fly_lightning.ops.mx_scaled_mm import MX_SCALED_MM


def device_arch(device: torch.device) -> str | None:
    """The ROCm architecture name of ``device`` (``gfx950``, ``gfx942``, ...), or None when torch cannot tell."""
    try:
        return torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]
    except (RuntimeError, AssertionError, AttributeError):
        return None


def alignment_reason(*named: tuple[str, torch.Tensor, int]) -> str | None:
    """Why ``(name, tensor, bytes)`` operands are not aligned as the kernels load them (16-byte data loads; scales
    as one or two dwords per K stage; int32 offsets), or None. Checked on every call as well as in the support
    predicate: the dispatcher caches its decision per shape, strides and dtypes, not per address."""
    for name, t, align in named:
        if t.data_ptr() % align:
            return f"{name} not {align}-byte aligned"
    return None


def run_or_fallback(op, reason: str | None, args: tuple, launch) -> torch.Tensor:
    """``launch(*args)``, or, for operands misaligned on this call (``reason``), ATen, the fallback counted and
    logged with its reason."""
    if reason is None:
        return launch(*args)
    record_fallback(op, ("flydsl", reason), args, f"flydsl: {reason} on this call (ATen ran)")
    return op.impls["aten"].fn(*args)


def layout_reason(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    a_fmt: str | None,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    b_fmt: str,
    out_dtype: torch.dtype,
) -> str | None:
    """Why the FlyDSL kernel cannot compute ``mx_scaled_mm`` on these (validated) operands, or None."""
    for t in (a, b):
        if t.device.type != "cuda" or torch.version.hip is None:
            return "tensor not on a ROCm device"
    arch = device_arch(a.device)
    if arch is not None and arch != kernel.compile_check.TARGET_ARCH:
        return f"device is {arch} (the kernel uses gfx950-only scaled MFMA v_mfma_scale_f32_16x16x128_f8f6f4)"
    if a_fmt is None:
        return "a is high precision (weight-only MX): the scaled MFMA needs both operands in MX formats"
    for name, t in (("a", a), ("a_scale", a_scale), ("b", b), ("b_scale", b_scale)):
        if not t.is_contiguous():
            return copy_reason(name, t, "not contiguous")
    if reason := alignment_reason(("a", a, 16), ("a_scale", a_scale, 8), ("b", b, 16), ("b_scale", b_scale, 8)):
        return reason
    k = b.shape[1] * 8 // kernel.FORMATS[b_fmt][0] if b_fmt in kernel.FORMATS else 0
    ok, reason = kernel.supports(a.shape[0], b.shape[0], k, a_fmt, b_fmt, out_dtype)
    return None if ok else reason


def _supports(a, a_scale, a_fmt, b, b_scale, b_fmt, out_dtype) -> bool | str:
    return layout_reason(a, a_scale, a_fmt, b, b_scale, b_fmt, out_dtype) or True


@MX_SCALED_MM.implement(
    "flydsl",
    supports=_supports,
    constraints="gfx950; a [M, K] and b [N, K] both MX (e4m3, e5m2, e2m1 packed; formats may differ), E8M0 scales "
    "[rows, K/32], all contiguous; K % 128 == 0, N % 4 == 0; each tensor under 2 GiB; out bf16/fp16/fp32; scaled "
    "MFMA 16x16x128 (scales applied in the instruction), 128x128 or 64x128 tiles; weight-only (bf16 a) on ATen",
    verified="compile-only",
)
def mx_scaled_mm_flydsl(a, a_scale, a_fmt, b, b_scale, b_fmt, out_dtype) -> torch.Tensor:
    reason = alignment_reason(("a", a, 16), ("a_scale", a_scale, 8), ("b", b, 16), ("b_scale", b_scale, 8))
    args = (a, a_scale, a_fmt, b, b_scale, b_fmt, out_dtype)
    return run_or_fallback(MX_SCALED_MM, reason, args, kernel.launch_mx_scaled_mm)
