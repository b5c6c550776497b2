"""The torchao configuration: ``quantize_(model, FlyMXConfig(...), filter_fn=...)`` (or ``Fly*Strategy(quantization=
FlyMXConfig(...))``) swaps each selected ``nn.Linear`` for ``FlyMXLinear``, whose forward GEMM runs through the
dispatched MX operators (``mx_cast``, ``mx_scaled_mm``: their dispatch log, support matrix and callbacks cover it),
and gives each selected ``FlyMoE`` block MX expert numerics (``FlyMoE.mx``: casts through ``mx_cast``, GEMMs on
the dequantised operands). ``mx_filter`` selects both, leaving the output head and routers in high precision.

A Linear whose ``in_features`` is not a multiple of 32 (MX blocks) is left as it is, with a warning naming it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from torch import nn
from torchao.core.config import AOBaseConfig
from torchao.quantization.transform_module import register_quantize_module_handler

from fly_lightning.modules.moe import FlyMoE, MXExperts
from fly_lightning.quant import formats
from fly_lightning.quant.linear import FlyMXLinear, MXSpec


@dataclass
class FlyMXConfig(AOBaseConfig):
    """MX forward GEMMs for ``nn.Linear``.

    Args:
        weight: the weights' MX format: ``"mxfp8_e4m3"``, ``"mxfp8_e5m2"`` or ``"mxfp4_e2m1"``.
        activation: the activations' format, or None for weight-only (bf16/fp32 activations times MX weights).
        mode: scale mode, ``"floor"`` or ``"rceil"`` (torchao's ``ScaleCalculationMode`` values).
    """

    weight: str = "mxfp8_e4m3"
    activation: str | None = "mxfp8_e4m3"
    mode: str = "floor"

    def __post_init__(self) -> None:
        formats.as_format(self.weight)
        if self.activation is not None:
            formats.as_format(self.activation)
        self.mode = formats.as_mode(self.mode).value

    @property
    def spec(self) -> MXSpec:
        return MXSpec(self.weight, self.activation, self.mode)


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
    if isinstance(module, FlyMXLinear) or not isinstance(module, nn.Linear):
        return module
    if module.in_features % formats.BLOCK:
        warnings.warn(
            f"FlyMXConfig: Linear({module.in_features}, {module.out_features}) left in high precision: in_features "
            f"is not a multiple of {formats.BLOCK}",
            stacklevel=2,
        )
        return module
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
    moe.mx = MXExperts(config.weight, config.activation, config.mode)
    return moe
