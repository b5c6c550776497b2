"""Kernel modules, one package per backend (``triton``, ``flydsl``); each module registers into its operator.

This package sits above ``fly_lightning.ops`` (its modules import the operators they implement); nothing in the
dispatch core imports it. ``import fly_lightning`` calls ``load_kernels``.
"""

from __future__ import annotations

import importlib
import pkgutil

from fly_lightning.backends import BACKENDS

_loaded = False


def load_kernels() -> None:
    """Import every kernel module; each registers itself into its operator.

    A module whose backend library is missing (e.g. no triton) is skipped; the dispatcher then reports the backend as
    not installed. FlyDSL modules import ``flydsl`` lazily, so they register everywhere.
    """
    global _loaded
    if _loaded:
        return
    _loaded = True
    import fly_lightning.ops  # noqa: F401  (operators exist before kernels register into them)

    for backend in BACKENDS.values():
        if backend.kernels is None:
            continue
        pkg = importlib.import_module(backend.kernels)
        for info in pkgutil.iter_modules(pkg.__path__):
            if info.name.startswith("_"):
                continue
            try:
                importlib.import_module(f"{backend.kernels}.{info.name}")
            except ImportError:
                if backend.library_installed():
                    raise
