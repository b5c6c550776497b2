"""Public operators: ``torch.library`` custom ops dispatched per shape signature (see ``fly_lightning.registry``)."""

from fly_lightning.ops.grouped_mm import grouped_mm
from fly_lightning.ops.moe_combine import moe_combine, moe_dispatch
from fly_lightning.ops.moe_grouped_mm import moe_grouped_mm
from fly_lightning.ops.moe_route import moe_route
from fly_lightning.ops.mx_cast import mx_cast
from fly_lightning.ops.mx_dequantize import mx_dequantize
from fly_lightning.ops.mx_fake_quantize import mx_fake_quantize
from fly_lightning.ops.mx_grouped_mm import mx_grouped_mm
from fly_lightning.ops.mx_scaled_mm import mx_scaled_mm
from fly_lightning.ops.rms_norm import rms_norm
from fly_lightning.ops.swiglu import swiglu
from fly_lightning.ops.topk import topk

__all__ = [
    "grouped_mm",
    "moe_combine",
    "moe_dispatch",
    "moe_grouped_mm",
    "moe_route",
    "mx_cast",
    "mx_dequantize",
    "mx_fake_quantize",
    "mx_grouped_mm",
    "mx_scaled_mm",
    "rms_norm",
    "swiglu",
    "topk",
]
