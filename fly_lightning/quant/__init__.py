"""MX quantisation (OCP MXFP8 / MXFP4) for the forward GEMMs: ``formats`` (element formats, E8M0 block scales, the
reference casts, bit-exact with torchao's ``to_mx``), ``config.FlyMXConfig`` for torchao's ``quantize_`` (also
``fly_lightning.FlyMXConfig``), ``linear.FlyMXLinear``, the module it swaps in, ``frozen``
(``FlyMXConfig(frozen=True)``: weights stored in MX, no master) and ``checkpoint`` (safetensors files of MX weights
and scales).

This package imports nothing at import time: ``formats`` sits under the MX operators, the rest above them, so the
public names below resolve lazily, on first access (``from fly_lightning.quant import FlyMXConfig`` works).
"""

from __future__ import annotations

import importlib

_PUBLIC = {
    "FlyMXConfig": "config",
    "mx_filter": "config",
    "FlyMXLinear": "linear",
    "MXSpec": "linear",
    "FlyMXFrozenLinear": "frozen",
    "FlyMXFrozenExperts": "frozen",
    "frozen_as_parameters": "frozen",
    "save_mx_checkpoint": "checkpoint",
    "load_mx_checkpoint": "checkpoint",
    "MXCheckpointError": "checkpoint",
    "MXLoadResult": "checkpoint",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> object:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
