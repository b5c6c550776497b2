"""MX forward numerics for ``FlyMoE``'s experts (``FlyMoE.mx``, set by ``FlyMXConfig``), in the two forms of
``formats.KERNEL_PREFERENCES``:

- emulated: activations (token rows along H, the SwiGLU output along I) and weights (along their input dim, from the
  high-precision master every step) are cast to MX and back (``mx_fake_quantize``); the bf16 grouped GEMMs then run on
  exactly the products an MX GEMM with fp32 accumulation computes (torchao's emulated path) (``EmulatedProjection``);
- MX GEMM: each projection casts its rows and weights to MX bytes and scales (``mx_cast``) and runs ``mx_grouped_mm``
  (``MXGroupedProjection``), for backends that multiply MX natively (FlyDSL's scaled MFMAs on gfx950).

Both pass gradients straight through the casts as ``FlyMXLinear`` does: the bf16 grouped GEMMs' backward on the
high-precision operands (``grad_x = grad @ w^T``, ``grad_w = x^T @ grad`` per expert, the master weights and the
projection's input), so the forms differ only in summation order and keep no rounded copy of the weights for the
backward. Hopper has no MX tensor cores: there ``mx_grouped_mm`` dequantises to bf16 before the bf16 GEMM (0.7-0.8x
bf16 on the grouped suite), and ``"auto"`` takes the emulated form.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fly_lightning.dtensor import is_dtensor
from fly_lightning.ops.grouped_mm import autocast_operands, grouped_mm, grouped_mm_backward_call
from fly_lightning.ops.moe_grouped_mm import moe_grouped_mm, moe_grouped_mm_backward_call
from fly_lightning.ops.mx_cast import mx_cast
from fly_lightning.ops.mx_fake_quantize import mx_fake_quantize
from fly_lightning.ops.mx_grouped_mm import mx_grouped_mm
from fly_lightning.ops.mx_scaled_mm import emulated_form
from fly_lightning.quant import formats


class MXExperts:
    """The experts' MX numerics (see the module docstring).

    Args: ``weight`` / ``activation`` (None: weight-only) formats, scale ``mode`` and ``kernel_preference``, as
    ``FlyMXConfig``'s; ``frozen``: the block's expert container holds the weights in MX itself
    (``FlyMXConfig(frozen=True)``: its ``projections()`` are already the dequantised MX values, no master), so
    ``weight`` passes them through and the emulated form is kept.
    """

    def __init__(
        self, weight: str, activation: str | None, mode: str, frozen: bool = False, kernel_preference: str = "auto"
    ) -> None:
        self.weight_fmt, self.act_fmt, self.mode, self.frozen = weight, activation, mode, frozen
        self.kernel_preference = formats.as_kernel_preference(kernel_preference)

    def mx_gemm(self, x: Tensor, *weights_EKN: Tensor) -> bool:
        """Whether the projections of rows like ``x`` by ``weights_EKN`` (``[E, K, N]`` each) run ``mx_grouped_mm``
        (``MXGroupedProjection``) rather than the emulated form: one form for the whole block."""
        if self.frozen:
            return False
        per_byte = formats.as_format(self.weight_fmt).per_byte
        common = dict(
            bf16=True,  # without a native backend: emulated at any dtype (fp32 expert forms not measured apart)
            groups=weights_EKN[0].shape[0],
            weight_bytes=max(w.numel() for w in weights_EKN) // per_byte,
            dtensor=any(is_dtensor(t) for t in (x, *weights_EKN)),
        )
        pref, weight_only = self.kernel_preference, self.act_fmt is None
        return not any(
            emulated_form(pref, "mx_grouped_mm", x.device, weight_only, w.shape[1], w.shape[2], **common)
            for w in weights_EKN
        )

    def act(self, x: Tensor) -> Tensor:
        return x if self.act_fmt is None else _fake_quantize(x, self.act_fmt, self.mode)

    def weight(self, w_EKN: Tensor) -> Tensor:
        """``[E, K, N]`` weights cast along K (the contraction dim), same layout, no copy of the master: rows of the
        ``[E, N, K]`` storage (Hugging Face's layout) or the columns of ``[E * K, N]`` (K-major storage)."""
        if self.frozen:
            return w_EKN
        e, k, n = _checked(w_EKN).shape
        if w_EKN.is_contiguous():  # blocks down the columns of [E * K, N]: K % 32 == 0 keeps them within one expert
            return _fake_quantize(w_EKN.reshape(e * k, n), self.weight_fmt, self.mode, 0).reshape(e, k, n)
        rows = w_EKN.transpose(1, 2).reshape(e * n, k)  # one row per output column (a view of [E, N, K] storage)
        return _fake_quantize(rows, self.weight_fmt, self.mode).reshape(e, n, k).transpose(1, 2)

    def emulated(
        self, x: Tensor, x_q: Tensor, w_EKN: Tensor, offs_E: Tensor, perm_M: Tensor | None = None, topk: int = 1
    ) -> Tensor:
        """The emulated form's projection of rows ``x`` (tokens gathered through ``perm_M`` when given, as
        ``moe_grouped_mm``) by ``w_EKN``: the GEMM on ``x_q`` (``act(x)``, computed by the caller without a graph:
        one cast shared by gate and up) and the weights on the MX grid; gradients from ``x`` and the master."""
        return EmulatedProjection.apply(x, x_q.detach(), w_EKN, offs_E, perm_M, topk, self)

    def project(self, x_MK: Tensor, offs_E: Tensor, *weights_EKN: Tensor) -> tuple[Tensor, ...]:
        """``grouped_mm(x, w, offs)`` for each of ``weights_EKN`` on the MX values through ``mx_grouped_mm``
        (``mx_gemm``'s form): rows in expert order, high-precision ``x`` (cast once for all weights) and masters;
        differentiable in all of them."""
        x_MK, *weights_EKN = autocast_operands(x_MK, *weights_EKN)
        return MXGroupedProjection.apply(x_MK, offs_E, self, *weights_EKN)

    def __repr__(self) -> str:
        frozen = ", frozen" if self.frozen else ""
        return (
            f"MXExperts(weight={self.weight_fmt}{frozen}, activation={self.act_fmt}, mode={self.mode}, "
            f"kernel_preference={self.kernel_preference})"
        )


def _castable(t: Tensor) -> Tensor:
    """``t`` in a dtype the MX casts take: fp16 (``16-true`` / ``16-mixed`` runs) widened to fp32, where it is exact."""
    return t.float() if t.dtype == torch.float16 else t


def _fake_quantize(t: Tensor, fmt: str, mode: str, axis: int = -1) -> Tensor:
    """``mx_fake_quantize`` of ``t`` in its own dtype (fp16 through fp32: ``_castable``)."""
    return mx_fake_quantize(_castable(t), fmt, mode, axis).to(t.dtype)


def _checked(w_EKN: Tensor) -> Tensor:
    if w_EKN.shape[1] % formats.BLOCK:  # else column-wise blocks of [E * K, N] would straddle two experts
        raise ValueError(f"MXExperts: the input dim K={w_EKN.shape[1]} of {list(w_EKN.shape)} is not a multiple of 32")
    return w_EKN


class EmulatedProjection(torch.autograd.Function):
    """``y = grouped_mm(x_q, w_q, offs)`` (gathering token rows through ``perm`` when given), ``w_q`` the weights on
    the MX grid (``MXExperts.weight``); the backward is the bf16 one of ``grouped_mm(x, w, offs)``: only ``x`` and
    the master are saved (no rounded weight copy held until the backward)."""

    @staticmethod
    def forward(ctx, x, x_q, w_EKN, offs_E, perm_M, topk: int, mx: MXExperts) -> Tensor:
        w_q = mx.weight(w_EKN)
        if perm_M is None:
            y = grouped_mm(x_q, w_q, offs_E)
        else:
            y = moe_grouped_mm(x_q, w_q, offs_E, perm_M, topk=topk, gather=True)
        ctx.save_for_backward(x, w_EKN, offs_E, perm_M)
        ctx.topk = topk
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        x, w_EKN, offs_E, perm_M = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        if perm_M is None:
            dx, dw = grouped_mm_backward_call(grad, x, w_EKN, offs_E, need_x, need_w)
        else:
            dx, dw = moe_grouped_mm_backward_call(grad, x, w_EKN, offs_E, perm_M, ctx.topk, True, False, need_x, need_w)
        return (dx if need_x else None), None, (dw if need_w else None), None, None, None, None


class MXGroupedProjection(torch.autograd.Function):
    """``y_i = grouped_mm(x_q, w_q_i, offs)`` for each weight ``w_i``, computed as ``mx_grouped_mm`` of the MX casts
    (the rows cast once, shared by separate gate and up weights); the backward is the bf16 one on the high-precision
    operands, as the emulated form's: ``grad_x = sum_i grad_i @ w_i^T``, ``grad_w_i = x^T @ grad_i`` per expert."""

    @staticmethod
    def forward(ctx, x_MK: Tensor, offs_E: Tensor, mx: MXExperts, *weights_EKN: Tensor) -> tuple[Tensor, ...]:
        if mx.act_fmt is None:  # weight-only: the rows as they are
            x_d, x_s = _castable(x_MK), None
        else:
            x_d, x_s = mx_cast(_castable(x_MK), mx.act_fmt, mx.mode)
        outs = []
        for w_EKN in weights_EKN:
            e, k, n = _checked(w_EKN).shape
            rows = w_EKN.transpose(1, 2).reshape(e * n, k)  # [E, N, K] rows: a view of HF storage, else one copy
            w_d, w_s = mx_cast(_castable(rows), mx.weight_fmt, mx.mode)
            outs.append(
                mx_grouped_mm(
                    x_d, w_d.reshape(e, n, -1), w_s.reshape(e, n, -1), mx.weight_fmt, offs_E, x_scale=x_s,
                    x_fmt=mx.act_fmt, out_dtype=x_MK.dtype,
                )
            )  # fmt: skip
        ctx.save_for_backward(x_MK, offs_E, *weights_EKN)
        ctx.set_materialize_grads(False)  # an output nobody used gets no gradient work
        return tuple(outs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads_MN: Tensor | None):
        x_MK, offs_E, *weights_EKN = ctx.saved_tensors
        need_x = ctx.needs_input_grad[0]
        dx, dws = None, []
        for i, (grad_MN, w_EKN) in enumerate(zip(grads_MN, weights_EKN, strict=True)):
            need_w = ctx.needs_input_grad[3 + i]
            if grad_MN is None or not (need_x or need_w):
                dws.append(None)
                continue
            dx_i, dw = grouped_mm_backward_call(grad_MN, x_MK, w_EKN, offs_E, need_x, need_w)
            if need_x:
                dx = dx_i if dx is None else dx + dx_i
            dws.append(dw if need_w else None)
        return dx, None, None, *dws
