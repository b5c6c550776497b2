"""Public operators: ``torch.library`` custom ops dispatched per shape signature (see ``fly_lightning.registry``)."""

from fly_lightning.ops.moe_route import moe_route
from fly_lightning.ops.rms_norm import rms_norm
from fly_lightning.ops.topk import topk

__all__ = ["moe_route", "rms_norm", "topk"]
