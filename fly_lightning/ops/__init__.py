"""Public operators: ``torch.library`` custom ops dispatched per shape signature (see ``fly_lightning.registry``)."""

from fly_lightning.ops.rms_norm import rms_norm

__all__ = ["rms_norm"]
