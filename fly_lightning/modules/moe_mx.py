"""MX forward numerics for ``FlyMoE``'s experts (``FlyMoE.mx``, set by ``FlyMXConfig``), in the two forms of
``formats.KERNEL_PREFERENCES``:

- emulated: activations (token rows along H, the SwiGLU output along I) and weights (along their input dim, from the
  high-precision master every step) are cast to MX and back (``mx_fake_quantize``); the bf16 grouped GEMMs then run on
  exactly the products an MX GEMM with fp32 accumulation computes (torchao's emulated path);
- MX GEMM: each projection casts its rows and weights to MX bytes and scales (``mx_cast``) and runs ``mx_grouped_mm``
  (``MXGroupedProjection``), for backends that multiply MX natively (FlyDSL's scaled MFMAs on gfx950).

Both pass gradients straight through the casts and compute them from the MX values (``grad_x = grad @ w_q^T``,
``grad_w = x_q^T @ grad`` per expert), so the forms differ only in summation order. Hopper has no MX tensor cores:
there ``mx_grouped_mm`` dequantises to bf16 before the bf16 GEMM (0.7-0.8x bf16 on the grouped suite), and
``"auto"`` takes the emulated form.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fly_lightning.dtensor import is_dtensor
from fly_lightning.ops.grouped_mm import autocast_operands, grouped_mm_backward_call
from fly_lightning.ops.mx_cast import mx_cast
from fly_lightning.ops.mx_dequantize import mx_dequantize
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


class MXGroupedProjection(torch.autograd.Function):
    """``y_i = grouped_mm(x_q, w_q_i, offs)`` for each weight ``w_i``, computed as ``mx_grouped_mm`` of the MX casts
    (the rows cast once, shared by separate gate and up weights), with the straight-through backward of the emulated
    form: ``grad_x = sum_i grad_i @ w_q_i^T``, ``grad_w_i = x_q^T @ grad_i`` per expert, ``x_q`` / ``w_q_i``
    dequantised from the saved MX bytes (``mx_dequantize``: half the bytes a bf16 copy would keep)."""

    @staticmethod
    def forward(ctx, x_MK: Tensor, offs_E: Tensor, mx: MXExperts, *weights_EKN: Tensor) -> tuple[Tensor, ...]:
        if mx.act_fmt is None:  # weight-only: the rows as they are
            x_d, x_s = _castable(x_MK), None
        else:
            x_d, x_s = mx_cast(_castable(x_MK), mx.act_fmt, mx.mode)
        outs, saved = [], []
        for w_EKN in weights_EKN:
            e, k, n = _checked(w_EKN).shape
            rows = w_EKN.transpose(1, 2).reshape(e * n, k)  # [E, N, K] rows: a view of HF storage, else one copy
            w_d, w_s = mx_cast(_castable(rows), mx.weight_fmt, mx.mode)
            w_d, w_s = w_d.reshape(e, n, -1), w_s.reshape(e, n, -1)
            saved += [w_d, w_s]
            outs.append(
                mx_grouped_mm(x_d, w_d, w_s, mx.weight_fmt, offs_E, x_scale=x_s, x_fmt=mx.act_fmt, out_dtype=x_MK.dtype)
            )
        x_saved = (x_MK,) if mx.act_fmt is None else (x_d, x_s)
        ctx.save_for_backward(offs_E, *x_saved, *saved)
        ctx.mx, ctx.dtype = mx, x_MK.dtype
        # a contiguous [E, K, N] master (torchtitan): dW in that layout
        ctx.n_major = [w.stride(2) == 1 and w.stride(1) != 1 for w in weights_EKN]
        ctx.set_materialize_grads(False)  # an output nobody used gets no gradient work
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads_MN: Tensor | None):
        mx, dtype = ctx.mx, ctx.dtype
        offs_E, *rest = ctx.saved_tensors
        if mx.act_fmt is None:
            x_q, *saved = rest
        else:
            x_d, x_s, *saved = rest
            x_q = mx_dequantize(x_d, x_s, mx.act_fmt, dtype)
        need_x = ctx.needs_input_grad[0]
        dx, dws = None, []
        for i, grad_MN in enumerate(grads_MN):
            need_w = ctx.needs_input_grad[3 + i]
            if grad_MN is None or not (need_x or need_w):
                dws.append(None)
                continue
            w_d, w_s = saved[2 * i], saved[2 * i + 1]
            e, n = w_d.shape[:2]
            w_q = mx_dequantize(w_d.reshape(e * n, -1), w_s.reshape(e * n, -1), mx.weight_fmt, dtype)
            w_q_EKN = w_q.reshape(e, n, -1).transpose(1, 2)  # [E, K, N], K-major like Hugging Face's storage
            if need_w and ctx.n_major[i]:  # dW in the master's own layout (no copy by autograd): the layout is read
                # off the third argument's strides, so an expanded scalar (strides 0) stands for an N-major [E, K, N]
                like = w_q_EKN.new_empty(()).expand(w_q_EKN.shape)
                dx_i, _ = grouped_mm_backward_call(grad_MN, x_q, w_q_EKN, offs_E, need_x, False)
                _, dw = grouped_mm_backward_call(grad_MN, x_q, like, offs_E, False, True)
            else:
                dx_i, dw = grouped_mm_backward_call(grad_MN, x_q, w_q_EKN, offs_E, need_x, need_w)
            if need_x:
                dx = dx_i if dx is None else dx + dx_i
            dws.append(dw if need_w else None)
        return dx, None, None, *dws
