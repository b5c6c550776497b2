"""Zeroed int32 workspaces for kernels whose programs count across each other (routing tickets and totals, split-K
arrival counters). Each launch re-zeroes what it used, so the workspace is zero between launches and no launch pays a
memset (on the H100 host a ``torch.zeros`` cost 7.2-7.6 us of host time per call, this lookup 1.6-1.7 us, and the
memset a node on the GPU: ``probe_mx_w4_floor``).

One per (device, stream), grown on demand, so launches on different streams never share one. Under CUDA graph
capture each captured launch gets a slot of its own for good: from a pool zeroed outside capture (on the device's
first launch) while it has room, so no memset node; else a fresh zeroed buffer, whose zeroing is captured too. Either
way a graph may be replayed anywhere, any number of times.
"""

from __future__ import annotations

import torch

from fly_lightning.kernels.triton._math import cdiv

MIN_INTS = 2048  # the smallest workspace made: routing's largest need (two ints per expert, 1024 experts)
CAPTURE_POOL_INTS = 1 << 18  # 1 MiB: ~248 captured routing launches with 1024 experts, ~8000 with 8
CAPTURE_SLOT_ALIGN = 32  # ints: slots start on their own 128-byte line

_WORKSPACES: dict[tuple, torch.Tensor] = {}
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what Inductor's generated code calls
_capture_pools: dict[torch.device, list] = {}  # device -> [zeroed pool, next free int]


def capture_slot(device: torch.device, ints: int) -> torch.Tensor | None:
    """A zeroed ``[ints]`` int32 slot owned by one captured launch for good, or None when the pool is used up (or
    was never made). Slots are never handed out twice, so graphs never share one, however they are replayed."""
    pool = _capture_pools.get(device)
    if pool is None:
        return None
    size = cdiv(ints, CAPTURE_SLOT_ALIGN) * CAPTURE_SLOT_ALIGN
    start = pool[1]
    if start + size > pool[0].numel():
        return None
    pool[1] = start + size
    return pool[0][start : start + ints]


def _raw_stream(device: torch.device) -> int:
    """The current stream's handle: cheaper than ``torch.cuda.current_stream``, which builds a Stream object."""
    return _RAW_STREAM(device.index) if _RAW_STREAM is not None else torch.cuda.current_stream(device).cuda_stream


def zeroed(device: torch.device, ints: int) -> torch.Tensor:
    """At least ``ints`` int32 that are zero now and that the caller's kernel leaves zero (see the module docstring)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        slot = capture_slot(device, ints)
        return slot if slot is not None else torch.zeros(ints, dtype=torch.int32, device=device)
    if device.type == "cuda" and device not in _capture_pools:
        _capture_pools[device] = [torch.zeros(CAPTURE_POOL_INTS, dtype=torch.int32, device=device), 0]
    stream = _raw_stream(device) if device.type == "cuda" else 0
    ws = _WORKSPACES.get((device, stream))
    if ws is None or ws.numel() < ints:
        # a smaller one still queued on this stream is freed in stream order: nothing later on the stream reads it
        ws = _WORKSPACES[(device, stream)] = torch.zeros(max(ints, MIN_INTS), dtype=torch.int32, device=device)
    return ws
