"""Routing permutations: the value check (CPU) and the inverse, shared by the MoE ops."""

from __future__ import annotations

import torch
from torch import Tensor


def check_permutation(t: Tensor, what: str) -> None:
    """Raise unless the (CPU) values of ``t`` are a permutation of ``range(len(t))``."""
    n = t.shape[0]
    if n and (int(t.min()) < 0 or int(t.max()) >= n):
        raise ValueError(f"{what} values must lie in [0, {n}) (a permutation of range({n}))")
    if n and not bool(torch.bincount(t.long(), minlength=n).eq(1).all()):
        raise ValueError(f"{what} must be a permutation of range({n}) (a value repeats)")


def inverse_permutation(perm: Tensor) -> Tensor:
    """``inv`` with ``inv[perm[r]] = r`` (a scatter with unique indices: deterministic)."""
    p = perm.long()
    return torch.empty_like(p).scatter_(0, p, torch.arange(p.shape[0], device=p.device)).to(perm.dtype)
