"""Weighted combine of each token's k expert outputs: ``y[t] = sum_j w[t, j] * rows[index[t * k + j]]``.

The last step of an MoE block. ``rows_SH`` are the down projection's outputs, one per routed slot, in expert order
(``index_S`` maps slot ``t * k + j`` to its row: the inverse of the routing permutation) or already in slot order
(``index_S=None``). The sum runs in fp32 over j = 0..k-1 in that order (no atomics: deterministic) and is rounded
once to ``out_dtype``, as the stock blocks' fp32 combine does.

Forward is dispatched (Triton / ATen); backward runs ATen: the token gradient gathered to each row, scaled by the
row's weight (fp32, rounded once), and the weight gradient as fp32 dot products of rows and token gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fly_lightning.dispatch import register_op
from fly_lightning.ops._eager import EagerCall, TracedOrDirect, create_graph_grads
from fly_lightning.ops.grouped_mm import _fake
from fly_lightning.ops.permutation import check_permutation, inverse_permutation
from fly_lightning.registry import tensor_key

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
CHUNK_ELEMENTS = 2**25  # fp32 elements materialised at once by the ATen paths: bounds their transient copies


def _validate(rows: Tensor, weights: Tensor, index: Tensor | None, out_dtype: torch.dtype | None) -> None:
    if not isinstance(rows, Tensor) or rows.dim() != 2:
        raise ValueError(f"moe_combine: rows must be a 2-D [S, H] tensor, got {getattr(rows, 'shape', rows)}")
    if not isinstance(weights, Tensor) or weights.dim() != 2:
        raise ValueError(f"moe_combine: weights must be a 2-D [T, k] tensor, got {getattr(weights, 'shape', weights)}")
    if rows.dtype not in _FLOATS or weights.dtype not in _FLOATS:
        raise ValueError(f"moe_combine: rows and weights must be floating, got {rows.dtype} and {weights.dtype}")
    s = weights.shape[0] * weights.shape[1]
    if rows.shape[0] != s:
        raise ValueError(f"moe_combine: rows has {rows.shape[0]} rows, weights {list(weights.shape)} need T*k = {s}")
    if index is not None:
        if not isinstance(index, Tensor) or index.dtype != torch.int32 or index.shape != (s,):
            raise ValueError(f"moe_combine: index must be int32 of shape [{s}], got {getattr(index, 'dtype', index)}")
        if index.device != rows.device:
            raise ValueError(f"moe_combine: index on {index.device}, rows on {rows.device}")
    if weights.device != rows.device:
        raise ValueError(f"moe_combine: weights on {weights.device}, rows on {rows.device}")
    if out_dtype is not None and out_dtype not in _FLOATS:
        raise ValueError(f"moe_combine: out_dtype must be a floating dtype, got {out_dtype}")


def _check_index(rows: Tensor, weights: Tensor, index: Tensor | None, out_dtype: torch.dtype | None) -> None:
    """CPU-only value check, on every call (a device index is never read by the host)."""
    if index is None or index.device.type != "cpu" or torch.compiler.is_compiling() or _fake(index):
        return
    check_permutation(index, "moe_combine: index")


def _acc_dtype(rows: Tensor, weights: Tensor) -> torch.dtype:
    return torch.promote_types(torch.promote_types(rows.dtype, weights.dtype), torch.float32)


def moe_combine_reference(
    rows: Tensor, weights: Tensor, index: Tensor | None, out_dtype: torch.dtype | None = None
) -> Tensor:
    """The oracle: gather, widen, weight, sum over k in order, round once."""
    t, k = weights.shape
    acc = _acc_dtype(rows, weights)
    r = rows if index is None else rows.index_select(0, index.long())
    y = (r.view(t, k, rows.shape[1]).to(acc) * weights.to(acc).unsqueeze(-1)).sum(1)
    return y.to(out_dtype or rows.dtype)


def _chunks(t: int, per_token: int) -> list[tuple[int, int]]:
    step = max(1, CHUNK_ELEMENTS // max(1, per_token))
    return [(s, min(t, s + step)) for s in range(0, t, step)]


def _moe_combine_aten(rows: Tensor, weights: Tensor, index: Tensor | None, out_dtype: torch.dtype | None) -> Tensor:
    """ATen path: a batched ``[1, k] x [k, H]`` product in fp32, a token chunk at a time (bounded fp32 copies).

    Autocast is off: it reaches ATen calls inside a custom op and would run this ``bmm`` in bf16."""
    t, k = weights.shape
    h = rows.shape[1]
    acc = _acc_dtype(rows, weights)
    y = rows.new_empty((t, h), dtype=out_dtype or rows.dtype)
    with torch.autocast(rows.device.type, enabled=False):
        for s, e in _chunks(t, k * h):
            r = rows[s * k : e * k] if index is None else rows.index_select(0, index[s * k : e * k].long())
            y[s:e] = torch.bmm(weights[s:e].to(acc).unsqueeze(1), r.view(e - s, k, h).to(acc)).squeeze(1)
    return y


def _signature(rows: Tensor, weights: Tensor, index: Tensor | None, out_dtype: torch.dtype | None) -> tuple:
    return (tensor_key(rows), tensor_key(weights), tensor_key(index), out_dtype)


MOE_COMBINE = register_op(
    "moe_combine",
    reference=moe_combine_reference,
    traced=moe_combine_reference,
    aten=_moe_combine_aten,
    signature=_signature,
    validate=_validate,
    check=_check_index,
    doc="weighted fp32 sum of each token's k expert rows (gathered through an index), in slot order",
)


@torch.library.custom_op("fly::moe_combine", mutates_args=())
def moe_combine_op(rows: Tensor, weights: Tensor, index: Tensor | None, out_dtype: torch.dtype | None) -> Tensor:
    """Dispatched forward."""
    return MOE_COMBINE(rows, weights, index, out_dtype)


@moe_combine_op.register_fake
def _(rows: Tensor, weights: Tensor, index: Tensor | None, out_dtype: torch.dtype | None) -> Tensor:
    _validate(rows, weights, index, out_dtype)
    return rows.new_empty((weights.shape[0], rows.shape[1]), dtype=out_dtype or rows.dtype)


def _token_dots(r_TkH: Tensor, g_TH: Tensor, acc: torch.dtype) -> Tensor:
    """``d w[t, j] = <r[t, j], g[t]>`` in ``acc``: a batched ``[k, H] x [H, 1]`` product per token, without a widened
    copy of ``r`` where the GPU allows (bf16/fp16 in, fp32 out), else a token chunk at a time in ``acc``."""
    if r_TkH.is_cuda and r_TkH.dtype == g_TH.dtype and r_TkH.dtype in (torch.bfloat16, torch.float16):
        if acc == torch.float32:
            try:
                return torch.bmm(r_TkH, g_TH.unsqueeze(-1), out_dtype=torch.float32).squeeze(-1)
            except (TypeError, RuntimeError, NotImplementedError):  # a torch without bmm(out_dtype=)
                pass
    t, k, h = r_TkH.shape
    out = r_TkH.new_empty((t, k), dtype=acc)
    for s, e in _chunks(t, k * h):
        out[s:e] = torch.bmm(r_TkH[s:e].to(acc), g_TH[s:e].to(acc).unsqueeze(-1)).squeeze(-1)
    return out


def moe_combine_backward(
    grad: Tensor, rows: Tensor, weights: Tensor, index: Tensor | None, need_rows: bool, need_weights: bool
) -> tuple[Tensor | None, Tensor | None]:
    """ATen backward: each row takes its token's gradient (one gather) and ``d row = w * grad`` is computed in fp32
    and rounded once to the rows' dtype; ``d w = <row, grad>`` in fp32 on the rows gathered to slot order."""
    t, k = weights.shape
    acc = _acc_dtype(rows, weights)
    slots = torch.arange(rows.shape[0], device=rows.device)
    perm = slots if index is None else inverse_permutation(index).long()  # row r holds slot perm[r]
    g_rows = grad.index_select(0, perm // k)
    d_rows = d_w = None
    if need_rows:
        w_rows = weights.reshape(-1).index_select(0, perm).to(acc).unsqueeze(1)
        d_rows = torch.mul(g_rows, w_rows, out=rows.new_empty(rows.shape))
    if need_weights:  # in slot order: one [k, H] x [H, 1] product per token (per-row dots batch badly)
        r_slots = rows if index is None else rows.index_select(0, index.long())
        d_w = _token_dots(r_slots.view(t, k, rows.shape[1]), grad, acc).to(weights.dtype)
    return d_rows, d_w


def _moe_combine_backward_impl(
    grad: Tensor, rows: Tensor, weights: Tensor, index: Tensor | None, need_rows: bool, need_weights: bool
) -> tuple[Tensor, Tensor]:
    """``(d rows, d weights)`` as an opaque op; an unneeded gradient is an empty ``[0]``. Autocast off (fp32 sums)."""
    with torch.autocast(rows.device.type, enabled=False):
        d_rows, d_w = moe_combine_backward(grad, rows, weights, index, need_rows, need_weights)
    return (rows.new_empty(0) if d_rows is None else d_rows), (weights.new_empty(0) if d_w is None else d_w)


moe_combine_backward_op = torch.library.custom_op("fly::moe_combine_backward", mutates_args=())(
    _moe_combine_backward_impl
)
_moe_combine_backward_call = TracedOrDirect(moe_combine_backward_op, _moe_combine_backward_impl)


@moe_combine_backward_op.register_fake
def _(
    grad: Tensor, rows: Tensor, weights: Tensor, index: Tensor | None, need_rows: bool, need_weights: bool
) -> tuple[Tensor, Tensor]:
    return rows.new_empty(rows.shape if need_rows else 0), weights.new_empty(weights.shape if need_weights else 0)


def _setup_context(ctx, inputs, output) -> None:
    rows, weights, index, out_dtype = inputs
    ctx.save_for_backward(rows, weights, index)
    ctx.out_dtype = out_dtype


def _backward(ctx, grad: Tensor):
    rows, weights, index = ctx.saved_tensors
    need_rows, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if torch.is_grad_enabled():  # create_graph=True: the formula writes into out= buffers
        args = (rows, weights, index, ctx.out_dtype)
        return create_graph_grads(moe_combine_reference, args, (need_rows, need_w, False, False), (grad,))
    d_rows, d_w = _moe_combine_backward_call(grad, rows, weights, index, need_rows, need_w)
    return (d_rows if need_rows else None), (d_w if need_w else None), None, None


_moe_combine_eager = EagerCall(MOE_COMBINE, moe_combine_op, _setup_context, _backward)


def moe_combine(
    rows_SH: Tensor, weights_Tk: Tensor, index_S: Tensor | None = None, *, out_dtype: torch.dtype | None = None
) -> Tensor:
    """Each token's k expert rows, weighted and summed in fp32: ``[T, H]`` in ``out_dtype`` (default: the rows').

    Args:
        rows_SH: ``[T * k, H]`` expert outputs.
        weights_Tk: ``[T, k]`` routing weights (any float dtype; the sum runs in fp32 or wider).
        index_S: int32 ``[T * k]``: the row of slot ``t * k + j`` (a permutation; for expert-ordered rows, the
            inverse of the routing permutation). None: the rows are in slot order.
        out_dtype: the result's dtype.
    """
    return _moe_combine_eager(rows_SH, weights_Tk, index_S, out_dtype)
