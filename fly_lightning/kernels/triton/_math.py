"""Host-side integer arithmetic for launch planning (grids, block sizes), shared by the Triton launchers.

Plain Python on purpose: ``triton.cdiv`` and ``triton.next_power_of_2`` are JIT functions, slow on the host path.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << (max(1, n) - 1).bit_length()
