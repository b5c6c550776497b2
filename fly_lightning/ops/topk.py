"""Top-k along the last dimension (largest, sorted): ``torch.topk`` for small k, with deterministic ties.

Forward is dispatched (Triton / ATen); backward scatters the value gradient through existing ATen ops.

Semantics (the reference below is the oracle): values in descending order; equal values rank the lower index first
(``torch.topk`` leaves their order unspecified); NaN ranks above every number as in ``torch.topk``, several NaN by
lower index; -0.0 and +0.0 are equal (values keep their bits). Indices are int64.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from fly_lightning.dispatch import register_op
from fly_lightning.ops._eager import EagerCall
from fly_lightning.registry import scalar_key, tensor_key


class TopK(NamedTuple):
    values: Tensor
    indices: Tensor


def _validate(x: Tensor, k: int) -> None:
    if not isinstance(x, Tensor):
        raise ValueError(f"topk: x must be a Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError("topk: x must have at least one dimension (the one searched)")
    if x.dtype.is_complex or x.dtype == torch.bool:
        raise ValueError(f"topk: x must be real and ordered, got {x.dtype}")
    if isinstance(k, bool) or not isinstance(k, int):
        raise ValueError(f"topk: k must be an int, got {type(k).__name__}")
    if not 0 <= k <= x.shape[-1]:
        raise ValueError(f"topk: k={k} must be in [0, {x.shape[-1]}] (the size of the last dimension)")


def topk_reference(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Plain-torch reference and oracle: a stable descending sort, first ``k``."""
    values, indices = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[..., :k].contiguous(), indices[..., :k].contiguous()


def _signature(x: Tensor, k: int) -> tuple:
    return (tensor_key(x), scalar_key(k))


TOPK = register_op(
    "topk",
    reference=topk_reference,
    signature=_signature,
    validate=_validate,
    doc="top-k along the last dim, largest first, ties by lower index; (x, k) -> (values, int64 indices)",
)


@torch.library.custom_op("fly::topk", mutates_args=())
def topk_op(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Dispatched forward: ``(values, indices)``."""
    return TOPK(x, k)


@topk_op.register_fake
def _(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    _validate(x, k)
    shape = (*x.shape[:-1], k)
    return x.new_empty(shape), x.new_empty(shape, dtype=torch.int64)


def _setup_context(ctx, inputs, output) -> None:
    x, _ = inputs
    ctx.save_for_backward(output[1])
    ctx.x_meta = (x.shape, x.dtype)


def _backward(ctx, grad_values: Tensor, grad_indices: Tensor | None):
    (indices,) = ctx.saved_tensors
    shape, dtype = ctx.x_meta
    grad_x = grad_values.new_zeros(shape, dtype=dtype).scatter(-1, indices, grad_values.to(dtype))
    return grad_x, None


_topk_eager = EagerCall(TOPK, topk_op, _setup_context, _backward)


def topk(x: Tensor, k: int) -> TopK:
    """The ``k`` largest values along the last dimension, sorted, and their int64 indices (like ``torch.topk``).

    Ties rank the lower index first and NaN ranks highest (see the module docstring). Small ``k`` (<= 16) on
    fp32/bf16/fp16 rows of up to 1024 elements runs the Triton kernel; everything else runs ATen with the same
    semantics.
    """
    return TopK(*_topk_eager(x, k))
