"""Layout fallback reasons shared by the backends' support predicates."""

from __future__ import annotations

import torch


def copy_reason(name: str, t: torch.Tensor, what: str = "last dim not contiguous") -> str:
    """The fallback reason for an input whose layout the kernel cannot read, with the bytes a copy into its layout
    would take (the dispatch log says what fitting it would cost)."""
    return f"{name} {what} (a layout copy of {t.numel() * t.element_size()} bytes would fit it)"
