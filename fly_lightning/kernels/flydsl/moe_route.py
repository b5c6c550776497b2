"""FlyDSL MoE routing forward for gfx950, registered as the ``flydsl`` backend of ``moe_route`` (compile-verified only).

The kernel computes scores, top-k, renormalisation and per-expert counts; the offsets are their cumsum (one ATen op).
Selection bias, expert groups and the permutation are not in this kernel: those inputs run on another backend.
"""

from __future__ import annotations

import torch

from fly_lightning.kernels import outputs
from fly_lightning.kernels.flydsl import _moe_route_kernel as kernel
from fly_lightning.kernels.layout import copy_reason
from fly_lightning.ops.moe_route import MOE_ROUTE


def _supports(logits_TE, k, score, renormalize, bias_E, route_scale, n_groups, topk_groups, return_permutation):
    if logits_TE.device.type != "cuda" or torch.version.hip is None:
        return "tensor not on a ROCm device"
    if bias_E is not None or n_groups is not None:
        return "selection bias / expert groups not implemented"
    if return_permutation:
        return "permutation not implemented"
    if logits_TE.shape[1] > 1 and logits_TE.stride(1) != 1:
        return copy_reason("logits", logits_TE)
    ok, reason = kernel.supports(logits_TE.shape[-1], k, logits_TE.dtype, score)
    return True if ok else reason


@MOE_ROUTE.implement(
    "flydsl",
    supports=_supports,
    constraints="gfx950; logits fp32/bf16/fp16, E <= 256, k <= 8, softmax/sigmoid, renormalise optional, counts; "
    "no bias, groups or permutation",
    verified="compile-only",
)
def moe_route_flydsl(logits_TE, k, score, renormalize, bias_E, route_scale, n_groups, topk_groups, return_permutation):
    weights, ids, counts = kernel.launch_moe_route(logits_TE, k, score, renormalize, with_counts=True)
    if route_scale != 1.0:
        weights = weights * route_scale
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    sorted_slots = outputs.empty(0, dtype=ids.dtype, device=ids.device)  # no permutation: two empty outputs,
    slot_pos = outputs.empty(0, dtype=ids.dtype, device=ids.device)  # not one twice (outputs may not alias)
    return weights, ids, counts, offsets, sorted_slots, slot_pos
