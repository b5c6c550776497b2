"""The three backends and how their availability is decided.

Availability is decided once per process and never by launching a kernel: a FlyDSL launch without the HIP runtime
aborts the process (SIGABRT), so its runtime probe runs in a subprocess.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Backend:
    name: str
    library: str | None  # Python package the kernels need; None for ATen
    probe: Callable[[], str | None]  # None when usable, else why not
    kernels: str | None  # package holding this backend's kernel modules

    def unavailable_reason(self) -> str | None:
        return _probe_cached(self.name)

    def is_available(self) -> bool:
        return self.unavailable_reason() is None

    def library_installed(self) -> bool:
        return self.library is None or importlib.util.find_spec(self.library) is not None


def _triton_probe() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton not installed"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    if not torch.cuda.is_available():
        return "no CUDA/ROCm device (TRITON_INTERPRET=1 runs Triton on CPU)"
    return None


_FLYDSL_ARCHES = ("gfx950",)

# Loads the FlyDSL JIT runtime and the HIP runtime without launching anything; run in a subprocess because a broken
# ROCm install can abort the interpreter while loading.
_FLYDSL_RUNTIME_PROBE = """
import ctypes, os, sys
import flydsl
root = os.path.dirname(flydsl.__file__)
ctypes.CDLL("libamdhip64.so.7")
ctypes.CDLL(os.path.join(root, "_mlir", "_mlir_libs", "libfly_jit_runtime.so"))
"""


def _flydsl_probe() -> str | None:
    if torch.version.hip is None:
        return "not a ROCm build of torch"
    if not torch.cuda.is_available():
        return "no ROCm device"
    arch = torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
    if arch not in _FLYDSL_ARCHES:
        return f"device arch {arch} (kernels target {', '.join(_FLYDSL_ARCHES)})"
    if importlib.util.find_spec("flydsl") is None:
        return "flydsl not installed"
    if os.environ.get("FLY_LIGHTNING_SKIP_FLYDSL_PROBE") == "1":
        return None
    try:
        proc = subprocess.run([sys.executable, "-c", _FLYDSL_RUNTIME_PROBE], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"FlyDSL runtime probe failed: {exc}"
    if proc.returncode != 0:
        tail = proc.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        return f"FlyDSL runtime not loadable: {tail[0][:120]}"
    return None


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("flydsl", "flydsl", _flydsl_probe, "fly_lightning.kernels.flydsl"),
        Backend("triton", "triton", _triton_probe, "fly_lightning.kernels.triton"),
        Backend("aten", None, lambda: None, None),
    )
}
"""Every backend, in the default preference order (the fallback, ``aten``, last)."""


@functools.cache
def _probe_cached(name: str) -> str | None:
    return BACKENDS[name].probe()


def clear_probes() -> None:
    """Forget cached availability (``fly_lightning.registry.reset_availability`` also forgets the decisions)."""
    _probe_cached.cache_clear()
