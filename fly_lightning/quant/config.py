"""The torchao configuration: ``quantize_(model, FlyMXConfig(...), filter_fn=...)`` (or ``Fly*Strategy(quantization=
FlyMXConfig(...))``) swaps each selected ``nn.Linear`` for ``FlyMXLinear`` and gives each selected ``FlyMoE`` block
MX expert numerics (``FlyMoE.mx``). Both multiply MX values through the dispatched MX operators, in the form
``kernel_preference`` picks: ``mx_fake_quantize`` then the plain GEMMs (emulated), or ``mx_cast`` then
``mx_scaled_mm`` / ``mx_grouped_mm`` (MX GEMM); the dispatch log, support matrix and callbacks cover them.
``mx_filter`` selects both, leaving the output head and routers in high precision.

``FlyMXConfig(frozen=True)`` stores the selected weights in MX instead, with no high-precision master and no weight
gradient (``quant.frozen``): Linears become ``FlyMXFrozenLinear``, a block's expert container ``FlyMXFrozenExperts``.
To freeze only the experts: ``filter_fn=lambda m, fqn: isinstance(m, FlyMoE)``.

A Linear whose ``in_features`` is not a multiple of 32 (MX blocks) is left as it is, with a warning naming it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn
from torchao.core.config import AOBaseConfig
from torchao.quantization.transform_module import register_quantize_module_handler

from fly_lightning.modules.moe import FlyMoE, MXExperts
from fly_lightning.quant import formats
from fly_lightning.quant.frozen import FlyMXFrozenExperts, FlyMXFrozenLinear, install_saved_tensor_hooks
from fly_lightning.quant.linear import FlyMXLinear, MXSpec


@dataclass
class FlyMXConfig(AOBaseConfig):
    """MX forward GEMMs for ``nn.Linear``.

    Args:
        weight: the weights' MX format: ``"mxfp8_e4m3"``, ``"mxfp8_e5m2"`` or ``"mxfp4_e2m1"``.
        activation: the activations' format, or None for weight-only (bf16/fp32 activations times MX weights).
        mode: scale mode, ``"floor"`` or ``"rceil"`` (torchao's ``ScaleCalculationMode`` values). None (default):
            ``formats.default_mode`` (``"rceil"`` when every format is MXFP8, else ``"floor"``).
        frozen: store the weights in MX (data and scales as buffers), drop the high-precision weights, no weight
            gradient (``fly_lightning.quant.frozen``); False: training, cast from the master every forward.
        kernel_preference: how training layers multiply (``formats.KERNEL_PREFERENCES``): ``"auto"`` (default;
            the MX GEMM ops where a kernel multiplies the MX bytes themselves, else ``"emulated"``), ``"emulated"``
            (fake-quantised operands and the plain GEMM: the same products) or ``"mx_gemm"``; torchao's
            ``KernelPreference.AUTO`` / ``.EMULATED`` are taken too. Frozen weights ignore it: Linears run
            ``mx_scaled_mm``, experts the bf16 grouped GEMMs on their dequantised weights.
    """

    weight: str = "mxfp8_e4m3"
    activation: str | None = "mxfp8_e4m3"
    mode: str | None = None
    frozen: bool = False
    kernel_preference: str = "auto"

    def __post_init__(self) -> None:
        formats.as_format(self.weight)
        if self.activation is not None:
            formats.as_format(self.activation)
        mode = formats.default_mode(self.weight, self.activation) if self.mode is None else self.mode
        self.mode = formats.as_mode(mode).value
        self.kernel_preference = formats.as_kernel_preference(self.kernel_preference)

    @property
    def spec(self) -> MXSpec:
        return MXSpec(self.weight, self.activation, self.mode, self.kernel_preference)


def torchao_quantized(module: nn.Module) -> str | None:
    """What torchao converted ``module`` to (its module class, or its weight's tensor subclass, e.g. ``MXTensor`` from
    ``MXDynamicActivationMXWeightConfig``), or None: such a layer already has its own quantized GEMM, and casting its
    weight again would quantize twice."""
    if type(module).__module__.startswith("torchao."):
        return type(module).__name__
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and type(weight).__module__.startswith("torchao."):
        return type(weight).__name__
    return None


def mx_filter(module: nn.Module, fqn: str) -> bool:
    """``quantize_``'s ``filter_fn`` for ``FlyMXConfig``: every ``nn.Linear`` and swapped MoE block, except the output
    head (``lm_head``) and routers (``gate``/``router``), which published MX recipes keep in high precision."""
    if not isinstance(module, (nn.Linear, FlyMoE)):
        return False
    last = fqn.rsplit(".", 1)[-1]
    return last not in ("lm_head", "output", "gate", "router") and not fqn.endswith(".router.gate")


@register_quantize_module_handler(FlyMXConfig)
def _swap_linear(module: nn.Module, config: FlyMXConfig) -> nn.Module:
    if isinstance(module, FlyMoE):
        return _mx_experts(module, config)
    if not isinstance(module, nn.Linear):  # FlyMXFrozenLinear included: it holds no nn.Linear weight
        return module
    if (owner := torchao_quantized(module)) is not None:
        warnings.warn(
            f"FlyMXConfig: Linear({module.in_features}, {module.out_features}) left as it is: already quantized by "
            f"torchao ({owner})",
            stacklevel=2,
        )
        return module
    if isinstance(module, FlyMXLinear) and not config.frozen:
        return module
    if module.in_features % formats.BLOCK:
        warnings.warn(
            f"FlyMXConfig: Linear({module.in_features}, {module.out_features}) left in high precision: in_features "
            f"is not a multiple of {formats.BLOCK}",
            stacklevel=2,
        )
        return module
    if config.frozen:  # from a Linear or a training FlyMXLinear: its master is dropped
        return FlyMXFrozenLinear.from_linear(module, config.spec)
    return FlyMXLinear.from_linear(module, config.spec)


def _mx_experts(moe: FlyMoE, config: FlyMXConfig) -> FlyMoE:
    """The block's experts take MX forward numerics (``FlyMoE.mx``); its router and shared experts are not touched
    here (the shared experts' ``nn.Linear`` layers are ``quantize_``'s own targets)."""
    bad = [f"{n} {d}" for n, d in (("hidden", moe.hidden_size), ("intermediate", moe.intermediate_size)) if d % 32]
    if bad:
        warnings.warn(
            f"FlyMXConfig: MoE experts left in high precision: {' and '.join(bad)} not a multiple of "
            f"{formats.BLOCK} (MX blocks)",
            stacklevel=2,
        )
        return moe
    if isinstance(moe.experts, FlyMXFrozenExperts):
        if not config.frozen:
            warnings.warn("FlyMXConfig: MoE experts already frozen in MX are left frozen", stacklevel=2)
        return moe
    if config.frozen:
        moe.experts = FlyMXFrozenExperts.from_moe(moe, config.spec)  # the old container (the masters) goes
        install_saved_tensor_hooks(moe)
    moe.mx = MXExperts(config.weight, config.activation, config.mode, config.frozen, config.kernel_preference)
    return moe
