"""Triton MX grouped GEMM forward, registered as the ``triton`` backend of ``mx_grouped_mm`` (kernel and launcher:
``_mx_grouped_mm_kernel``): MX tiles dequantised to bf16 in registers, bf16 ``tl.dot`` with fp32 accumulation, the
ragged tile schedule of the bf16 grouped GEMM read from the device offsets (no host sync); with many rows per group,
x (or both operands, from 1024 rows per group) dequantised once in memory first."""

from __future__ import annotations

import torch

from fly_lightning.kernels import outputs
from fly_lightning.kernels.layout import copy_reason
from fly_lightning.kernels.triton import _mx_grouped_mm_kernel as mk
from fly_lightning.kernels.triton._support import ON_HIP, device_reason
from fly_lightning.kernels.triton.grouped_mm import MAX_GROUPS  # each program loads all offsets as one vector
from fly_lightning.ops.mx_grouped_mm import MX_GROUPED_MM
from fly_lightning.quant import formats

K_MULTIPLE = 128  # the fast MX kernels' boundary (as PyTorch's MX path); every block_k divides it


def _contiguous_rows(name: str, t: torch.Tensor | None) -> str | None:
    if t is not None and t.shape[-1] > 1 and t.stride(-1) != 1:
        return copy_reason(name, t)
    return None


def _supports(x, x_scale, x_fmt, w, w_scale, w_fmt, offs, out_dtype) -> bool | str:
    if (reason := device_reason(x, x_scale, w, w_scale, offs)) is not None:
        return reason
    if ON_HIP:
        return "ROCm: the kernel is not compiled or checked for gfx950 (its FlyDSL peer is the AMD path)"
    if x.is_cuda and torch.cuda.get_device_capability(x.device) < (8, 0):
        return "GPU older than sm80 (bf16 dot)"
    k = w_scale.shape[2] * formats.BLOCK
    if k % K_MULTIPLE:
        return f"K={k} not a multiple of {K_MULTIPLE}"
    for name, t in (("x", x), ("x_scale", x_scale), ("w", w), ("w_scale", w_scale)):
        if (reason := _contiguous_rows(name, t)) is not None:
            return reason
    if offs.numel() > 1 and offs.stride(0) != 1:
        return copy_reason("offs", offs, "not contiguous")
    if w.shape[0] > MAX_GROUPS:
        return f"{w.shape[0]} groups (kernel takes at most {MAX_GROUPS})"
    return True


@MX_GROUPED_MM.implement(
    "triton",
    supports=_supports,
    constraints="x [M, K] MX (e4m3, e5m2, e2m1) or bf16/fp32 (rounded to bf16) x MX w [E, N, K] (blocks along K), "
    "int32 end offsets, E <= 4096, K % 128 == 0, last dims contiguous, sm80+; MX tiles dequantised to bf16 in "
    "registers, bf16 dot, fp32 accumulation; MX x on Hopper below 1024 rows per group: x alone "
    "dequantised to bf16 first (a bf16 copy of x during the call), weights converted as the MMA's register operand; "
    "MX x from 1024 rows per group (from 256 off Hopper): both dequantised to bf16 in a prepass (a bf16 copy of x and "
    "w during the call), then the bf16 grouped GEMM; not on ROCm",
)
def mx_grouped_mm_triton(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    x_fmt: str | None,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    w_fmt: str,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
    config: mk.MXGroupedMMConfig | None = None,
) -> torch.Tensor:
    # rows at and past the last offset stay unwritten, as torch's grouped GEMM leaves them
    out = outputs.empty(x.shape[0], w.shape[1], dtype=out_dtype, device=x.device, written_in_full=False)
    return mk.launch(x, x_scale, x_fmt, w, w_scale, w_fmt, offs, out, config=config)
