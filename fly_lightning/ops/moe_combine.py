"""Weighted combine of each token's k expert outputs: ``y[t] = sum_j w[t, j] * rows[index[t * k + j]]``.

The last step of an MoE block. ``rows_SH`` are the down projection's outputs, one per routed slot, in expert order
(``index_S`` maps slot ``t * k + j`` to its row: the inverse of the routing permutation) or already in slot order
(``index_S=None``). The sum runs in fp32 over j = 0..k-1 in that order (no atomics: deterministic) and is rounded
once to ``out_dtype``, as the stock blocks' fp32 combine does.

Its adjoint lives here too: ``moe_dispatch`` (token rows gathered to expert order through the routing permutation,
optionally scaled by their routing weight, in fp32 and rounded once). Each is the other's input gradient: the
backward of ``moe_combine`` runs ``moe_dispatch``'s forward for the rows' gradient, and the backward of
``moe_dispatch`` runs ``moe_combine``'s forward for the tokens' gradient (forward operators computing exactly what
the backward needs: no backward-only kernel). The weight gradients are fp32 dot products of rows and token gradients
on ATen.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fly_lightning.dispatch import register_op
from fly_lightning.ops._eager import EagerCall, TracedOrDirect, create_graph_grads
from fly_lightning.ops.grouped_mm import _fake
from fly_lightning.ops.permutation import check_permutation, inverse_permutation
from fly_lightning.registry import scalar_key, tensor_key

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
    """Backward: ``d row = w * grad[token]`` by ``moe_dispatch`` (fp32, rounded once to the rows' dtype);
    ``d w = <row, grad>`` in fp32 on the rows gathered to slot order (ATen)."""
    t, k = weights.shape
    acc = _acc_dtype(rows, weights)
    d_rows = d_w = None
    if k == 0:  # no slots (the forward's zeros): nothing flows back, and moe_dispatch takes k >= 1
        return (rows.new_zeros(rows.shape) if need_rows else None), (
            weights.new_zeros(weights.shape) if need_weights else None
        )
    if need_rows:  # d row r = w[perm[r]] * grad[perm[r] // k]: moe_dispatch's forward, rounded once
        slots = torch.arange(rows.shape[0], device=rows.device, dtype=torch.int32)
        perm = slots if index is None else inverse_permutation(index)  # row r holds slot perm[r]
        d_rows = MOE_DISPATCH(grad, perm, k, weights, rows.dtype)
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


# --- moe_dispatch: the adjoint ----------------------------------------------------------------------------------------


def _validate_dispatch(
    x: Tensor, perm: Tensor, topk: int, weights: Tensor | None, out_dtype: torch.dtype | None
) -> None:
    if not isinstance(x, Tensor) or x.dim() != 2 or x.dtype not in _FLOATS:
        raise ValueError(f"moe_dispatch: x must be a floating 2-D [T, H] tensor, got {getattr(x, 'shape', x)}")
    # a SymInt under torch.compile(dynamic=True), where k comes from a tensor's shape
    if isinstance(topk, bool) or not isinstance(topk, (int, torch.SymInt)) or topk < 1:
        raise ValueError(f"moe_dispatch: topk must be a positive int, got {topk!r}")
    s = x.shape[0] * topk
    if not isinstance(perm, Tensor) or perm.dtype != torch.int32 or perm.shape != (s,):
        raise ValueError(
            f"moe_dispatch: perm must be int32 of shape [T*topk = {s}], got {getattr(perm, 'shape', perm)}"
        )
    if perm.device != x.device:
        raise ValueError(f"moe_dispatch: perm on {perm.device}, x on {x.device}")
    if weights is not None:
        if not isinstance(weights, Tensor) or weights.shape != (x.shape[0], topk) or weights.dtype not in _FLOATS:
            raise ValueError(f"moe_dispatch: weights must be floating [{x.shape[0]}, {topk}] or None")
        if weights.device != x.device:
            raise ValueError(f"moe_dispatch: weights on {weights.device}, x on {x.device}")
    if out_dtype is not None and out_dtype not in _FLOATS:
        raise ValueError(f"moe_dispatch: out_dtype must be a floating dtype, got {out_dtype}")


def _check_dispatch(x: Tensor, perm: Tensor, topk: int, weights: Tensor | None, out_dtype: torch.dtype | None) -> None:
    if perm.device.type != "cpu" or torch.compiler.is_compiling() or _fake(perm):
        return
    check_permutation(perm, "moe_dispatch: perm")


def moe_dispatch_reference(
    x: Tensor, perm: Tensor, topk: int, weights: Tensor | None, out_dtype: torch.dtype | None = None
) -> Tensor:
    """The oracle: row r = ``w[perm[r]] * x[perm[r] // topk]`` in fp32 (or wider), rounded once."""
    p = perm.long()
    acc = _acc_dtype(x, x if weights is None else weights)
    rows = x.index_select(0, p // topk).to(acc)
    if weights is not None:
        rows = rows * weights.reshape(-1).index_select(0, p).to(acc).unsqueeze(1)
    return rows.to(out_dtype or x.dtype)


def _moe_dispatch_aten(
    x: Tensor, perm: Tensor, topk: int, weights: Tensor | None, out_dtype: torch.dtype | None
) -> Tensor:
    """ATen path: one gather when unweighted; else a chunk of rows at a time in fp32 (bounded copies)."""
    p = perm.long()
    if weights is None:
        return x.index_select(0, p // topk).to(out_dtype or x.dtype)
    acc = _acc_dtype(x, weights)
    out = x.new_empty((p.shape[0], x.shape[1]), dtype=out_dtype or x.dtype)
    w = weights.reshape(-1)
    with torch.autocast(x.device.type, enabled=False):
        for s, e in _chunks(p.shape[0], x.shape[1]):
            rows = x.index_select(0, p[s:e] // topk).to(acc)
            out[s:e] = rows * w.index_select(0, p[s:e]).to(acc).unsqueeze(1)
    return out


def _dispatch_signature(
    x: Tensor, perm: Tensor, topk: int, weights: Tensor | None, out_dtype: torch.dtype | None
) -> tuple:
    return (tensor_key(x), tensor_key(perm), scalar_key(topk), tensor_key(weights), out_dtype)


MOE_DISPATCH = register_op(
    "moe_dispatch",
    reference=moe_dispatch_reference,
    aten=_moe_dispatch_aten,
    traced=moe_dispatch_reference,
    signature=_dispatch_signature,
    validate=_validate_dispatch,
    check=_check_dispatch,
    doc="token rows gathered to expert order through the routing permutation, optionally weighted (fp32, one rounding)",
)


@torch.library.custom_op("fly::moe_dispatch", mutates_args=())
def moe_dispatch_op(
    x: Tensor, perm: Tensor, topk: int, weights: Tensor | None, out_dtype: torch.dtype | None
) -> Tensor:
    """Dispatched forward."""
    return MOE_DISPATCH(x, perm, topk, weights, out_dtype)


@moe_dispatch_op.register_fake
def _(x: Tensor, perm: Tensor, topk: int, weights: Tensor | None, out_dtype: torch.dtype | None) -> Tensor:
    _validate_dispatch(x, perm, topk, weights, out_dtype)
    return x.new_empty((perm.shape[0], x.shape[1]), dtype=out_dtype or x.dtype)


def moe_dispatch_backward(
    grad: Tensor, x: Tensor, perm: Tensor, topk: int, weights: Tensor | None, need_x: bool, need_w: bool
) -> tuple[Tensor | None, Tensor | None]:
    """``d x = moe_combine(grad, w, inv)`` (its forward: the k slot gradients weighted and summed in fp32) and
    ``d w[t, j] = <x[t], grad[inv[t * k + j]]>`` in fp32."""
    t = x.shape[0]
    inv = inverse_permutation(perm)
    d_x = d_w = None
    if need_x:
        w = weights if weights is not None else torch.ones(t, topk, dtype=torch.float32, device=x.device)
        d_x = MOE_COMBINE(grad, w, inv, x.dtype)
    if need_w and weights is not None:
        g_slots = grad.index_select(0, inv.long()).view(t, topk, grad.shape[1])
        acc = torch.promote_types(_acc_dtype(grad, weights), x.dtype)
        d_w = _token_dots(g_slots, x, acc).to(weights.dtype)  # x as it is (not rounded to grad's dtype): fp32 sums
    return d_x, d_w


def _moe_dispatch_backward_impl(
    grad: Tensor, x: Tensor, perm: Tensor, topk: int, weights: Tensor | None, need_x: bool, need_w: bool
) -> tuple[Tensor, Tensor]:
    """``(d x, d weights)`` as an opaque op; an unneeded gradient is an empty ``[0]``. Autocast off (fp32 sums)."""
    with torch.autocast(x.device.type, enabled=False):
        d_x, d_w = moe_dispatch_backward(grad, x, perm, topk, weights, need_x, need_w)
    empty = x.new_empty(0)
    return (empty if d_x is None else d_x), (empty if d_w is None else d_w)


moe_dispatch_backward_op = torch.library.custom_op("fly::moe_dispatch_backward", mutates_args=())(
    _moe_dispatch_backward_impl
)
_moe_dispatch_backward_call = TracedOrDirect(moe_dispatch_backward_op, _moe_dispatch_backward_impl)


@moe_dispatch_backward_op.register_fake
def _(
    grad: Tensor, x: Tensor, perm: Tensor, topk: int, weights: Tensor | None, need_x: bool, need_w: bool
) -> tuple[Tensor, Tensor]:
    d_w = weights.new_empty(weights.shape) if need_w and weights is not None else x.new_empty(0)
    return (x.new_empty(x.shape) if need_x else x.new_empty(0)), d_w


def _dispatch_setup_context(ctx, inputs, output) -> None:
    x, perm, topk, weights, out_dtype = inputs
    ctx.save_for_backward(x, perm, weights)
    ctx.topk, ctx.out_dtype = topk, out_dtype


def _dispatch_backward(ctx, grad: Tensor):
    x, perm, weights = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], weights is not None and ctx.needs_input_grad[3]
    if torch.is_grad_enabled():  # create_graph=True: differentiate the reference
        args = (x, perm, ctx.topk, weights, ctx.out_dtype)
        g = create_graph_grads(moe_dispatch_reference, args, (need_x, False, False, need_w, False), (grad,))
        return g[0], None, None, g[3], None
    d_x, d_w = _moe_dispatch_backward_call(grad, x, perm, ctx.topk, weights, need_x, need_w)
    return (d_x if need_x else None), None, None, (d_w if need_w else None), None


_moe_dispatch_eager = EagerCall(MOE_DISPATCH, moe_dispatch_op, _dispatch_setup_context, _dispatch_backward)


def moe_dispatch(
    x_TH: Tensor,
    perm_S: Tensor,
    topk: int,
    weights_Tk: Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """Token rows in expert order: row r is ``x[perm[r] // topk]``, times ``weights[perm[r]]`` when given (fp32,
    rounded once to ``out_dtype``, default x's dtype). ``[T * topk, H]``.

    Args:
        x_TH: ``[T, H]`` tokens.
        perm_S: int32 ``[T * topk]``: the slot (``t * topk + j``) of each expert-ordered row (a permutation).
        topk: experts per token.
        weights_Tk: optional ``[T, topk]`` routing weights scaling each row (torchtitan's score-before-experts).
    """
    return _moe_dispatch_eager(x_TH, perm_S, topk, weights_Tk, out_dtype)
