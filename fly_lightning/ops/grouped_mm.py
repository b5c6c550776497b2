"""Grouped GEMM for MoE experts: ragged 2D activations x 3D expert weights, grouped by int32 end offsets.

``out[s_e:offs[e]] = x[s_e:offs[e]] @ w[e]`` with ``s_0 = 0``, ``s_e = offs[e - 1]``: the semantics of
``torch._grouped_mm`` / ``F.grouped_mm`` for the 2D x 3D case:

- ``w`` is ``[E, K, N]`` with either N contiguous or K contiguous (the transposed view of a contiguous ``[E, N, K]``,
  as ``nn.Linear``-style expert weights and transformers v5 ``gate_up_proj`` / ``down_proj`` are stored);
- ``offs`` is int32 ``[E]``, non-decreasing, ``offs[-1] <= M``; an empty group (equal neighbours) is allowed;
- rows at and past the last offset ``offs[E - 1]`` are left unwritten, exactly as torch does (it allocates the
  output with ``empty``): their values are unspecified, in the output and in the input gradient (every backend here,
  the reference included, leaves them unwritten too);
- bf16/fp16/fp32 inputs, fp32 accumulation; ``out_dtype`` is the input dtype or float32.

Forward is dispatched (Triton / ATen); backward (dX and dW) always runs ``torch._grouped_mm`` where it accepts the
layout, else the per-group reference: never the specialised kernel.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fly_lightning.dispatch import register_op
from fly_lightning.ops._eager import EagerCall, TracedOrDirect
from fly_lightning.registry import tensor_key

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def _fake(t: Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def _validate(x: Tensor, w: Tensor, offs: Tensor, out_dtype: torch.dtype | None) -> None:
    """Shapes, dtypes and devices; offset values too when they are on the CPU (no device sync is ever taken)."""
    for name, t in (("x", x), ("w", w), ("offs", offs)):
        if not isinstance(t, Tensor):
            raise ValueError(f"grouped_mm: {name} must be a Tensor, got {type(t).__name__}")
    if x.dim() != 2:
        raise ValueError(f"grouped_mm: x must be 2-D [M, K], got shape {list(x.shape)}")
    if w.dim() != 3:
        raise ValueError(f"grouped_mm: w must be 3-D [E, K, N], got shape {list(w.shape)}")
    if x.dtype not in _FLOATS:
        raise ValueError(f"grouped_mm: x must be bfloat16, float16 or float32, got {x.dtype}")
    if w.dtype != x.dtype:
        raise ValueError(f"grouped_mm: w dtype {w.dtype} differs from x dtype {x.dtype}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_mm: contraction dims differ: x is {list(x.shape)}, w is {list(w.shape)}")
    if w.shape[0] < 1:
        raise ValueError("grouped_mm: w needs at least one group (E >= 1)")
    if offs.dtype != torch.int32:
        raise ValueError(f"grouped_mm: offs must be int32, got {offs.dtype}")
    if offs.dim() != 1 or offs.shape[0] != w.shape[0]:
        raise ValueError(f"grouped_mm: offs must be 1-D of length E={w.shape[0]}, got shape {list(offs.shape)}")
    if x.device != w.device or x.device != offs.device:
        raise ValueError(f"grouped_mm: x on {x.device}, w on {w.device}, offs on {offs.device}: must match")
    if out_dtype is not None and out_dtype not in (x.dtype, torch.float32):
        raise ValueError(f"grouped_mm: out_dtype must be None, {x.dtype} or torch.float32, got {out_dtype}")


def _check_values(x: Tensor, w: Tensor, offs: Tensor, out_dtype: torch.dtype | None) -> None:
    _check_offsets(offs, x.shape[0], "grouped_mm")


def _check_offsets(offs: Tensor, m: int, op: str) -> None:
    """Values are checked only when they can be read without a device sync (CPU, not under tracing)."""
    if not isinstance(offs, Tensor) or offs.dim() != 1 or offs.device.type != "cpu" or offs.numel() == 0:
        return
    if torch.compiler.is_compiling() or _fake(offs):
        return
    o = offs.tolist()
    if o[0] < 0 or any(b < a for a, b in zip(o[:-1], o[1:], strict=True)):
        raise ValueError(f"{op}: offs must be non-negative and non-decreasing, got {o[:16]}")
    if o[-1] > m:
        raise ValueError(f"{op}: offs[-1]={o[-1]} exceeds the number of rows M={m}")


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def grouped_mm_reference(x: Tensor, w: Tensor, offs: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
    """Plain-torch per-group loop (the oracle; fp32 accumulation, fp64 for fp64 inputs). Reads ``offs`` on the host.

    Rows at and past ``offs[-1]`` are left as ``torch.empty`` leaves them, as in ``torch._grouped_mm``.
    """
    out = torch.empty(x.shape[0], w.shape[2], dtype=out_dtype or x.dtype, device=x.device)
    acc = _acc_dtype(x.dtype)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = (x[start:end].to(acc) @ w[e].to(acc)).to(out.dtype)
        start = max(start, end)
    return out


def aten_reason(a: Tensor, b: Tensor, offs: Tensor, out_dtype: torch.dtype | None = None) -> str | None:
    """Why ``torch._grouped_mm(a, b, offs)`` cannot compute this product with a contiguous output, or None.

    Its checks (ATen GroupedMMUtils.h): same float dtypes, output dtype = input dtype, each operand has one unit stride
    in its last two dims and the other a multiple of 16 bytes, 16-byte aligned data on CUDA; the output is allocated
    with its rows padded to 16 bytes, so N must be a multiple of 16 bytes for a contiguous result. CUTLASS takes at
    most 1023 groups.
    """
    if a.dtype != b.dtype or a.dtype not in _FLOATS:
        return f"dtypes {a.dtype}/{b.dtype}"
    if (out_dtype or a.dtype) != a.dtype:
        return f"out_dtype {out_dtype} differs from the input dtype"
    align = 16 // a.element_size()
    for name, t in (("a", a), ("b", b)):
        s, n = t.stride(), t.shape
        if s[-1] == 1 and s[-2] >= max(1, n[-1]):
            if s[-2] % align:
                return f"{name} row stride {s[-2]} not a multiple of 16 bytes"
        elif s[-2] == 1 and s[-1] >= max(1, n[-2]):
            if s[-1] % align:
                return f"{name} column stride {s[-1]} not a multiple of 16 bytes"
        else:
            return f"{name} strides {tuple(s)} have no unit stride in the last two dims"
        if t.is_cuda and t.data_ptr() % 16:
            return f"{name} data not 16-byte aligned"
    if b.shape[-1] % align:
        return f"N={b.shape[-1]} not a multiple of 16 bytes (torch pads the output rows)"
    if a.is_cuda and offs.shape[0] >= 1024:
        return f"{offs.shape[0]} groups (CUTLASS takes at most 1023)"
    return None


def clamp_offsets(offs: Tensor, m: int) -> Tensor:
    """Device offsets for the ATen paths: each clamped to ``[0, m]``, then made non-decreasing.

    ATen's grouped GEMM trusts its offsets, and device offsets cannot be checked without a sync: this keeps invalid
    ones inside the tensors (valid offsets are unchanged). The Triton kernel clamps each offset to ``[0, m]`` on its
    own, so for decreasing (invalid) offsets the backends' results differ; none reads or writes outside the tensors.
    CPU offsets were checked on the host."""
    if offs.device.type == "cpu":
        return offs
    return torch.cummax(offs.clamp(0, m), 0).values


def _grouped_mm_aten(x: Tensor, w: Tensor, offs: Tensor, out_dtype: torch.dtype | None) -> Tensor:
    """``torch._grouped_mm`` where it accepts the operands, else the reference."""
    if hasattr(torch, "_grouped_mm") and aten_reason(x, w, offs, out_dtype) is None:
        return torch._grouped_mm(x, w, offs=clamp_offsets(offs, x.shape[0]))
    return grouped_mm_reference(x, w, offs, out_dtype)


def _signature(x: Tensor, w: Tensor, offs: Tensor, out_dtype: torch.dtype | None) -> tuple:
    return (tensor_key(x), tensor_key(w), tensor_key(offs), out_dtype)


GROUPED_MM = register_op(
    "grouped_mm",
    reference=grouped_mm_reference,
    aten=_grouped_mm_aten,
    signature=_signature,
    validate=_validate,
    check=_check_values,
    doc="grouped GEMM, 2D x 3D by int32 group end offsets; (x [M,K], w [E,K,N], offs [E], out_dtype) -> [M,N]",
)


@torch.library.custom_op("fly::grouped_mm", mutates_args=())
def grouped_mm_op(x: Tensor, w: Tensor, offs: Tensor, out_dtype: torch.dtype | None) -> Tensor:
    """Dispatched forward."""
    return GROUPED_MM(x, w, offs, out_dtype)


@grouped_mm_op.register_fake
def _(x: Tensor, w: Tensor, offs: Tensor, out_dtype: torch.dtype | None) -> Tensor:
    _validate(x, w, offs, out_dtype)
    return x.new_empty((x.shape[0], w.shape[2]), dtype=out_dtype or x.dtype)


def _aten_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """``a @ b[e]`` per row group (2D x 3D) through ATen, or the reference when ATen refuses the layout."""
    if hasattr(torch, "_grouped_mm") and aten_reason(a, b, offs) is None:
        return torch._grouped_mm(a, b, offs=clamp_offsets(offs, a.shape[0]))
    return grouped_mm_reference(a, b, offs)


def weight_grad(x: Tensor, grad: Tensor, offs: Tensor, like: Tensor) -> Tensor:
    """``dW[e] = x[group e].T @ grad[group e]`` as ``[E, K, N]`` with the strides of ``like`` (N- or K-major).

    Runs ``torch._grouped_mm`` in its 2D x 2D form, which sums over the ragged M dimension; empty groups give zeros.
    """
    e, k, n = like.shape
    k_major = like.stride(-2) == 1 and like.stride(-1) != 1
    a, b = (grad.t(), x) if k_major else (x.t(), grad)  # product is [E, N, K] when k_major, else [E, K, N]
    if hasattr(torch, "_grouped_mm") and aten_reason(a, b, offs) is None and a.shape[1] > 0:
        dw = torch._grouped_mm(a, b, offs=clamp_offsets(offs, x.shape[0]))
    else:
        acc = _acc_dtype(x.dtype)
        dw = torch.zeros(e, a.shape[0], b.shape[1], dtype=acc, device=x.device)
        start = 0
        for g, end in enumerate(offs.tolist()):
            if end > start:
                dw[g] = a[:, start:end].to(acc) @ b[start:end].to(acc)
            start = max(start, end)
        dw = dw.to(x.dtype)
    return dw.transpose(-2, -1) if k_major else dw


def grouped_mm_backward(
    grad: Tensor, x: Tensor, w: Tensor, offs: Tensor, need_x: bool = True, need_w: bool = True
) -> tuple[Tensor | None, Tensor | None]:
    """The existing implementation: ``dX = grad @ w[e].T`` and ``dW`` through ``torch._grouped_mm``.

    Rows of ``dX`` at and past ``offs[-1]`` are unspecified, as in torch.
    """
    grad = grad.to(x.dtype).contiguous()  # an expanded or strided gradient would push ATen to the slow loop
    dx = _aten_mm(grad, w.transpose(-2, -1), offs) if need_x else None
    dw = weight_grad(x, grad, offs, w) if need_w else None
    return dx, dw


def weight_grad_like(w: Tensor) -> Tensor:
    """An empty tensor with the shape and the layout ``weight_grad`` gives for ``w``."""
    e, k, n = w.shape
    if w.stride(-2) == 1 and w.stride(-1) != 1:
        return w.new_empty((e, n, k)).transpose(-2, -1)
    return w.new_empty((e, k, n))


# The backward is an opaque op of its own: its implementation may read offsets on the host (the reference, for
# layouts ATen refuses), which tracing could not follow; torch.compile sees only shapes.
def _grouped_mm_backward_impl(
    grad: Tensor, x: Tensor, w: Tensor, offs: Tensor, need_x: bool, need_w: bool
) -> tuple[Tensor, Tensor]:
    """``(dx, dw)``; an unneeded gradient is an empty ``[0]`` tensor."""
    dx, dw = grouped_mm_backward(grad, x, w, offs, need_x, need_w)
    return (x.new_empty(0) if dx is None else dx), (w.new_empty(0) if dw is None else dw)


grouped_mm_backward_op = torch.library.custom_op("fly::grouped_mm_backward", mutates_args=())(_grouped_mm_backward_impl)
grouped_mm_backward_call = TracedOrDirect(grouped_mm_backward_op, _grouped_mm_backward_impl)
"""The backward as a call: the custom op where something traces, else its implementation (no wrapper host cost)."""


@grouped_mm_backward_op.register_fake
def _(grad: Tensor, x: Tensor, w: Tensor, offs: Tensor, need_x: bool, need_w: bool) -> tuple[Tensor, Tensor]:
    dx = x.new_empty(x.shape) if need_x else x.new_empty(0)
    return dx, (weight_grad_like(w) if need_w else w.new_empty(0))


def _setup_context(ctx, inputs, output) -> None:
    x, w, offs, _ = inputs
    ctx.save_for_backward(x, w, offs)


def _backward(ctx, grad: Tensor):
    x, w, offs = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dx, dw = grouped_mm_backward_call(grad, x, w, offs, need_x, need_w)
    return (dx if need_x else None), (dw if need_w else None), None, None


_grouped_mm_eager = EagerCall(GROUPED_MM, grouped_mm_op, _setup_context, _backward)


def autocast_operands(x: Tensor, *ws: Tensor) -> tuple[Tensor, ...]:
    """``(x, *ws)`` with floating operands (fp32, or the other 16-bit type) cast to the autocast dtype where autocast
    is on for ``x``'s device, as autocast does for ``mm`` (it leaves fp64 alone).

    Custom ops are invisible to autocast, so without this a ``bf16-mixed`` run would hand fp32 weights to the op and
    every call would fall back. The cast is differentiable: gradients reach the fp32 parameters as with ``F.linear``.
    """
    tensors = (x, *ws)
    if not all(isinstance(t, Tensor) for t in tensors) or not torch.is_autocast_enabled(x.device.type):
        return tensors
    dtype = torch.get_autocast_dtype(x.device.type)
    return tuple(t.to(dtype) if t.dtype in (torch.float32, torch.float16, torch.bfloat16) else t for t in tensors)


def grouped_mm(x_MK: Tensor, w: Tensor, offs_E: Tensor, *, out_dtype: torch.dtype | None = None) -> Tensor:
    """Grouped GEMM with the semantics of ``torch._grouped_mm(x, w, offs=offs)`` (2D x 3D).

    Args:
        x_MK: ``[M, K]`` rows sorted by group (bf16/fp16/fp32).
        w: ``[E, K, N]`` expert weights, N-contiguous or the transposed view of a contiguous ``[E, N, K]``.
        offs_E: int32 ``[E]`` group end offsets (cumulative row counts), non-decreasing, ``offs[-1] <= M``.
        out_dtype: ``None`` (the input dtype) or ``torch.float32``.

    Returns:
        ``[M, N]``; rows at and past ``offs[-1]`` are unspecified, as in torch.

    Offset values are checked only on the CPU; on a GPU they are never read by the host (no sync): the Triton kernel
    clamps each to ``[0, M]``, and the ATen paths (fallback, backward) get them clamped and made non-decreasing
    (``clamp_offsets``), so invalid offsets cannot touch memory outside the tensors; what they compute is
    unspecified (decreasing ones overlap groups in the kernel). Under autocast, fp32 operands are cast to the
    autocast dtype first.
    """
    x_MK, w = autocast_operands(x_MK, w)
    if not (isinstance(x_MK, Tensor) and isinstance(w, Tensor) and isinstance(offs_E, Tensor)):
        _validate(x_MK, w, offs_E, out_dtype)  # raises the ValueError naming the argument
    return _grouped_mm_eager(x_MK, w, offs_E, out_dtype)
