"""Launching a ``@triton.jit`` kernel for less host time than ``kernel[grid](...)``.

On every call ``JITFunction.run`` binds all arguments, specialises each (dtype, 16-byte alignment of pointers,
integers equal to 1 or divisible by 16, 32- or 64-bit), builds a cache key and looks the compiled kernel up.
``FastLaunch`` keys the compiled kernel by those same facts of the runtime arguments (a few tensors and integers:
cheaper to compute here than the binder's general path) plus the caller's constants, and launches through the
compiled kernel's own launcher, as Inductor's generated code does. The first call of a key goes through
``kernel[grid](...)`` (compiling if needed) and keeps the kernel it returns. Host time per launch of the MX
dequantising kernel on the H200 host (``host_profile``, 90680a5 and 80049ec, two sessions): 17-29 us through
``JITFunction`` (as long as cuBLAS's whole call, or longer), 15-22 us through ``FastLaunch``, 8-13 us for the
compiled launcher alone; most of what is left is building the key in Python.

Launch hooks (profilers such as proton) are called as Triton calls them. The plain launch is kept under the
interpreter, and for good once the compiled kernel lacks a field used here (another Triton's internals) or its
launcher refuses the arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

try:  # Triton >= 3.4 (launch hooks in knobs)
    from triton import knobs
    from triton.runtime.driver import driver
except ImportError:  # older: plain launches only
    knobs = driver = None


def _spec(a: Any) -> tuple:
    """What Triton's specialisation reads of one runtime argument (over-keyed where unsure: never under-keyed)."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, bool):  # before int: a bool is an int
        return (bool, a)
    if isinstance(a, int):
        return (int, a == 1, a % 16 == 0, -(2**31) <= a < 2**31)
    return (type(a),)


def _key(args: Sequence[Any]) -> tuple:
    """``_spec`` of every argument, flattened, with the common cases inline: this runs on every launch (3 us for the
    dequantising kernel's 15 arguments against 6 through ``_spec`` alone, on a 2-core CI-class CPU)."""
    k: list[Any] = []
    for a in args:
        if type(a) is int:  # 1, divisible by 16, beyond 32 bits: one small int
            k.append((a % 16 == 0) + 2 * (a == 1) + 4 * (not -(2**31) <= a < 2**31))
        elif isinstance(a, torch.Tensor):
            k.append(a.dtype)
            k.append(a.data_ptr() % 16 == 0)
        else:
            k.append(_spec(a))
    return tuple(k)


def _device() -> int:
    return torch.cuda.current_device()


def _stream(device: int) -> int:
    return driver.active.get_current_stream(device)


class FastLaunch:
    """``FastLaunch(kernel)(grid, args, constants, num_warps=...)`` launches ``kernel`` like
    ``kernel[grid](*args, **constants, num_warps=...)``. ``args`` are the runtime arguments, in order, before every
    constexpr parameter; ``constants`` the constexpr values (by name, in parameter order)."""

    def __init__(self, kernel: Any) -> None:
        params = getattr(kernel, "params", None)  # None under the interpreter (an InterpretedFunction)
        flags = [p.is_constexpr for p in params or ()]
        if flags != sorted(flags):  # the launcher takes every parameter in order: constants must come last
            raise ValueError(f"{kernel.fn.__name__}: constexpr parameters must follow the runtime ones")
        self.kernel = kernel
        self.constexprs = [p.name for p in params or () if p.is_constexpr]
        self.compiled: dict[tuple, Any] = {}
        # the shortcut failed once (or cannot apply): plain launches from then on
        self.broken = params is None or knobs is None

    def __call__(self, grid: Sequence[int], args: Sequence[Any], constants: dict[str, Any], **options: Any) -> None:
        if self.broken:
            self.kernel[tuple(grid)](*args, **constants, **options)
            return
        device = _device()
        key = (device, tuple(constants.items()), tuple(options.items()), _key(args))
        k = self.compiled.get(key)
        if k is None:
            if list(constants) != self.constexprs:
                raise ValueError(f"{self.kernel.fn.__name__}: constants {list(constants)}, want {self.constexprs}")
            self.compiled[key] = self.kernel[tuple(grid)](*args, **constants, **options)
            return
        g = (*grid, 1, 1)
        try:  # what the compiled kernel's own runner does, launch hooks (profilers) included
            stream, all_args = _stream(device), (*args, *constants.values())
            hooks = knobs.runtime
            k.run(
                g[0], g[1], g[2], stream, k.function, k.packed_metadata, k.launch_metadata(g[:3], stream, *all_args),
                hooks.launch_enter_hook, hooks.launch_exit_hook, *all_args,
            )  # fmt: skip
        except (AttributeError, TypeError, ValueError):  # another Triton's launcher: the plain launch for good
            self.broken = True
            self.kernel[tuple(grid)](*args, **constants, **options)
