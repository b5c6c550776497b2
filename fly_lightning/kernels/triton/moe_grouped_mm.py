"""Triton backend of ``moe_grouped_mm``: the grouped GEMM kernel with its gather (A rows read through the routing
permutation) and scatter (output rows written to their slots) modes."""

from __future__ import annotations

import torch

from fly_lightning.kernels import outputs
from fly_lightning.kernels.triton import _grouped_mm_kernel as gk
from fly_lightning.kernels.triton.grouped_mm import layout_reason
from fly_lightning.ops.moe_grouped_mm import MOE_GROUPED_MM


def _supports(
    x: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor,
    perm: torch.Tensor,
    topk: int,
    gather: bool,
    scatter: bool,
    out_dtype: torch.dtype | None,
) -> bool | str:
    if (reason := layout_reason(x, w, offs)) is not None:
        return reason
    if perm.stride(0) != 1 and perm.numel() > 1:
        return "perm not contiguous"
    return True


@MOE_GROUPED_MM.implement(
    "triton",
    supports=_supports,
    constraints="as grouped_mm, plus a contiguous int32 permutation; rows gathered by token and/or scattered to "
    "slot order inside the GEMM",
)
def moe_grouped_mm_triton(
    x: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor,
    perm: torch.Tensor,
    topk: int,
    gather: bool,
    scatter: bool,
    out_dtype: torch.dtype | None,
    config: gk.GroupedMMConfig | None = None,
) -> torch.Tensor:
    # every row: the contract has offs[-1] == M (every row belongs to an expert)
    out = outputs.empty(perm.shape[0], w.shape[2], dtype=out_dtype or x.dtype, device=x.device)
    return gk.launch(x, w, offs, out, idx=perm, topk=topk, gather=gather, scatter=scatter, config=config,
                     may_tune=config is None)  # fmt: skip
