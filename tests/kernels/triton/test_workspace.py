"""Zeroed workspaces shared by the counting kernels: one per (device, stream), grown on demand, and capture slots."""

import torch

from fly_lightning.kernels.triton import _workspace
from fly_lightning.kernels.triton._workspace import MIN_INTS, capture_slot, zeroed


def test_one_per_device_and_stream_grown_on_demand(monkeypatch):
    monkeypatch.setattr(_workspace, "_WORKSPACES", {})
    cpu = torch.device("cpu")
    small = zeroed(cpu, 5)
    assert small.numel() == MIN_INTS and small.dtype == torch.int32 and not small.any()
    assert zeroed(cpu, MIN_INTS) is small  # the same buffer while it is large enough
    big = zeroed(cpu, MIN_INTS + 1)
    assert big.numel() == MIN_INTS + 1 and not big.any() and zeroed(cpu, 7) is big


def test_capture_slots_are_disjoint_zeroed_and_run_out(monkeypatch):
    """Captured launches take slots from a pool zeroed before capture; none is handed out twice, and when the pool is
    used up (or was never made) the caller gets None and captures its own zeroing instead."""
    dev = torch.device("cpu")  # the bookkeeping only; the pool is made on the first CUDA launch
    monkeypatch.setattr(_workspace, "_capture_pools", {})
    assert capture_slot(dev, 9) is None
    _workspace._capture_pools[dev] = [torch.zeros(100, dtype=torch.int32), 0]
    a, b, c = capture_slot(dev, 9), capture_slot(dev, 41), capture_slot(dev, 9)
    assert (a.numel(), b.numel(), c is None) == (9, 41, True)  # 32 + 64 ints used; 32 more do not fit
    assert (a.storage_offset(), b.storage_offset()) == (0, 32)  # each on its own 128-byte line
    a.fill_(1)
    assert not b.any()
