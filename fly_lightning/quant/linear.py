"""``FlyMXLinear``: an ``nn.Linear`` whose forward GEMM runs in MX (training and inference), its backward in the
weights' precision.

Each forward casts the activations (unless weight-only) and the high-precision weight to MX along K (``mx_cast``) and
multiplies them with ``mx_scaled_mm``; the weight stays a plain high-precision parameter, so optimizers, state dicts
and checkpoints see the module as the ``nn.Linear`` it replaced. Backward is the straight-through estimator on ATen
(``grad_x = grad_y @ W``, ``grad_W = grad_y^T @ x``, in the weight's precision), as torchao's MX training recipes
compute the high-precision gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from fly_lightning.ops.mx_cast import mx_cast
from fly_lightning.ops.mx_scaled_mm import mx_scaled_mm
from fly_lightning.quant import formats


@dataclass(frozen=True)
class MXSpec:
    """What ``FlyMXLinear`` casts to: the weight's format, the activations' (None: weight-only) and the scale mode
    (None: ``formats.default_mode`` of the two formats, as ``FlyMXConfig``)."""

    weight: str = "mxfp8_e4m3"
    activation: str | None = "mxfp8_e4m3"
    mode: str | None = None

    def __post_init__(self) -> None:
        if self.mode is None:  # frozen dataclass: the resolved default set once
            object.__setattr__(self, "mode", formats.default_mode(self.weight, self.activation).value)


class _MXLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK: Tensor, w_NK: Tensor, spec: MXSpec) -> Tensor:
        ctx.save_for_backward(x_MK, w_NK)
        b, b_scale = mx_cast(w_NK, spec.weight, spec.mode)
        if spec.activation is None:
            return mx_scaled_mm(x_MK, b, b_scale, spec.weight, out_dtype=x_MK.dtype)
        a, a_scale = mx_cast(x_MK, spec.activation, spec.mode)
        return mx_scaled_mm(a, b, b_scale, spec.weight, a_scale=a_scale, a_fmt=spec.activation, out_dtype=x_MK.dtype)

    @staticmethod
    def backward(ctx, grad_MN: Tensor):
        x_MK, w_NK = ctx.saved_tensors
        grad_x = grad_MN.to(w_NK.dtype) @ w_NK if ctx.needs_input_grad[0] else None
        grad_w = grad_MN.t().to(x_MK.dtype) @ x_MK if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


class FlyMXLinear(nn.Linear):
    """An ``nn.Linear`` with an MX forward GEMM (see the module docstring); ``in_features % 32 == 0``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, spec: MXSpec = MXSpec(), **kw):
        if in_features % 32:
            raise ValueError(f"FlyMXLinear: in_features must be a multiple of 32 (MX blocks), got {in_features}")
        super().__init__(in_features, out_features, bias, **kw)
        self.spec = spec

    @classmethod
    def from_linear(cls, linear: nn.Linear, spec: MXSpec) -> FlyMXLinear:
        """Wrap ``linear``'s own parameters (shared, not copied): same state dict keys, shapes and tensors."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features, new.spec = linear.in_features, linear.out_features, spec
        new.weight, new.bias = linear.weight, linear.bias
        new._forward_hooks, new._forward_pre_hooks = linear._forward_hooks, linear._forward_pre_hooks
        return new

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features)
        if torch.is_autocast_enabled(x.device.type):  # as F.linear: operands in the autocast dtype
            dtype = torch.get_autocast_dtype(x.device.type)
            x2, w = x2.to(dtype), self.weight.to(dtype)
        else:
            x2, w = x2.to(self.weight.dtype), self.weight
        with torch.autocast(x.device.type, enabled=False):
            y = _MXLinearFunction.apply(x2, w, self.spec)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, weight={self.spec.weight}, activation={self.spec.activation}, "
            f"mode={self.spec.mode}"
        )
