"""Support checks shared by the Triton kernels."""

from __future__ import annotations

import contextlib
import os

import torch


def device_reason(*tensors: torch.Tensor | None) -> str | None:
    """Why Triton cannot run on these tensors' device, or None."""
    for t in tensors:
        if t is None:
            continue
        if t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            return "tensor on CPU (Triton needs a GPU, or TRITON_INTERPRET=1)"
        if t.device.type not in ("cpu", "cuda"):
            return f"device {t.device.type}"
    return None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Make ``t``'s GPU current for a launch: Triton launches on the current device's stream, which need not be t's."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()
