"""Grouped GEMM that reads token rows and writes slot rows through the routing permutation (MoE dispatch/combine).

With ``perm`` the routing's stable permutation (``perm[r]`` = slot ``t * topk + j`` of the r-th row in expert order):

- ``gather=True``: row r of the product reads ``x[perm[r] // topk]`` from the un-permuted tokens ``x [T, K]``
  (no permuted copy of the activations);
- ``scatter=True``: row r of the product is written to row ``perm[r]`` of the output, i.e. the output is in slot
  order ``[T * topk, N]`` (no un-permute copy);
- neither: plain ``grouped_mm``.

Contract (checked on the CPU only; on a GPU the host never reads the indices): ``perm`` is a permutation of
``range(M)`` and ``offs[-1] == M`` (every row belongs to an expert), ``M = T * topk`` when gathering.

Backward runs ``torch._grouped_mm`` (or the reference), never the kernel. The input gradient of a gather is summed
over each token's ``topk`` slots in a fixed order (no atomics): deterministic.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fly_lightning.dispatch import register_op
from fly_lightning.ops._eager import EagerCall, TracedOrDirect, create_graph_grads
from fly_lightning.ops.grouped_mm import (
    _FLOATS,
    _aten_mm,
    _check_offsets,
    _fake,
    _grouped_mm_aten,
    autocast_operands,
    grouped_mm_reference,
    weight_grad,
    weight_grad_like,
)
from fly_lightning.ops.moe_combine import MOE_COMBINE
from fly_lightning.ops.permutation import check_permutation, inverse_permutation
from fly_lightning.registry import scalar_key, tensor_key


def _validate_moe(
    x: Tensor,
    w: Tensor,
    offs: Tensor,
    perm: Tensor,
    topk: int,
    gather: bool,
    scatter: bool,
    out_dtype: torch.dtype | None,
) -> None:
    if not isinstance(offs, Tensor):
        raise ValueError("moe_grouped_mm: offs must be a Tensor")
    if not isinstance(perm, Tensor) or perm.dtype != torch.int32 or perm.dim() != 1:
        raise ValueError(f"moe_grouped_mm: perm must be a 1-D int32 tensor, got {getattr(perm, 'dtype', perm)}")
    if not isinstance(x, Tensor) or x.dim() != 2:
        raise ValueError("moe_grouped_mm: x must be a 2-D tensor")
    if perm.device != x.device:
        raise ValueError(f"moe_grouped_mm: perm on {perm.device}, x on {x.device}")
    # a SymInt under torch.compile(dynamic=True), where k comes from a tensor's shape
    if isinstance(topk, bool) or not isinstance(topk, (int, torch.SymInt)) or topk < 1:
        raise ValueError(f"moe_grouped_mm: topk must be a positive int, got {topk!r}")
    m = perm.shape[0]
    if gather and x.shape[0] * topk != m:
        raise ValueError(f"moe_grouped_mm: gathering needs perm of length T*topk = {x.shape[0]}*{topk}, got {m}")
    if not gather and x.shape[0] != m:
        raise ValueError(f"moe_grouped_mm: x has {x.shape[0]} rows but perm has {m}")
    if scatter and m % topk:
        raise ValueError(f"moe_grouped_mm: scattering needs M={m} divisible by topk={topk}")
    _validate_shapes(x, w, offs, out_dtype)


def _validate_shapes(x: Tensor, w: Tensor, offs: Tensor, out_dtype: torch.dtype | None) -> None:
    """grouped_mm's checks except the offsets-vs-rows bound (x has T rows when gathering, the problem M rows)."""
    if not isinstance(w, Tensor) or w.dim() != 3 or w.shape[0] < 1:
        raise ValueError(f"moe_grouped_mm: w must be 3-D [E >= 1, K, N], got {getattr(w, 'shape', w)}")
    if x.dtype not in _FLOATS or w.dtype != x.dtype:
        raise ValueError(f"moe_grouped_mm: x and w must share a float dtype, got {x.dtype} and {w.dtype}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"moe_grouped_mm: contraction dims differ: x is {list(x.shape)}, w is {list(w.shape)}")
    if offs.dtype != torch.int32 or offs.dim() != 1 or offs.shape[0] != w.shape[0]:
        raise ValueError(
            f"moe_grouped_mm: offs must be int32 of shape [{w.shape[0]}], got {offs.dtype} {list(offs.shape)}"
        )
    if x.device != w.device or x.device != offs.device:
        raise ValueError(f"moe_grouped_mm: x on {x.device}, w on {w.device}, offs on {offs.device}: must match")
    if out_dtype is not None and out_dtype not in (x.dtype, torch.float32):
        raise ValueError(f"moe_grouped_mm: out_dtype must be None, {x.dtype} or torch.float32, got {out_dtype}")


def _check_perm(
    x: Tensor,
    w: Tensor,
    offs: Tensor,
    perm: Tensor,
    topk: int,
    gather: bool,
    scatter: bool,
    out_dtype: torch.dtype | None,
) -> None:
    """CPU-only value checks of the contract, on every call (never a device sync)."""
    m = perm.shape[0]
    if perm.device.type != "cpu" or torch.compiler.is_compiling() or _fake(perm) or _fake(offs):
        return
    _check_offsets(offs, m, "moe_grouped_mm")
    if offs.numel() and int(offs[-1]) != m:
        raise ValueError(f"moe_grouped_mm: offs[-1]={int(offs[-1])} must equal the number of rows M={m}")
    check_permutation(perm, "moe_grouped_mm: perm")


def moe_grouped_mm_reference(
    x: Tensor,
    w: Tensor,
    offs: Tensor,
    perm: Tensor,
    topk: int,
    gather: bool,
    scatter: bool,
    out_dtype: torch.dtype | None = None,
    mm=grouped_mm_reference,
) -> Tensor:
    """Gather, grouped GEMM (``mm``), scatter: the oracle (and, with ``mm`` = ATen, the ATen path)."""
    p = perm.long()
    xs = x.index_select(0, p // topk) if gather else x
    out = mm(xs, w, offs, out_dtype)
    if scatter:  # out_slots[perm[r]] = out[r], as a gather
        return out.index_select(0, inverse_permutation(perm).long())
    return out


def _moe_aten(
    x: Tensor,
    w: Tensor,
    offs: Tensor,
    perm: Tensor,
    topk: int,
    gather: bool,
    scatter: bool,
    out_dtype: torch.dtype | None,
) -> Tensor:
    return moe_grouped_mm_reference(x, w, offs, perm, topk, gather, scatter, out_dtype, mm=_grouped_mm_aten)


def _signature(
    x: Tensor,
    w: Tensor,
    offs: Tensor,
    perm: Tensor,
    topk: int,
    gather: bool,
    scatter: bool,
    out_dtype: torch.dtype | None,
) -> tuple:
    return (
        tensor_key(x),
        tensor_key(w),
        tensor_key(offs),
        tensor_key(perm),
        scalar_key(topk),
        gather,
        scatter,
        out_dtype,
    )


MOE_GROUPED_MM = register_op(
    "moe_grouped_mm",
    reference=moe_grouped_mm_reference,
    aten=_moe_aten,
    signature=_signature,
    validate=_validate_moe,
    check=_check_perm,
    doc="grouped GEMM reading token rows / writing slot rows through the routing permutation",
)


@torch.library.custom_op("fly::moe_grouped_mm", mutates_args=())
def moe_grouped_mm_op(
    x: Tensor,
    w: Tensor,
    offs: Tensor,
    perm: Tensor,
    topk: int,
    gather: bool,
    scatter: bool,
    out_dtype: torch.dtype | None,
) -> Tensor:
    """Dispatched forward."""
    return MOE_GROUPED_MM(x, w, offs, perm, topk, gather, scatter, out_dtype)


@moe_grouped_mm_op.register_fake
def _(
    x: Tensor,
    w: Tensor,
    offs: Tensor,
    perm: Tensor,
    topk: int,
    gather: bool,
    scatter: bool,
    out_dtype: torch.dtype | None,
) -> Tensor:
    _validate_moe(x, w, offs, perm, topk, gather, scatter, out_dtype)
    return x.new_empty((perm.shape[0], w.shape[2]), dtype=out_dtype or x.dtype)


def moe_grouped_mm_backward(
    grad: Tensor,
    x: Tensor,
    w: Tensor,
    offs: Tensor,
    perm: Tensor,
    topk: int,
    gather: bool,
    scatter: bool,
    need_x: bool = True,
    need_w: bool = True,
) -> tuple[Tensor | None, Tensor | None]:
    p = perm.long()
    g = grad.to(x.dtype)
    g = g.index_select(0, p) if scatter else g.contiguous()  # back to expert order
    xs = x.index_select(0, p // topk) if gather else x
    dw = weight_grad(xs, g, offs, w) if need_w else None
    dx = None
    if need_x:
        dxs = _aten_mm(g, w.transpose(-2, -1), offs)
        if gather:  # each token's topk slot gradients summed in slot order, in fp32: the combine's forward, unweighted
            ones = torch.ones(x.shape[0], topk, dtype=torch.float32, device=x.device)
            dx = MOE_COMBINE(dxs, ones, inverse_permutation(perm), x.dtype)
        else:
            dx = dxs
    return dx, dw


def _moe_grouped_mm_backward_impl(
    grad: Tensor,
    x: Tensor,
    w: Tensor,
    offs: Tensor,
    perm: Tensor,
    topk: int,
    gather: bool,
    scatter: bool,
    need_x: bool,
    need_w: bool,
) -> tuple[Tensor, Tensor]:
    """``(dx, dw)`` as an opaque op (see ``grouped_mm_backward_op``); an unneeded gradient is an empty ``[0]``."""
    dx, dw = moe_grouped_mm_backward(grad, x, w, offs, perm, topk, gather, scatter, need_x, need_w)
    return (x.new_empty(0) if dx is None else dx), (w.new_empty(0) if dw is None else dw)


moe_grouped_mm_backward_op = torch.library.custom_op("fly::moe_grouped_mm_backward", mutates_args=())(
    _moe_grouped_mm_backward_impl
)
moe_grouped_mm_backward_call = TracedOrDirect(moe_grouped_mm_backward_op, _moe_grouped_mm_backward_impl)
"""The backward as a call: the custom op where something traces, else its implementation (no wrapper host cost)."""


@moe_grouped_mm_backward_op.register_fake
def _(
    grad: Tensor,
    x: Tensor,
    w: Tensor,
    offs: Tensor,
    perm: Tensor,
    topk: int,
    gather: bool,
    scatter: bool,
    need_x: bool,
    need_w: bool,
) -> tuple[Tensor, Tensor]:
    dx = x.new_empty(x.shape) if need_x else x.new_empty(0)
    return dx, (weight_grad_like(w) if need_w else w.new_empty(0))


def _setup_context(ctx, inputs, output) -> None:
    x, w, offs, perm, topk, gather, scatter, _ = inputs
    ctx.save_for_backward(x, w, offs, perm)
    ctx.topk, ctx.gather, ctx.scatter = topk, gather, scatter


def _backward(ctx, grad: Tensor):
    x, w, offs, perm = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if torch.is_grad_enabled():  # create_graph=True: the fast formula's token sum is a kernel, not differentiable
        args = (x, w, offs, perm, ctx.topk, ctx.gather, ctx.scatter)
        needs = (need_x, need_w, False, False, False, False, False)
        return (
            *create_graph_grads(moe_grouped_mm_reference, args, needs, (grad,))[:2],
            None,
            None,
            None,
            None,
            None,
            None,
        )
    dx, dw = moe_grouped_mm_backward_call(grad, x, w, offs, perm, ctx.topk, ctx.gather, ctx.scatter, need_x, need_w)
    return (dx if need_x else None), (dw if need_w else None), None, None, None, None, None, None


_moe_grouped_mm_eager = EagerCall(MOE_GROUPED_MM, moe_grouped_mm_op, _setup_context, _backward)


def moe_grouped_mm(
    x: Tensor,
    w: Tensor,
    offs_E: Tensor,
    perm_M: Tensor,
    *,
    topk: int,
    gather: bool = False,
    scatter: bool = False,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """``grouped_mm`` that gathers its rows from tokens and/or scatters them to slots through ``perm``.

    Args:
        x: ``[T, K]`` tokens when ``gather``, else ``[M, K]`` rows in expert order.
        w: ``[E, K, N]`` expert weights (N- or K-contiguous).
        offs_E: int32 group end offsets, ``offs[-1] == M``.
        perm_M: int32 ``[M]``: the slot (``t * topk + j``) of each expert-ordered row; a permutation of ``range(M)``.
        topk: experts per token.
        gather: read row r from ``x[perm[r] // topk]``.
        scatter: write row r to output row ``perm[r]`` (slot order).

    Returns:
        ``[M, N]``, in slot order when ``scatter``, else in expert order. Under autocast, floating operands are cast
        to the autocast dtype first, as in ``grouped_mm``.
    """
    x, w = autocast_operands(x, w)
    return _moe_grouped_mm_eager(x, w, offs_E, perm_M, topk, gather, scatter, out_dtype)
