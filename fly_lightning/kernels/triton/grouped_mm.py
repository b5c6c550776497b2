"""Triton grouped GEMM forward, registered as the ``triton`` backend of ``grouped_mm`` (kernel: ``_grouped_mm_kernel``).

Unaligned strides (K or N not a multiple of 16 bytes, unaligned data) take the kernel's plain-pointer path instead
of TMA; they are supported, not rejected.
"""

from __future__ import annotations

import torch

from fly_lightning.kernels import outputs
from fly_lightning.kernels.triton import _grouped_mm_kernel as gk
from fly_lightning.kernels.triton._support import device_reason
from fly_lightning.ops.grouped_mm import GROUPED_MM

_DTYPES = (torch.bfloat16, torch.float16)
MAX_GROUPS = 4096  # the kernel loads all offsets as one vector


def layout_reason(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> str | None:
    """Device, dtype and layout checks shared by the grouped GEMM kernels, or None."""
    if (reason := device_reason(x, w, offs)) is not None:
        return reason
    if x.dtype not in _DTYPES:
        return f"dtype {x.dtype} (kernel takes bfloat16/float16)"
    if x.is_cuda and torch.cuda.get_device_capability(x.device) < (8, 0):
        return "GPU older than sm80"
    if x.shape[1] > 1 and x.stride(1) != 1:
        return "x rows not contiguous (x.stride(1) != 1)"
    if w.stride(2) != 1 and w.stride(1) != 1:  # also for K or N == 1: the kernel takes the other stride as 1
        return "w has neither N nor K contiguous"
    if offs.numel() > 1 and offs.stride(0) != 1:
        return "offs not contiguous"  # the tile schedule reads it as a dense vector
    if w.shape[0] > MAX_GROUPS:
        return f"{w.shape[0]} groups (kernel takes at most {MAX_GROUPS})"
    return None


def _supports(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype | None) -> bool | str:
    return layout_reason(x, w, offs) or True


@GROUPED_MM.implement(
    "triton",
    supports=_supports,
    constraints="x [M, K] bf16/fp16 (K contiguous) x w [E, K, N] (N- or K-contiguous), int32 end offsets, E <= "
    "4096, sm80+; TMA loads when strides are 16-byte aligned (Hopper), masked pointer loads otherwise (and on ROCm: "
    "gfx950 compile-checked, never run)",
)
def grouped_mm_triton(
    x: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype | None,
    config: gk.GroupedMMConfig | None = None,
) -> torch.Tensor:
    # rows at and past the last offset stay unwritten, as torch's (deterministic mode's fill kept for them)
    out = outputs.empty(x.shape[0], w.shape[2], dtype=out_dtype or x.dtype, device=x.device, written_in_full=False)
    # FLY_LIGHTNING_GROUPED_MM_TUNE=1: measured once per shape class when a signature is first planned (gk.launch)
    return gk.launch(x, w, offs, out, config=config, may_tune=config is None)
