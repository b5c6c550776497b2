"""Support checks shared by the Triton kernels."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from typing import Any

import torch
import triton
from triton.runtime.autotuner import Autotuner

from fly_lightning.kernels.triton._launch import FastLaunch

ON_HIP = torch.version.hip is not None
"""A ROCm build of torch: its GPUs (gfx950) report CUDA-style capabilities (9.5) that Hopper checks would take."""


@functools.cache
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (persistent kernels size their grids by it)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


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


INTERPRETER_ROWS = 1024
"""Rows per program for the row-wise kernels under the CPU interpreter, whose cost is per program (the recipe's MoE
combine and dispatch ran 3-4x faster than with the GPU plan's 32 rows); 0 keeps the GPU plan (the kernel tests do,
so that they cross program boundaries)."""


def rows_per_program(rows: int, planned: int, t: torch.Tensor) -> int:
    """``planned`` on a GPU; under the CPU interpreter up to ``INTERPRETER_ROWS`` (same arithmetic per element)."""
    if INTERPRETER_ROWS and interpreting() and t.device.type == "cpu":
        return max(planned, min(INTERPRETER_ROWS, 1 << max(0, rows - 1).bit_length()))
    return planned


def on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Make ``t``'s GPU current for a launch: Triton launches on the current device's stream, which need not be t's."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def launch_tuned(tuned: Autotuner, grid: Callable[[dict], tuple], args: tuple, consts: dict[str, Any]) -> None:
    """Launch the ``triton.autotune`` kernel ``tuned``: through its autotuner the first time a tuning key is seen
    (which measures the configs), then straight through the kernel with the config it picked (``FastLaunch``). The
    autotuner's bookkeeping on every call cost 8.4-15 us of host time per RMSNorm launch on the H200 host (its launch
    against the picked config's, ``host_ab_d531afd_6d2294d.md``).

    The key holds what the autotuner's does (its key arguments, which must be in ``consts``, and every tensor's
    dtype); the picks live on ``tuned`` itself. Configs with a ``pre_hook`` are refused (the fast path would skip it).
    Two threads tuning the same kernel at once could record each other's pick: a slower launch, never a wrong one,
    as long as configs only change launch parameters (RMSNorm's: rows per program and warps).
    """
    picks: dict[tuple, triton.Config] = tuned.__dict__.setdefault("_fly_picks", {})
    key = (*(consts[k] for k in tuned.keys), *(a.dtype for a in args if isinstance(a, torch.Tensor)))
    config = picks.get(key)
    if config is None:
        tuned[grid](*args, **consts)
        config = tuned.best_config
        if config.pre_hook is not None:
            raise ValueError("launch_tuned: configs with a pre_hook need the autotuner on every launch")
        picks[key] = config
        return
    meta = {**consts, **config.all_kwargs()}
    fast = tuned.__dict__.get("_fly_fast") or tuned.__dict__.setdefault("_fly_fast", FastLaunch(tuned.fn))
    fast(grid(meta), args, **meta)
