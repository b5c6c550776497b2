"""``FlyMXLinear``: an ``nn.Linear`` whose forward GEMM runs in MX (training and inference), its backward in the
weights' precision.

Each forward puts the activations (unless weight-only) and the high-precision weight on the MX grid along K and
multiplies them, in one of two forms of the same arithmetic (``MXSpec.kernel_preference``,
``formats.KERNEL_PREFERENCES``):

- ``"mx_gemm"``: cast both to MX bytes and scales (``mx_cast``) and multiply with ``mx_scaled_mm``;
- ``"emulated"``: fake-quantise both (``mx_fake_quantize``: cast and back in one pass) and run the plain GEMM on
  the MX values (``_product``), as torchao's emulated MX training does;
- ``"auto"`` (default): the MX GEMM where a backend multiplies MX natively (FlyDSL on gfx950, MX x MX) and for
  fp32 models the Triton kernel takes; else emulated, measured faster for bf16 on the H200 at every row count
  (``ops.mx_scaled_mm.emulated_form``).

The weight stays a plain high-precision parameter, so optimizers, state dicts and checkpoints see the module as the
``nn.Linear`` it replaced. Backward is the straight-through estimator on ATen
(``grad_x = grad_y @ W``, ``grad_W = grad_y^T @ x``, in the weight's precision), as torchao's MX training recipes
compute the high-precision gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from fly_lightning.dtensor import is_dtensor
from fly_lightning.modules._state import carry_module_state
from fly_lightning.ops.mx_cast import mx_cast
from fly_lightning.ops.mx_fake_quantize import mx_fake_quantize
from fly_lightning.ops.mx_scaled_mm import emulated_form, mx_scaled_mm
from fly_lightning.quant import formats


@dataclass(frozen=True)
class MXSpec:
    """What ``FlyMXLinear`` casts to: the weight's format, the activations' (None: weight-only), the scale mode
    (None: ``formats.default_mode`` of the two formats, as ``FlyMXConfig``) and the form of the GEMM
    (``kernel_preference``: ``formats.KERNEL_PREFERENCES``)."""

    weight: str = "mxfp8_e4m3"
    activation: str | None = "mxfp8_e4m3"
    mode: str | None = None
    kernel_preference: str = "auto"

    def __post_init__(self) -> None:  # frozen dataclass: resolved values set once
        if self.mode is None:
            object.__setattr__(self, "mode", formats.default_mode(self.weight, self.activation).value)
        object.__setattr__(self, "kernel_preference", formats.as_kernel_preference(self.kernel_preference))

    def emulated(self, x_MK: Tensor, w_NK: Tensor) -> bool:
        """Whether the forward of ``x_MK`` with weight ``w_NK`` fake-quantises and runs a plain GEMM
        (``ops.mx_scaled_mm.emulated_form``; see the module docstring)."""
        k, n = x_MK.shape[1], w_NK.shape[0]
        return emulated_form(
            self.kernel_preference, "mx_scaled_mm", x_MK.device, self.activation is None, k, n,
            bf16=x_MK.dtype == torch.bfloat16, dtensor=is_dtensor(x_MK) or is_dtensor(w_NK),
        )  # fmt: skip


def _product(x_q: Tensor, w_q: Tensor) -> Tensor:
    """``x_q @ w_q^T`` on MX values; fp32 operands on a GPU through cuBLAS's bf16 GEMM with an fp32 result, as
    ``mx_scaled_mm``'s prepass runs them (MX values are bf16 values; weight-only fp32 activations are rounded to bf16
    there too), not an fp32 GEMM."""
    if x_q.is_cuda and x_q.dtype == torch.float32 and not (is_dtensor(x_q) or is_dtensor(w_q)):  # no DTensor rule
        return torch.mm(x_q.bfloat16(), w_q.bfloat16().t(), out_dtype=torch.float32)
    return x_q @ w_q.t()


COMPUTE = (torch.bfloat16, torch.float32)
"""Dtypes the MX casts take; other float operands (fp16: Lightning's ``16-true`` / ``16-mixed``) are computed in fp32,
where fp16 values are exact, and the result is rounded back."""


def linear_dtypes(x: Tensor, stored: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """``(compute, out)`` dtypes of an MX Linear's forward: ``out`` as ``F.linear`` gives it (the autocast dtype under
    autocast, else the weights' ``stored`` dtype), ``compute`` the same or fp32 where the MX casts cannot take it."""
    out = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else stored
    return (out if out in COMPUTE else torch.float32), out


def check_features(owner: nn.Module, x: Tensor) -> None:
    """An input of the wrong width gets a named error before any cast or kernel (as ``nn.Linear`` refuses it)."""
    if x.dim() == 0 or x.shape[-1] != owner.in_features:
        raise ValueError(
            f"{type(owner).__name__}: input of shape {list(x.shape)} has {x.shape[-1] if x.dim() else 0} features, "
            f"the layer takes {owner.in_features}"
        )


class _MXLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(x_MK: Tensor, w_NK: Tensor, spec: MXSpec) -> Tensor:
        if spec.emulated(x_MK, w_NK):
            w_q = mx_fake_quantize(w_NK, spec.weight, spec.mode)
            x_q = x_MK if spec.activation is None else mx_fake_quantize(x_MK, spec.activation, spec.mode)
            return _product(x_q, w_q)
        b, b_scale = mx_cast(w_NK, spec.weight, spec.mode)
        if spec.activation is None:
            return mx_scaled_mm(x_MK, b, b_scale, spec.weight, out_dtype=x_MK.dtype)
        a, a_scale = mx_cast(x_MK, spec.activation, spec.mode)
        return mx_scaled_mm(a, b, b_scale, spec.weight, a_scale=a_scale, a_fmt=spec.activation, out_dtype=x_MK.dtype)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: Tensor) -> None:  # apart from forward: torch.func.grad needs it
        ctx.save_for_backward(inputs[0], inputs[1])

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
        """Wrap ``linear``'s own parameters (shared, not copied): same state dict keys, shapes and tensors; its
        train/eval flag and forward/backward hooks too (``carry_module_state``)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features, new.spec = linear.in_features, linear.out_features, spec
        new.weight, new.bias = linear.weight, linear.bias
        return carry_module_state(new, linear)

    def forward(self, x: Tensor) -> Tensor:
        check_features(self, x)
        dtype, out = linear_dtypes(x, self.weight.dtype)  # as F.linear: operands in the autocast dtype under it
        with torch.autocast(x.device.type, enabled=False):
            y = _MXLinearFunction.apply(x.reshape(-1, self.in_features).to(dtype), self.weight.to(dtype), self.spec)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(out).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, weight={self.spec.weight}, activation={self.spec.activation}, "
            f"mode={self.spec.mode}, kernel_preference={self.spec.kernel_preference}"
        )
