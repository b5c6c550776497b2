"""Triton grouped GEMM for uneven expert loads: the kernel and its launcher (configurations: ``_grouped_mm_config``).

Design:
- The tile schedule over (group, tile) is built on the device from ``offs``; the launch grid depends on shapes only
  (no host sync: CUDA graphs, torch.compile). Persistent: ``programs_per_sm x SMs`` programs walk the global tile
  sequence ``pid, pid + P, ...``; otherwise one program per tile of the host-side upper bound
  ``(cdiv(M, BLOCK_M) + E) x cdiv(N, BLOCK_N)``, the surplus exiting at once. Two schedules:
  ``scan`` - every program loads all offsets as one vector, sums the tile counts, and advances a scalar group cursor
  over its (increasing) tiles: one launch; ``table`` - a one-program kernel writes the tiles' prefix sums, each tile
  finds its group by an unrolled binary search: a second tiny launch, but no reduction or loop op around the tile
  loop, which Triton's Hopper warp specialisation requires.
- Within a group, tiles are ordered in bands of ``GROUP_M`` row tiles, so programs running together share the expert's
  weight columns and the band's rows in L2.
- Offsets are clamped to ``[0, M]`` and group sizes to >= 0 on the device: invalid offsets (the host never reads
  them) cannot address memory outside the tensors.
- Loads: TMA tensor descriptors created on the device (``tl.make_tensor_descriptor``) where strides are 16-byte
  aligned: activations through one ``[M, K]`` descriptor (a tile's rows past its group end come from the next group
  and are never stored), weights through a 3-D ``[E, K, N]`` / ``[E, N, K]`` descriptor (the K tail is zero-filled
  per expert). Plain masked pointer loads otherwise (unaligned strides, pre-Hopper GPUs, the interpreter if asked,
  and gathered activation rows). Stores: masked pointer stores, or a per-group TMA descriptor of shape
  ``[group end, N]`` that clips the rows of the next group. Rows at and past ``offs[-1]`` are never written.
- ``GATHER``: A row r is ``x[idx[r] // TOPK]`` (token rows read through the routing permutation, no permuted copy).
  ``SCATTER``: output row r is written to row ``idx[r]`` (slot order, no un-permute copy).
- bf16 ``tl.dot`` is wrong in the Triton interpreter: operands are upcast to fp32 there (``UPCAST``); loops over
  device values are ``while`` loops there (the interpreter cannot ``range`` over a tensor).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import time
import warnings
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from fly_lightning import policy, tuning
from fly_lightning.kernels import outputs
from fly_lightning.kernels.triton._grouped_mm_config import (
    INTERPRETER_PROGRAMS,
    MEASURED,
    REJECTED,
    GroupedMMConfig,
    choose_config,
    measure_key,
    shape_class,
    table_config,
    tune_candidates,
)
from fly_lightning.kernels.triton._launch import FastLaunch
from fly_lightning.kernels.triton._math import cdiv, next_pow2
from fly_lightning.kernels.triton._support import ON_HIP, interpreting, num_sms, on_device


@triton.jit
def _band_swizzle(local, num_m, num_n, GROUP_M: tl.constexpr):
    """Tile ``local`` of a group's ``num_m x num_n`` grid, ordered in bands of GROUP_M row tiles."""
    width = GROUP_M * num_n
    first_m = (local // width) * GROUP_M
    band_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (local % width) % band_m
    pid_n = (local % width) // band_m
    return pid_m, pid_n


@triton.jit
def _mma_step(
    acc,
    kk,
    a_ptrs,
    w_ptrs,
    a_desc,
    w_desc,
    row_ok,
    col_ok,
    row0,
    n0,
    g,
    K,
    stride_wk,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    W_K_MAJOR: tl.constexpr,
    TMA_A: tl.constexpr,
    TMA_W: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """acc += A[:, k-tile kk] @ W[g][k-tile kk, :]."""
    k0 = kk * BLOCK_K
    ks = k0 + tl.arange(0, BLOCK_K)
    if TMA_A:
        a = a_desc.load([row0, k0])  # rows past the group end belong to the next group: never stored
    else:
        a = tl.load(a_ptrs + ks[None, :], mask=row_ok[:, None] & (ks[None, :] < K), other=0.0)
    if TMA_W:
        if W_K_MAJOR:
            b = w_desc.load([g, n0, k0]).reshape(BLOCK_N, BLOCK_K).T
        else:
            b = w_desc.load([g, k0, n0]).reshape(BLOCK_K, BLOCK_N)
    else:
        b = tl.load(w_ptrs + ks[:, None] * stride_wk, mask=(ks[:, None] < K) & col_ok[None, :], other=0.0)
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc)


@triton.jit
def _scan_start(pid, OFFS, M, E, num_n, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
    """Every group's tile count from the offsets (clamped to [0, M], as ``_advance`` clamps them), summed, and a
    scalar group cursor at group 0 for this program to carry across its increasing tiles:
    ``(total, g, g_first, g_start, g_end, g_size, g_tiles)``."""
    e_ids = tl.arange(0, E_POW2)
    ends = tl.minimum(tl.maximum(tl.load(OFFS + e_ids, mask=e_ids < E, other=0), 0), M)
    starts = tl.minimum(tl.maximum(tl.load(OFFS + e_ids - 1, mask=(e_ids > 0) & (e_ids < E), other=0), 0), M)
    total = tl.sum(tl.cdiv(tl.maximum(ends - starts, 0), BLOCK_M) * num_n, axis=0)
    g = pid * 0
    g_end = tl.minimum(tl.maximum(tl.load(OFFS), 0), M)  # group 0 starts at row 0: its size is its end
    return total, g, g, g, g_end, g_end, tl.cdiv(g_end, BLOCK_M) * num_n


@triton.jit
def _advance(tile, g, g_first, g_start, g_end, g_size, g_tiles, OFFS, M, E, num_n, BLOCK_M: tl.constexpr):
    """Move the group cursor until ``tile`` lies in group g; the same clamped arithmetic as the tile count."""
    while (tile >= g_first + g_tiles) & (g < E - 1):
        g_first += g_tiles
        g += 1
        g_start = g_end
        g_end = tl.minimum(tl.maximum(tl.load(OFFS + g), 0), M)
        g_size = tl.maximum(g_end - g_start, 0)
        g_tiles = tl.cdiv(g_size, BLOCK_M) * num_n
    return g, g_first, g_start, g_end, g_size, g_tiles


@triton.jit
def _group_rows(OFFS, g, M):
    """Rows [start, start + size) of group g, clamped to [0, M] (the host never validates device offsets)."""
    start = tl.minimum(tl.maximum(tl.load(OFFS + g - 1, mask=g > 0, other=0), 0), M)
    end = tl.minimum(tl.maximum(tl.load(OFFS + g), 0), M)
    return start, tl.maximum(end - start, 0)


@triton.jit
def _tile_schedule_kernel(OFFS, TILE_END, M, N, E, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          E_POW2: tl.constexpr):  # fmt: skip
    """TILE_END[e] = number of output tiles in groups 0..e (inclusive prefix sum), for the table schedule."""
    e_ids = tl.arange(0, E_POW2)
    ends = tl.minimum(tl.maximum(tl.load(OFFS + e_ids, mask=e_ids < E, other=0), 0), M)
    starts = tl.minimum(tl.maximum(tl.load(OFFS + e_ids - 1, mask=(e_ids > 0) & (e_ids < E), other=0), 0), M)
    tiles = tl.cdiv(tl.maximum(ends - starts, 0), BLOCK_M) * tl.cdiv(N, BLOCK_N)
    tl.store(TILE_END + e_ids, tl.cumsum(tiles, axis=0), mask=e_ids < E)


@triton.jit
def _find_group(TILE_END, tile, E, LOG2_E: tl.constexpr):
    """The group of ``tile``: how many groups end at or before it (branch-free binary search, no loop op)."""
    lo = tile * 0
    for step in tl.static_range(LOG2_E - 1, -1, -1):
        probe = lo + (1 << step)
        inside = probe <= E
        ends_at = tl.load(TILE_END + probe - 1, mask=inside, other=2147483647)
        lo = tl.where(inside & (ends_at <= tile), probe, lo)
    return tl.minimum(lo, E - 1)


# fmt: off
@triton.jit
def _tile(
    tile, g, g_first, g_start, g_size, X, W, OUT, IDX, a_desc, w_desc, N, K,
    stride_xm, stride_we, stride_wk, stride_wn, stride_om, num_n, k_tiles,
    TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    W_K_MAJOR: tl.constexpr, TMA_A: tl.constexpr, TMA_W: tl.constexpr, TMA_STORE: tl.constexpr,
    GATHER: tl.constexpr, SCATTER: tl.constexpr, UPCAST: tl.constexpr, WS_K: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Compute and store output tile ``tile`` (of group g, whose rows are [g_start, g_start + g_size))."""
    pid_m, pid_n = _band_swizzle(tile - g_first, tl.cdiv(g_size, BLOCK_M), num_n, GROUP_M)
    row0 = g_start + pid_m * BLOCK_M
    row_end = g_start + g_size
    n0 = pid_n * BLOCK_N
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if GATHER:
        src = tl.load(IDX + rows, mask=row_ok, other=0) // TOPK
    else:
        src = tl.where(row_ok, rows, 0)
    a_ptrs = X + src.to(tl.int64)[:, None] * stride_xm
    w_ptrs = W + g.to(tl.int64) * stride_we + cols[None, :] * stride_wn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if INTERPRET:  # the interpreter cannot range over a device value
        kk = 0
        while kk < k_tiles:
            acc = _mma_step(acc, kk, a_ptrs, w_ptrs, a_desc, w_desc, row_ok, col_ok, row0, n0, g, K, stride_wk,
                            BLOCK_K, BLOCK_M, BLOCK_N, W_K_MAJOR, TMA_A, TMA_W, UPCAST)
            kk += 1
    else:
        for kk in tl.range(0, k_tiles, warp_specialize=WS_K):
            acc = _mma_step(acc, kk, a_ptrs, w_ptrs, a_desc, w_desc, row_ok, col_ok, row0, n0, g, K, stride_wk,
                            BLOCK_K, BLOCK_M, BLOCK_N, W_K_MAJOR, TMA_A, TMA_W, UPCAST)

    c = acc.to(OUT.dtype.element_ty)
    if TMA_STORE:
        # shape [group end, N]: the descriptor clips the rows that belong to the next group
        o_desc = tl.make_tensor_descriptor(OUT, shape=[row_end, N], strides=[stride_om, 1],
                                           block_shape=[BLOCK_M, BLOCK_N])
        o_desc.store([row0, n0], c)
    else:
        if SCATTER:
            dst = tl.load(IDX + rows, mask=row_ok, other=0)
        else:
            dst = rows
        o_ptrs = OUT + dst.to(tl.int64)[:, None] * stride_om + cols[None, :]
        tl.store(o_ptrs, c, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _grouped_mm_kernel(
    X, W, OUT, OFFS, IDX, TILE_END, M, N, K, E, X_ROWS,
    stride_xm, stride_we, stride_wk, stride_wn, stride_om, NUM_PROGS,
    E_POW2: tl.constexpr, TABLE: tl.constexpr, LOG2_E: tl.constexpr, TOPK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    W_K_MAJOR: tl.constexpr, TMA_A: tl.constexpr, TMA_W: tl.constexpr, TMA_STORE: tl.constexpr,
    GATHER: tl.constexpr, SCATTER: tl.constexpr, UPCAST: tl.constexpr,
    WS_K: tl.constexpr, WS_TILES: tl.constexpr, FLATTEN: tl.constexpr, INTERPRET: tl.constexpr,
    SPECIALIZE: tl.constexpr = False, N_C: tl.constexpr = 0, K_C: tl.constexpr = 0, SXM_C: tl.constexpr = 0,
    SWE_C: tl.constexpr = 0, SWK_C: tl.constexpr = 0, SWN_C: tl.constexpr = 0, SOM_C: tl.constexpr = 0,
):
    if SPECIALIZE:  # N, K and the strides as compile-time constants (M stays a runtime value): one compilation per
        # weight shape, as Inductor's template compiles its static shapes
        N = N_C
        K = K_C
        stride_xm = SXM_C
        stride_we = SWE_C
        stride_wk = SWK_C
        stride_wn = SWN_C
        stride_om = SOM_C
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)

    if TABLE:  # tile counts from _tile_schedule_kernel: no reduction here (Hopper warp specialisation refuses them)
        total = tl.load(TILE_END + E - 1)
    else:  # every group's tile count from the offsets, clamped like _group_rows
        e_ids = tl.arange(0, E_POW2)
        ends = tl.minimum(tl.maximum(tl.load(OFFS + e_ids, mask=e_ids < E, other=0), 0), M)
        starts = tl.minimum(tl.maximum(tl.load(OFFS + e_ids - 1, mask=(e_ids > 0) & (e_ids < E), other=0), 0), M)
        total = tl.sum(tl.cdiv(tl.maximum(ends - starts, 0), BLOCK_M) * num_n, axis=0)

    a_desc = X  # placeholders when not TMA (never used then)
    w_desc = W
    if TMA_A:
        a_desc = tl.make_tensor_descriptor(X, shape=[X_ROWS, K], strides=[stride_xm, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
    if TMA_W:
        if W_K_MAJOR:
            w_desc = tl.make_tensor_descriptor(W, shape=[E, N, K], strides=[stride_we, stride_wn, 1],
                                               block_shape=[1, BLOCK_N, BLOCK_K])
        else:
            w_desc = tl.make_tensor_descriptor(W, shape=[E, K, N], strides=[stride_we, stride_wk, 1],
                                               block_shape=[1, BLOCK_K, BLOCK_N])

    if not TABLE:  # scan schedule: a scalar group cursor carried across this program's tiles (increasing order)
        g = pid * 0
        g_first = pid * 0  # global index of group g's first tile
        g_start = pid * 0
        g_end = tl.minimum(tl.maximum(tl.load(OFFS), 0), M)
        g_size = tl.maximum(g_end - g_start, 0)
        g_tiles = tl.cdiv(g_size, BLOCK_M) * num_n
    if INTERPRET:  # the interpreter cannot range over a device value
        tile = pid
        while tile < total:
            if TABLE:
                g = _find_group(TILE_END, tile, E, LOG2_E)
                g_first = tl.load(TILE_END + g - 1, mask=g > 0, other=0)
                g_start, g_size = _group_rows(OFFS, g, M)
            else:
                g, g_first, g_start, g_end, g_size, g_tiles = _advance(
                    tile, g, g_first, g_start, g_end, g_size, g_tiles, OFFS, M, E, num_n, BLOCK_M)
            _tile(tile, g, g_first, g_start, g_size, X, W, OUT, IDX, a_desc, w_desc, N, K,
                  stride_xm, stride_we, stride_wk, stride_wn, stride_om, num_n, k_tiles,
                  TOPK, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, W_K_MAJOR, TMA_A, TMA_W, TMA_STORE,
                  GATHER, SCATTER, UPCAST, WS_K, INTERPRET)
            tile += NUM_PROGS
    else:
        for tile in tl.range(pid, total, NUM_PROGS, flatten=FLATTEN, warp_specialize=WS_TILES):
            if TABLE:
                g = _find_group(TILE_END, tile, E, LOG2_E)
                g_first = tl.load(TILE_END + g - 1, mask=g > 0, other=0)
                g_start, g_size = _group_rows(OFFS, g, M)
            else:
                g, g_first, g_start, g_end, g_size, g_tiles = _advance(
                    tile, g, g_first, g_start, g_end, g_size, g_tiles, OFFS, M, E, num_n, BLOCK_M)
            _tile(tile, g, g_first, g_start, g_size, X, W, OUT, IDX, a_desc, w_desc, N, K,
                  stride_xm, stride_we, stride_wk, stride_wn, stride_om, num_n, k_tiles,
                  TOPK, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, W_K_MAJOR, TMA_A, TMA_W, TMA_STORE,
                  GATHER, SCATTER, UPCAST, WS_K, INTERPRET)
# fmt: on


def _aligned(t: torch.Tensor, *strides: int) -> bool:
    es = t.element_size()
    return t.data_ptr() % 16 == 0 and all((s * es) % 16 == 0 for s in strides)


def _tma_allocator(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def tma_available(t: torch.Tensor) -> bool:
    """Device-side tensor descriptors: Hopper or newer, or the interpreter; not on ROCm (the table's ROCm choice is the
    pointer path, see ``table_config``)."""
    if t.device.type == "cpu":
        return interpreting()
    if ON_HIP:
        return False
    return hasattr(tl, "make_tensor_descriptor") and torch.cuda.get_device_capability(t.device) >= (9, 0)


def _effective_config(cfg: GroupedMMConfig, tma_a: bool, tma_w: bool, tma_store: bool, interp: bool) -> GroupedMMConfig:
    """Warp specialisation only with TMA loads and the TMA store, else the same tiles unspecialised. Triton's Hopper
    warp specialisation takes TMA loads only; with the pointer store it computed wrong results on the H200 (Triton
    3.6) whenever a group spans several row tiles (relative error 0.5-0.8 on 7 of the 9 cases of
    ``grouped_mm_sweep_3090b87.md``; right on all 9 with the TMA store)."""
    if cfg.warp_specialize and not (tma_a and tma_w and tma_store) and not interp:
        return replace(cfg, warp_specialize="", num_warps=8)
    return cfg


@dataclass(frozen=True)
class LaunchPlan:
    """Everything about a launch that follows from its signature (``_plan_key``), computed once by ``_plan``."""

    config: GroupedMMConfig  # as launched: after _effective_config and the pointer path's narrower tile
    programs: int  # the grid
    table: bool  # the table schedule: _tile_schedule_kernel runs first
    tma_allocator: bool  # some operand goes through a device-side TMA descriptor (Triton's scratch allocator)
    scalars: tuple  # _grouped_mm_kernel's runtime scalars: M, N, K, E, X_ROWS, the five strides, NUM_PROGS
    schedule_consts: dict  # _tile_schedule_kernel's constexprs and options
    consts: dict  # _grouped_mm_kernel's constexprs and options


_PLANS: dict[tuple, LaunchPlan] = {}
_MAX_PLANS = 4096  # a bound for processes that see endless shapes; training sees a handful


def reset_plans() -> None:
    """Forget every cached launch plan: each signature plans again at its next call (and reads
    ``FLY_LIGHTNING_GROUPED_MM_TUNE`` again). Changes to ``MEASURED`` call this by themselves."""
    _PLANS.clear()


MEASURED.listeners.append(reset_plans)


def launch(
    x: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor,
    out: torch.Tensor,
    *,
    idx: torch.Tensor | None = None,
    topk: int = 1,
    gather: bool = False,
    scatter: bool = False,
    config: GroupedMMConfig | None = None,
    may_tune: bool = False,
) -> torch.Tensor:
    """Run the kernel into ``out``: ``[M, N]``, M rows in group order (slot order with ``scatter``).

    ``x`` is ``[M, K]`` (``[T, K]`` with ``gather``: row r reads ``x[idx[r] // topk]``); ``w`` ``[E, K, N]`` with
    N or K contiguous; ``idx`` int32 ``[M]`` (gather/scatter only).

    The launch is planned once per signature (shapes, strides, dtypes, device, form, 16-byte alignment of the data
    pointers, ``config``, ``may_tune``) and the plan cached: a call of a known signature builds its key, looks the plan
    up and launches. ``may_tune`` (the operators' calls without a ``config``): with ``FLY_LIGHTNING_GROUPED_MM_TUNE=1``,
    planning a CUDA signature whose shape class has no measured choice yet runs ``tune`` first (never while a CUDA
    graph is being captured: such a plan is not cached, so the next call outside capture tunes). The variable is read
    when a signature is planned, so setting it later affects only signatures first called afterwards, or every one
    after ``reset_plans()``.
    """
    e, k, n = w.shape
    m = idx.shape[0] if (gather or scatter) else x.shape[0]
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    key = _plan_key(x, w, out, m, topk, gather, scatter, config, may_tune)
    with on_device(x):
        plan = _PLANS.get(key)
        if plan is None:
            plan = _plan(key, x, w, offs, out, idx, m, topk, gather, scatter, config, may_tune)
        _launch(plan, x, w, offs, out, idx)
    return out


_SCHEDULE = FastLaunch(_tile_schedule_kernel)
_GROUPED_MM = FastLaunch(_grouped_mm_kernel)


def _launch(
    plan: LaunchPlan, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, out: torch.Tensor, idx: torch.Tensor | None
) -> None:
    """The kernel launches of one call, as ``plan`` says."""
    if plan.tma_allocator:
        triton.set_allocator(_tma_allocator)  # a context variable: set per call (threads start without it)
    tile_end = offs
    if plan.table:  # per-group tile counts first, by a one-program kernel (still no host sync)
        tile_end = outputs.empty_like(offs)
        m, n, _, e = plan.scalars[:4]
        _SCHEDULE((1,), (offs, tile_end, m, n, e), **plan.schedule_consts)
    index = idx if idx is not None else offs  # placeholder pointer, never read without GATHER/SCATTER
    _GROUPED_MM((plan.programs,), (x, w, out, offs, index, tile_end, *plan.scalars), **plan.consts)


def _plan_key(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    m: int,
    topk: int,
    gather: bool,
    scatter: bool,
    config: GroupedMMConfig | None,
    may_tune: bool,
) -> tuple:
    """What a launch plan depends on: shapes, strides, dtypes, device, form and configuration, and whether each data
    pointer is 16-byte aligned (TMA descriptors need it; the one part read from the data, not the layout)."""
    aligned = (x.data_ptr() % 16 == 0) + 2 * (w.data_ptr() % 16 == 0) + 4 * (out.data_ptr() % 16 == 0)
    return (x.shape, w.shape, w.stride(), x.stride(0), out.stride(0), m, x.dtype, w.dtype, out.dtype, x.device,
            aligned, topk, gather, scatter, config, may_tune)  # fmt: skip


def _plan(
    key: tuple,
    x: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor,
    out: torch.Tensor,
    idx: torch.Tensor | None,
    m: int,
    topk: int,
    gather: bool,
    scatter: bool,
    config: GroupedMMConfig | None,
    may_tune: bool,
) -> LaunchPlan:
    """Plan a launch of this signature (tuning first where asked, see ``launch``) and cache the plan under ``key``."""
    cache = True
    if config is None and may_tune and auto_tune_enabled() and x.is_cuda:  # the variable: read once per plan
        if measure_key(x, w, m, gather, scatter) not in MEASURED:
            if torch.cuda.is_current_stream_capturing():
                cache = False  # the table's choice for now; the next call outside capture tunes
            elif tuning.budget_left() or _stored(x, w, m, gather, scatter):
                tune(x, w, offs, idx=idx, topk=topk, gather=gather, scatter=scatter)
            else:  # a rare shape past the budget runs the table's configuration, and says so once
                _warn_budget_once()
    e, k, n = w.shape
    cfg = config or choose_config(x, w, m, gather, scatter)
    w_k_major = w.stride(2) != 1
    w_inner = w.stride(2) if w_k_major else w.stride(1)
    tma = cfg.tma and tma_available(x)
    tma_a = tma and not gather and _aligned(x, x.stride(0))
    tma_w = tma and _aligned(w, w.stride(0), w_inner)
    tma_store = tma and cfg.tma_store and not scatter and _aligned(out, out.stride(0))
    interp = x.device.type == "cpu"
    if cfg.tma and not tma_w and not interp and cfg.block_m * cfg.block_n > 128 * 128:
        cfg = replace(cfg, block_n=128)  # the pointer path spills registers with larger tiles
    cfg = _effective_config(cfg, tma_a, tma_w, tma_store, interp)
    bm, bn = cfg.block_m, cfg.block_n
    upper = (cdiv(m, bm) + e) * cdiv(n, bn)
    if interp:
        progs = min(INTERPRETER_PROGRAMS, upper)
    elif cfg.programs_per_sm:
        progs = min(cfg.programs_per_sm * num_sms(x.device.index or 0), upper)
    else:
        progs = upper
    consts = dict(
        E_POW2=max(1024, next_pow2(e)),  # one compilation for every E up to 1024
        TABLE=cfg.schedule == "table",
        LOG2_E=8 if e <= 256 else 12,
        TOPK=topk,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        W_K_MAJOR=w_k_major,
        TMA_A=tma_a,
        TMA_W=tma_w,
        TMA_STORE=tma_store,
        GATHER=gather,
        SCATTER=scatter,
        UPCAST=interp and x.dtype == torch.bfloat16,
        WS_K=cfg.warp_specialize == "k",
        WS_TILES=cfg.warp_specialize == "tiles",
        FLATTEN=cfg.flatten,
        INTERPRET=interp,
        **(_constants(x, w, out, n, k) if cfg.specialize else {}),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    plan = LaunchPlan(
        config=cfg,
        programs=progs,
        table=cfg.schedule == "table",
        tma_allocator=(tma_a or tma_w or tma_store) and x.is_cuda,
        scalars=(m, n, k, e, x.shape[0], x.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0), progs),
        schedule_consts=dict(BLOCK_M=bm, BLOCK_N=bn, E_POW2=max(16, next_pow2(e)), num_warps=4),
        consts=consts,
    )
    if cache:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def _constants(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, n: int, k: int) -> dict:
    """The ``specialize`` configuration's compile-time shape and strides."""
    return dict(SPECIALIZE=True, N_C=n, K_C=k, SXM_C=x.stride(0), SWE_C=w.stride(0), SWK_C=w.stride(1),
                SWN_C=w.stride(2), SOM_C=out.stride(0))  # fmt: skip


# Every configuration accumulates in fp32, so two right ones differ by output rounding (under 1% of an element) and
# summation order; a wrong tile shows up as elements far outside that.
TUNE_RTOL = 1e-2
TUNE_ATOL = 1e-3  # times the output's RMS: elements near zero
TUNE_MARGIN = 0.02  # a measured choice replaces the table only when this much faster


def _mismatch(out: torch.Tensor, expected: torch.Tensor, rows: int = 4096) -> str | None:
    """Why ``out`` is not ``expected`` element by element (None when it is), in row chunks to bound the memory."""
    chunks = [(r0, slice(r0, r0 + rows)) for r0 in range(0, out.shape[0], rows)]
    sq = sum(float(torch.nan_to_num(expected[sl].float(), 0.0, 0.0, 0.0).square().sum()) for _, sl in chunks)
    atol = TUNE_ATOL * (sq / max(1, expected.numel())) ** 0.5
    for r0, sl in chunks:
        o, e = out[sl].float(), expected[sl].float()
        same = (o == e) | (o.isnan() & e.isnan())  # equal infinities and NaNs both match
        tol = atol + TUNE_RTOL * torch.where(e.isfinite(), e.abs(), 0.0)
        bad = ~same & ~((o - e).abs() <= tol)
        if bool(bad.any()):
            i = int(bad.flatten().nonzero()[0])
            first = f"row {r0 + i // out.shape[1]}: {o.flatten()[i].item():.4g} vs {e.flatten()[i].item():.4g}"
            return f"{int(bad.sum())} elements differ from the table configuration's output, first in {first}"
    return None


def _stored_config(hit: dict | None) -> GroupedMMConfig | None:
    """The configuration a tuning database entry (or the ranks' agreement) names, or None where there is none or it
    does not build one (written by another version of this class): then it is measured again."""
    if not hit or not isinstance(hit.get("detail"), dict):
        return None
    try:
        return GroupedMMConfig(**hit["detail"])
    except (TypeError, ValueError):
        return None


def tune(
    x: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor,
    *,
    idx: torch.Tensor | None = None,
    topk: int = 1,
    gather: bool = False,
    scatter: bool = False,
    candidates: list[GroupedMMConfig] | None = None,
    reps: int = 10,
    rounds: int = 3,
    margin: float = TUNE_MARGIN,
) -> GroupedMMConfig:
    """Time ``candidates`` (default: ``tune_candidates`` of the shape class) against the table configuration on
    these inputs and remember the choice for their shape class (``MEASURED``, consulted by ``choose_config``).

    Each candidate's output is first compared element by element with the table configuration's on the same inputs
    (``_mismatch``): one that differs, or does not compile or launch, is never chosen; it is recorded in ``REJECTED``
    with the reason and a warning names it. A fast wrong kernel must not win. The right ones are timed in ``rounds``
    interleaved rounds of ``reps`` launches (the median counts, so a drifting clock hits every candidate alike), and
    one replaces the table configuration only if it is faster by more than ``margin``: single timings differ by more
    than the candidates do (``grouped_mm_suite.md``), and a choice made on noise would be slower as often as not."""
    m = idx.shape[0] if (gather or scatter) else x.shape[0]
    key = measure_key(x, w, m, gather, scatter)
    index = dict(idx=idx, topk=topk, gather=gather, scatter=scatter)
    table = table_config(x, w, m)
    db = tuning.active_db()
    env, db_key = tuning.environment_key(x.device), str(key)
    hit = tuning.agreed(DB_OP, db_key)  # the run's ranks agreed on it, else an earlier run in this environment
    if hit is None and db is not None:
        hit = db.get(env, DB_OP, db_key)
    best = _stored_config(hit) if candidates is None else None
    if best is not None:
        MEASURED[key] = best
        _journal(env, db_key, best, hit.get("timings_ms", {}))
        return best
    started = time.perf_counter()  # measuring from here on: counted against the process's tuning budget
    # zero-filled: rows no configuration writes (past the last offset, unrouted slots) then compare equal
    expected = launch(x, w, offs, torch.zeros(m, w.shape[2], dtype=x.dtype, device=x.device), **index, config=table)
    out = outputs.empty_like(expected, written_in_full=False)  # zeroed before each checked run
    if candidates is None:
        candidates = tune_candidates(shape_class(m, w.shape[2], w.shape[1], w.shape[0])[0])
    if gather or scatter:  # gathered rows (no TMA for them) or a scattered store: warp specialisation never runs
        candidates = [c for c in candidates if not c.warp_specialize]
    runs = {table: lambda: launch(x, w, offs, out, **index, config=table)}
    for cfg in dict.fromkeys(candidates):
        if cfg in runs:
            continue
        try:
            run = lambda cfg=cfg: launch(x, w, offs, out, **index, config=cfg)  # noqa: E731
            out.zero_()
            run()
            if (why := _mismatch(out, expected)) is not None:
                raise ValueError(f"{why} ({table.label()})")
            runs[cfg] = run
        except Exception as exc:  # a configuration that is wrong, does not compile or does not fit
            REJECTED.setdefault(key, {})[cfg.label()] = f"{type(exc).__name__}: {str(exc)[:200]}"
            warnings.warn(f"grouped_mm tuning skipped {cfg.label()}: {REJECTED[key][cfg.label()]}", stacklevel=2)
    times: dict[GroupedMMConfig, list[float]] = {cfg: [] for cfg in runs}
    for _ in range(rounds if len(runs) > 1 else 0):
        for cfg, run in runs.items():
            times[cfg].append(_elapsed_ms(run, reps, x.is_cuda))
    best = table
    if len(runs) > 1:
        median = {cfg: statistics.median(t) for cfg, t in times.items()}
        fastest = min(median, key=median.get)
        if median[fastest] < (1 - margin) * median[table]:
            best = fastest
    elif not any(c in runs for c in candidates):
        warnings.warn(f"grouped_mm tuning: no candidate ran correctly, keeping {table.label()}", stacklevel=2)
    MEASURED[key] = best
    tuning.spend(time.perf_counter() - started)
    timed = {cfg.label(): statistics.median(t) for cfg, t in times.items() if t}
    _journal(env, db_key, best, timed)
    if db is not None and len(runs) > 1:
        try:
            db.put(env, DB_OP, db_key, best.label(), timed, replace=True, detail=dataclasses.asdict(best))
        except OSError as exc:  # a read-only cache must not fail the run
            warnings.warn(f"grouped_mm tuning: not written to the tuning database: {exc}", stacklevel=2)
    return best


DB_OP = "grouped_mm.config"  # the tuning database's entries of this kernel's launch configurations


def _stored(x: torch.Tensor, w: torch.Tensor, m: int, gather: bool, scatter: bool) -> bool:
    """Whether the run's agreement or the tuning database already holds this shape class (no measuring needed)."""
    db_key = str(measure_key(x, w, m, gather, scatter))
    db = tuning.active_db()
    return tuning.agreed(DB_OP, db_key) is not None or (
        db is not None and db.get(tuning.environment_key(x.device), DB_OP, db_key) is not None
    )


@functools.cache
def _warn_budget_once() -> None:
    warnings.warn(
        f"grouped_mm: tuning budget ({tuning.budget_s():g} s) spent; new shape classes run the table's configuration",
        stacklevel=4,
    )


def _journal(env: str, db_key: str, best: GroupedMMConfig, timed: dict[str, float]) -> None:
    entry = {"backend": best.label(), "timings_ms": timed, "environment": env, "detail": dataclasses.asdict(best)}
    tuning.journal(DB_OP, db_key, entry)


@tuning.on_agreement(DB_OP)
def _adopt(op: str, db_key: str, entry: dict) -> int:
    """Take the configuration the run's ranks agreed on for this shape class (``tuning.agree_across_ranks``)."""
    agreed = GroupedMMConfig(**entry["detail"])
    keys = [k for k, cfg in MEASURED.items() if str(k) == db_key and cfg != agreed]
    for k in keys:
        MEASURED[k] = agreed
    return len(keys)


def _elapsed_ms(fn, reps: int, cuda: bool) -> float:
    fn()  # compiles
    if not cuda:
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) * 1e3 / reps
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def auto_tune_enabled() -> bool:
    """``FLY_LIGHTNING_GROUPED_MM_TUNE=1``; unset, measured selection (``select="measure"``) tunes too; ``0``: never."""
    flag = os.environ.get("FLY_LIGHTNING_GROUPED_MM_TUNE")
    if flag is not None:
        return flag.strip() == "1"
    return policy.get_dispatch_config().select == "measure"
