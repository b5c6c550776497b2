"""Kernel outputs: the one allocator for the tensors a Triton or FlyDSL kernel writes.

Every output a kernel module allocates goes through ``empty`` / ``empty_like`` (``tests/kernels/test_outputs.py``
scans the kernel modules for raw ``torch.empty``). Workspaces that must start at zero stay ``torch.zeros``.

Production: an output whose every element the kernel stores skips the fill that
``torch.use_deterministic_algorithms(True)`` gives every new tensor (NaN, or the largest integer, so that reading
memory nobody wrote is reproducible). For such outputs the fill is a wasted pass: one more kernel per tensor (the
routing op on Mixtral's shape, H200, CUDA-graph replay: 6.0 us with deterministic algorithms before skipping it,
2.4 us after, the same as without them; ``moe_route_9e1325c.md``, ``moe_route_6bee48c.md``). ``written_in_full=False``
(an output that leaves elements unwritten by contract, as the grouped GEMM's rows past the last offset) keeps
PyTorch's behaviour, fill included. The fill is skipped by switching PyTorch's process-wide setting off around the
allocation: another thread allocating at that moment skips its fill too (results stay right, only unwritten memory
would not read as NaN there), and switching it back on would undo another thread's switching it off in between.

Tests: with ``POISON`` set (``tests/conftest.py`` sets it for the whole session) every output is filled as
deterministic mode fills new tensors (NaN for floating and complex dtypes, the largest value for integers, True for
bool), with or without deterministic algorithms, so an element a kernel fails to store shows in the tests'
comparisons. A correct kernel overwrites every poisoned element (or, where ``written_in_full=False``, leaves exactly
the elements its contract leaves unspecified), so the fill changes no result.
"""

from __future__ import annotations

import torch
import torch.utils.deterministic

POISON = False
"""Process-wide: poison every kernel output (tests only; see the module docstring)."""


def empty(*size, dtype: torch.dtype, device: torch.device | str, written_in_full: bool = True) -> torch.Tensor:
    """``torch.empty(*size, dtype=dtype, device=device)`` for a kernel's output (see the module docstring)."""
    if POISON:
        return _poisoned(_no_fill(torch.empty, size, dtype=dtype, device=device))
    if written_in_full and torch.are_deterministic_algorithms_enabled():
        return _no_fill(torch.empty, size, dtype=dtype, device=device)
    return torch.empty(*size, dtype=dtype, device=device)


def empty_like(t: torch.Tensor, *, dtype: torch.dtype | None = None, written_in_full: bool = True) -> torch.Tensor:
    """``torch.empty_like(t, dtype=dtype)`` for a kernel's output (see the module docstring)."""
    if POISON:
        return _poisoned(_no_fill(torch.empty_like, (t,), dtype=dtype))
    if written_in_full and torch.are_deterministic_algorithms_enabled():
        return _no_fill(torch.empty_like, (t,), dtype=dtype)
    return torch.empty_like(t, dtype=dtype)


def poison_value(dtype: torch.dtype) -> float | int | bool:
    """What ``POISON`` fills a ``dtype`` output with."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return True
    return torch.iinfo(dtype).max


def _poisoned(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(poison_value(t.dtype)) if t.numel() else t


def _no_fill(factory, args: tuple, **kwargs) -> torch.Tensor:
    """``factory(*args, **kwargs)`` without deterministic mode's fill."""
    if not (torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory):
        return factory(*args, **kwargs)
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        return factory(*args, **kwargs)
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = True
