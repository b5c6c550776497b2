"""Launching a ``@triton.jit`` kernel for less host time than ``kernel[grid](...)``.

On every call ``JITFunction.run`` binds all arguments, specialises each (dtype, 16-byte alignment of pointers,
integers equal to 1 or divisible by 16, 32- or 64-bit), builds a cache key and looks the compiled kernel up.
``FastLaunch`` keys the compiled kernel by those same facts of the runtime arguments (a few tensors and integers:
cheaper to compute here than the binder's general path) plus the caller's constants, and launches through the
compiled kernel's own launcher, as Inductor's generated code does. The first call of a key goes through
``kernel[grid](...)`` (compiling if needed) and keeps the kernel it returns. Host time per launch of the MX
dequantising kernel on the H200 host (``host_profile``, 80049ec): 29 us through ``JITFunction`` (longer than
cuBLAS's whole call there), 22 us through ``FastLaunch``, 13 us for the compiled launcher alone; most of what is left
is building the key in Python.

Launch hooks (profilers such as proton) are called as Triton calls them; a change of Triton's debug or
instrumentation settings misses the cache, as it recompiles there. The plain launch is kept under the interpreter,
on ROCm (whose Triton also specialises on storage size), for kernels with pre-run hooks, and for good once the
launcher refuses the arguments (another Triton's internals).
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


def _key(args: Sequence[Any]) -> tuple:
    """What Triton's specialisation reads of the runtime arguments on CUDA, flattened (over-keyed where unsure):
    dtype and 16-byte alignment of tensors; of ints whether they equal 1, divide by 16, pass 32 or 63 bits;
    the type of floats and None. Anything else (a tensor descriptor, ...) raises ``TypeError``: not keyed here.
    This runs on every launch: the common cases inline, no helper call per argument."""
    k: list[Any] = []
    for a in args:
        if type(a) is int:  # one small int
            k.append((a % 16 == 0) + 2 * (a == 1) + 4 * (not -(2**31) <= a < 2**31) + 8 * (a >= 2**63))
        elif isinstance(a, torch.Tensor):
            k.append(a.dtype)
            k.append(a.data_ptr() % 16 == 0)
        elif a is None or type(a) is float:
            k.append(type(a))
        else:
            raise TypeError(f"no specialisation key for a {type(a).__name__}")
    return tuple(k)


def _device() -> int:
    return torch.cuda.current_device()


def _stream(device: int) -> int:
    return driver.active.get_current_stream(device)


def _hooks_set(hook: Any) -> bool:
    """Whether a launch hook would run (Triton 3.6 keeps None when unset, later ones an empty ``HookChain``)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _state() -> tuple:
    """Runtime settings ``JITFunction.run`` compiles under (debug, instrumentation): a change compiles anew there,
    so it must miss here too."""
    return (getattr(knobs.runtime, "debug", None), getattr(knobs.compilation, "instrumentation_mode", None))


class FastLaunch:
    """``FastLaunch(kernel)(grid, args, **kwargs)`` launches ``kernel`` as ``kernel[grid](*args, **kwargs)`` does:
    ``args`` are all runtime arguments, positional and in order; ``kwargs`` the constexprs (omitted ones take their
    defaults) and launch options (``num_warps``, ...)."""

    def __init__(self, kernel: Any) -> None:
        params = getattr(kernel, "params", None)  # None under the interpreter (an InterpretedFunction)
        flags = [p.is_constexpr for p in params or ()]
        self.kernel = kernel
        self.constexprs = [p for p in params or () if p.is_constexpr]
        self.n_runtime = len(flags) - len(self.constexprs)
        self.compiled: dict[tuple, tuple[Any, tuple]] = {}
        self.verified = False  # one direct launch went through: the launcher takes our arguments
        # plain launches for good: interpreted; constexprs between runtime parameters (the launcher takes every
        # parameter in order: here constants follow the arguments); no launch knobs (older Triton); ROCm, whose
        # Triton also specialises tensors on their storage size (32-bit buffer offsets), not keyed here; or a
        # launcher that refused the arguments once
        self.broken = params is None or flags != sorted(flags) or knobs is None or torch.version.hip is not None

    def __call__(self, grid: Sequence[int], args: Sequence[Any], **kwargs: Any) -> None:
        hit = key = None
        if not self.broken and len(args) == self.n_runtime and not getattr(self.kernel, "pre_run_hooks", None):
            try:
                key = (_device(), _state(), tuple(kwargs.items()), _key(args))
                hit = self.compiled.get(key)
            except TypeError:  # an argument not keyed here, or an unhashable option: the plain launch
                key = None
        if hit is None:
            k = self.kernel[tuple(grid)](*args, **kwargs)
            if key is not None and k is not None:
                try:
                    consts = tuple(kwargs[p.name] if p.name in kwargs else p.default for p in self.constexprs)
                except AttributeError:  # another Triton's parameters: plain launches for good
                    self.broken = True
                    return
                self.compiled[key] = (k, consts)
            return
        k, consts = hit
        if self.verified:  # what the compiled kernel's own runner does, launch hooks (profilers) included
            k.run(*_launch_args(k, grid, key[0], args, consts))
            return
        try:
            launch = _launch_args(k, grid, key[0], args, consts)
        except AttributeError:  # another Triton's compiled kernel: plain launches for good
            self.broken = True
            self.kernel[tuple(grid)](*args, **kwargs)
            return
        try:
            k.run(*launch)
        except (AttributeError, TypeError, ValueError):
            self.broken = True
            if _hooks_set(knobs.runtime.launch_enter_hook) or _hooks_set(knobs.runtime.launch_exit_hook):
                raise  # a hook may have failed after the kernel was queued: never launch it twice
            self.kernel[tuple(grid)](*args, **kwargs)  # another Triton's launcher refused the arguments
            return
        self.verified = True


def _launch_args(k: Any, grid: Sequence[int], device: int, args: Sequence[Any], consts: tuple) -> tuple:
    """The compiled launcher's arguments, as the compiled kernel's own runner passes them."""
    g = (*grid, 1, 1)
    stream, all_args = _stream(device), (*args, *consts)
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    # without launch hooks nothing reads the metadata: skip the call (and its argument packing)
    meta = k.launch_metadata(g[:3], stream, *all_args) if _hooks_set(enter) or _hooks_set(leave) else None
    return (g[0], g[1], g[2], stream, k.function, k.packed_metadata, meta, enter, leave, *all_args)
