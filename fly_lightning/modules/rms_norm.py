"""``FlyRMSNorm``: ``nn.RMSNorm`` with a dispatched forward (same parameter, same state_dict keys)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fly_lightning.ops.rms_norm import rms_norm


class FlyRMSNorm(nn.Module):
    """RMSNorm over the last dimension.

    Args:
        hidden_size: size of the normalised (last) dimension.
        eps: ``None`` means ``torch.finfo(x.dtype).eps``, as in ``nn.RMSNorm``.
        elementwise_affine: learnable ``weight`` of shape ``[hidden_size]``.
        offset: scale by ``offset + weight`` (Gemma uses 1.0 and initialises the weight to 0).
        cast_before_scale: Llama-style cast of the normalised value before scaling.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float | None = None,
        elementwise_affine: bool = True,
        *,
        offset: float = 0.0,
        cast_before_scale: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.normalized_shape = (hidden_size,)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.offset = offset
        self.cast_before_scale = cast_before_scale
        if elementwise_affine:
            init = torch.zeros if offset else torch.ones
            self.weight = nn.Parameter(init(hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    @classmethod
    def from_module(cls, module: nn.Module, **options: object) -> FlyRMSNorm:
        """Wrap an existing module's weight (shared, not copied) with these options."""
        weight = getattr(module, "weight", None)
        shape = (int(weight.shape[0]),) if weight is not None else tuple(getattr(module, "normalized_shape", ()))
        if len(shape) != 1 or (weight is not None and weight.dim() != 1):
            raise ValueError(f"FlyRMSNorm normalises the last dimension only; {type(module).__name__} has {shape}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.normalized_shape = shape
        # transformers' norms name it variance_epsilon; None (torch's default, finfo(dtype).eps) only where neither is
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        new.eps = options.pop("eps", eps)
        new.elementwise_affine = weight is not None
        new.offset = float(options.pop("offset", 0.0))
        new.cast_before_scale = bool(options.pop("cast_before_scale", False))
        if options:
            raise TypeError(f"unknown options {sorted(options)}")
        if weight is not None:
            new.weight = weight
        else:
            new.register_parameter("weight", None)
        return new

    def reset_parameters(self) -> None:
        """The initial weight (ones; zeros with an ``offset``, as Gemma's), as ``nn.RMSNorm.reset_parameters``:
        Lightning's FSDP2 / model-parallel setup calls it to materialise a model built on the meta device."""
        if self.weight is not None:
            with torch.no_grad():
                (nn.init.zeros_ if self.offset else nn.init.ones_)(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.normalized_shape[0]:
            raise ValueError(f"FlyRMSNorm: expected last dim {self.normalized_shape[0]}, got {x.shape[-1]}")
        return rms_norm(x, self.weight, self.eps, offset=self.offset, cast_before_scale=self.cast_before_scale)

    def extra_repr(self) -> str:
        extra = f", offset={self.offset}" if self.offset else ""
        extra += ", cast_before_scale=True" if self.cast_before_scale else ""
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}{extra}"
