"""RMSNorm over the last dimension: the operator, its reference, its custom op and its autograd.

Forward is dispatched (FlyDSL / Triton / ATen); backward always runs the existing ATen implementation.

Variants (explicit options, as the Hugging Face models define them):
- default: ``y = (x_f32 * rstd * w).to(x.dtype)`` — ``torch.nn.functional.rms_norm``.
- ``offset=1.0``: scale by ``1 + w`` in fp32 — Gemma.
- ``cast_before_scale=True``: ``y = w * (x_f32 * rstd).to(x.dtype)`` — Llama, Mistral, Qwen, OLMoE, DeepSeek-V3
  (normalise in fp32, cast, then scale in the weight's precision; the output dtype follows type promotion).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fly_lightning.dispatch import register_op
from fly_lightning.dtensor import is_dtensor, run_on_local_shards
from fly_lightning.ops._eager import EagerCall, create_graph_grads
from fly_lightning.registry import tensor_key

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _validate(x: Tensor, weight: Tensor | None, eps: float, offset: float, cast_before_scale: bool) -> None:
    if not isinstance(x, Tensor):
        raise ValueError(f"rms_norm: x must be a Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError("rms_norm: x must have at least one dimension (the normalised one)")
    if x.dtype not in _FLOATS:
        raise ValueError(f"rms_norm: x must be a floating tensor, got {x.dtype}")
    if weight is not None:
        if not isinstance(weight, Tensor):
            raise ValueError(f"rms_norm: weight must be a Tensor or None, got {type(weight).__name__}")
        if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
            raise ValueError(f"rms_norm: weight must have shape [{x.shape[-1]}], got {list(weight.shape)}")
        if weight.dtype not in _FLOATS:
            raise ValueError(f"rms_norm: weight must be floating, got {weight.dtype}")
        if weight.device != x.device:
            raise ValueError(f"rms_norm: weight on {weight.device}, x on {x.device}")
    if not (eps >= 0.0 and eps != float("inf")):
        raise ValueError(f"rms_norm: eps must be finite and >= 0, got {eps}")
    if offset != offset or abs(offset) == float("inf"):
        raise ValueError(f"rms_norm: offset must be finite, got {offset}")


def _out_dtype(x: Tensor, weight: Tensor | None, cast_before_scale: bool) -> torch.dtype:
    if cast_before_scale and weight is not None:
        return torch.promote_types(x.dtype, weight.dtype)
    return x.dtype


def _acc_dtype(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def rms_norm_reference(
    x: Tensor, weight: Tensor | None, eps: float, offset: float = 0.0, cast_before_scale: bool = False
) -> tuple[Tensor, Tensor]:
    """Plain-torch reference and oracle: ``(y, rstd)``, rstd ``[..., 1]`` in fp32 (fp64 for fp64 inputs)."""
    xf = x.to(_acc_dtype(x))
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    xhat = xf * rstd
    if weight is None:
        return xhat.to(x.dtype), rstd
    if cast_before_scale:
        w = weight + offset if offset else weight
        return w * xhat.to(x.dtype), rstd
    return (xhat * (weight.to(xf.dtype) + offset)).to(x.dtype), rstd


def _rms_norm_aten(
    x: Tensor, weight: Tensor | None, eps: float, offset: float, cast_before_scale: bool
) -> tuple[Tensor, Tensor]:
    """ATen's fused RMSNorm where it computes our semantics; the reference for the Llama-style cast."""
    if cast_before_scale and weight is not None:
        return rms_norm_reference(x, weight, eps, offset, cast_before_scale)
    w = None if weight is None else (weight.to(_acc_dtype(x)) + offset if offset else weight)
    y, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], w, eps)
    return y.to(x.dtype), rstd.to(_acc_dtype(x))


def _signature(x: Tensor, weight: Tensor | None, eps: float, offset: float, cast_before_scale: bool) -> tuple:
    return (tensor_key(x), tensor_key(weight), eps, offset, cast_before_scale)


RMS_NORM = register_op(
    "rms_norm",
    reference=rms_norm_reference,
    traced=rms_norm_reference,
    aten=_rms_norm_aten,
    signature=_signature,
    validate=_validate,
    doc="RMSNorm forward over the last dim; (x, weight, eps, offset, cast_before_scale) -> (y, rstd)",
)


@torch.library.custom_op("fly::rms_norm", mutates_args=())
def rms_norm_op(
    x: Tensor, weight: Tensor | None, eps: float, offset: float, cast_before_scale: bool
) -> tuple[Tensor, Tensor]:
    """Dispatched forward: ``(y, rstd)``."""
    return RMS_NORM(x, weight, eps, offset, cast_before_scale)


@rms_norm_op.register_fake
def _(x: Tensor, weight: Tensor | None, eps: float, offset: float, cast_before_scale: bool) -> tuple[Tensor, Tensor]:
    _validate(x, weight, eps, offset, cast_before_scale)
    y = x.new_empty(x.shape, dtype=_out_dtype(x, weight, cast_before_scale))
    return y, x.new_empty((*x.shape[:-1], 1), dtype=_acc_dtype(x))


def _setup_context(ctx, inputs, output) -> None:
    x, weight, eps, offset, cast_before_scale = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.eps, ctx.offset, ctx.cast_before_scale = eps, offset, cast_before_scale


def _backward(ctx, grad_y: Tensor, grad_rstd: Tensor | None):
    x, weight, rstd = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1]
    if torch.is_grad_enabled():  # create_graph=True: rstd must not be a constant here
        args = (x, weight, ctx.eps, ctx.offset, ctx.cast_before_scale)
        gx, gw = create_graph_grads(
            rms_norm_reference, args, (need_x, need_w, False, False, False), (grad_y, grad_rstd)
        )[:2]
        return gx, gw, None, None, None
    gx, gw = rms_norm_backward(grad_y, x, weight, rstd, ctx.offset, ctx.cast_before_scale, need_x, need_w)
    return gx, gw, None, None, None


def rms_norm_backward(
    grad_y: Tensor,
    x: Tensor,
    weight: Tensor | None,
    rstd: Tensor,
    offset: float,
    cast_before_scale: bool,
    need_x: bool = True,
    need_w: bool = True,
) -> tuple[Tensor | None, Tensor | None]:
    """The existing ATen backward: ``aten._fused_rms_norm_backward`` on CUDA, its composite formula elsewhere.

    The Llama-style cast (``w * x̂.to(dtype)``) takes the fused kernel too when x and the weight share a dtype: it
    differentiates ``w * x̂`` with the cast as identity, as autograd does, but keeps the products ``grad * w`` and
    ``grad * x̂`` in fp32 where the composite formula rounds them (and x̂) to bf16 first: closer to the exact gradient,
    not bit-equal to stock. On the H200 the composite formula's dozen fp32 passes over ``[T, H]`` were the largest
    non-GEMM cost of a Qwen3-MoE step (``benchmarks/results/train_step.md``)."""
    acc = _acc_dtype(x)
    if weight is None or not offset:
        w_eff = weight
    elif cast_before_scale:  # the forward's w + offset, rounded to the weight's dtype (the reference's)
        w_eff = weight + offset
    else:
        w_eff = weight.to(acc) + offset
    # With an offset the effective weight is fp32 (Gemma): the fused kernel wants it in x's dtype, so the composite runs
    fused_ok = not cast_before_scale or weight is None or x.dtype == acc or weight.dtype == x.dtype
    if x.is_cuda and fused_ok and x.dtype == grad_y.dtype and (w_eff is None or w_eff.dtype == x.dtype):
        gx, gw = torch.ops.aten._fused_rms_norm_backward(grad_y, x, [x.shape[-1]], rstd, w_eff, [need_x, need_w])
    else:
        xhat = x.to(acc) * rstd
        g = grad_y.to(acc)
        gxhat = g if w_eff is None else g * w_eff.to(acc)
        gx = rstd * (gxhat - xhat * (gxhat * xhat).mean(-1, keepdim=True)) if need_x else None
        if need_w:
            # Llama-style scales the already-cast normalised value, so its weight grad sees the cast too
            xw = xhat.to(x.dtype).to(acc) if cast_before_scale else xhat
            gw = (g * xw).reshape(-1, x.shape[-1]).sum(0)
        else:
            gw = None
    gx = gx.to(x.dtype) if need_x and gx is not None else None
    gw = gw.to(weight.dtype) if need_w and gw is not None else None
    return gx, gw


_rms_norm_eager = EagerCall(RMS_NORM, rms_norm_op, _setup_context, _backward)


def rms_norm(
    x: Tensor,
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    offset: float = 0.0,
    cast_before_scale: bool = False,
) -> Tensor:
    """RMSNorm over the last dimension with the semantics of ``torch.nn.functional.rms_norm``.

    Args:
        x: ``[..., H]`` float tensor (fp32/bf16/fp16; fp64 runs on ATen).
        weight: optional ``[H]`` scale.
        eps: added to the mean square; ``None`` means ``torch.finfo(x.dtype).eps`` as in torch.
        offset: added to the weight in fp32 (``1.0`` for Gemma's ``1 + w``); with ``cast_before_scale``, in the
            weight's dtype (the weight then multiplies a value already in x's dtype).
        cast_before_scale: Llama-style: cast the normalised value to ``x.dtype`` before multiplying by the weight.
    """
    if eps is None:  # invalid x is reported by validation, inside the op
        eps = torch.finfo(x.dtype).eps if isinstance(x, Tensor) and x.is_floating_point() else 0.0
    args = (float(eps), float(offset), bool(cast_before_scale))
    if is_dtensor(x) or is_dtensor(weight):
        return run_on_local_shards(
            RMS_NORM,
            lambda xl, wl: rms_norm_op(xl, wl, *args)[0],
            lambda xd, wd: rms_norm_reference(xd, wd, *args)[0],
            x,
            weight,
            reduced_dims=(x.dim() - 1,),
            scalars=args,
        )
    return _rms_norm_eager(x, weight, *args)[0]
