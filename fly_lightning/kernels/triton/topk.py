"""Triton top-k along the last dimension, registered as the ``triton`` backend of ``topk``.

Same selection as the routing kernel (``_select.py``): rows loaded as ``[1, LG, ROWS, C, VEC]`` tiles, 16-bit inputs
ranked through exact packed keys, fp32 through keys relative to the row max with an exact per-tile fallback, and k
descent steps. Each step's winning key is stored into the index output; an epilogue in a compact ``[ROWS, KP]``
layout turns the keys into int64 indices and re-reads the chosen values (their exact bits, -0.0 and NaN payloads
included). One tile per program: the grid is the number of tiles.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fly_lightning.kernels import outputs
from fly_lightning.kernels.triton._launch import FastLaunch
from fly_lightning.kernels.triton._math import cdiv, next_pow2
from fly_lightning.kernels.triton._select import (
    BF16_INF,
    FP16_INF,
    MAX_K,
    PAD,
    coarse_tie,
    descent_step,
    exact_step,
    float_key,
    order_unknown,
    packed_col,
    packed_keys,
    relative_keys,
    rows5,
    tile_cols,
)
from fly_lightning.kernels.triton._support import device_reason, on_device
from fly_lightning.ops.topk import TOPK

MAX_N = 1024
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _topk_fwd(
    X,
    stride_x,
    V_OUT,
    I_OUT,
    R,
    N: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,
    LG: tl.constexpr,
    ROWS: tl.constexpr,
    C: tl.constexpr,
    VEC: tl.constexpr,
    CB: tl.constexpr,
    ALIGN: tl.constexpr,
    HALF_KEYS: tl.constexpr,
    INF16: tl.constexpr,
):
    stride_x = (stride_x // ALIGN) * ALIGN  # no-op that tells the compiler the rows' alignment (vector loads)
    col, valid = tile_cols(1, LG, C, VEC, N, 1)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < R
    rows64 = rows.to(tl.int64)
    x_row = X + rows64 * stride_x
    x = tl.load(rows5(x_row) + col, mask=rows5(row_ok) & valid, other=0.0)
    if HALF_KEYS:
        key = packed_keys(x, col, valid, INF16, CB)
    else:
        key = relative_keys(tl.where(valid, float_key(x.to(tl.float32)), PAD), col, CB)
    out_j = I_OUT + rows64 * K
    m = tl.zeros([ROWS], tl.int32)
    tie = m != 0  # relative keys: chosen keys whose order by value is unknown (see coarse_tie)
    for j in tl.static_range(K):
        prev = m
        m = descent_step(key, m, j)
        if not HALF_KEYS and j > 0:
            tie = tie | coarse_tie(m, prev, CB)
        # the winner's key, stored by the thread holding column 0 (no layout conversion)
        tl.store(rows5(out_j + j) + col * 0, rows5(m.to(tl.int64)) + col * 0, mask=rows5(row_ok) & (col == 0))
    if not HALF_KEYS:
        if order_unknown(key, m, tie, row_ok, K, False, CB):  # redo this tile with exact keys
            key = tl.where(valid, float_key(x.to(tl.float32)), PAD)
            for j in tl.static_range(K):
                key, idx, _ = exact_step(key, col, j, CB)
                tl.store(
                    rows5(out_j + j) + col * 0,
                    rows5(((CB - 1) - idx).to(tl.int64)) + col * 0,
                    mask=rows5(row_ok) & (col == 0),
                )

    # epilogue, compact layout: the program's own stores above are visible after the barrier
    tl.debug_barrier()
    kk = tl.arange(0, KP)
    out = rows64[:, None] * K + kk[None, :]
    out_ok = row_ok[:, None] & (kk < K)[None, :]
    idx = packed_col(tl.load(I_OUT + out, mask=out_ok, other=0).to(tl.int32), CB)
    tl.store(V_OUT + out, tl.load(x_row[:, None] + idx, mask=out_ok), mask=out_ok)
    tl.store(I_OUT + out, idx.to(tl.int64), mask=out_ok)


@dataclass(frozen=True)
class LaunchConfig:
    elems_per_thread: int = 32  # row elements per thread; sets the lanes per row
    rows_per_thread: int = 1
    num_warps: int = 4


def launch_config(n: int, itemsize: int) -> LaunchConfig:
    per_row = min(32, next_pow2(n))
    return LaunchConfig(rows_per_thread=max(1, 32 // per_row))


def _supports(x: torch.Tensor, k: int) -> bool | str:
    if (reason := device_reason(x)) is not None:
        return reason
    if x.dtype not in _DTYPES:
        return f"dtype {x.dtype}"
    n = x.shape[-1]
    if n > MAX_N:
        return f"last dim {n} > {MAX_N}"
    if k > MAX_K:
        return f"k={k} > {MAX_K}"
    if x.numel() == 0:
        return True  # nothing to launch: the launcher returns the empty outputs
    if n > 1 and x.stride(-1) != 1:
        return "last dim not contiguous"
    try:
        x.view(-1, n)
    except RuntimeError:
        return "leading dims not collapsible to rows (would need a copy)"
    return True


@functools.lru_cache(maxsize=512)
def _plan(n: int, k: int, dtype: torch.dtype, row_stride: int, rows_total: int, cfg: LaunchConfig | None):
    """(grid, constexprs) for one signature (cached: the eager path is host-bound)."""
    itemsize = torch.finfo(dtype).bits // 8
    cfg = cfg or launch_config(n, itemsize)
    vec = 16 // itemsize
    while vec > 1 and (n % vec or (rows_total > 1 and row_stride % vec)):
        vec //= 2
    np2 = max(next_pow2(n), vec)
    lg = max(1, min(np2 // max(cfg.elems_per_thread, vec), 32))
    rows = (32 // lg) * cfg.num_warps * cfg.rows_per_thread
    constexprs = dict(
        N=n,
        K=k,
        KP=next_pow2(k),
        LG=lg,
        ROWS=rows,
        C=np2 // (lg * vec),
        VEC=vec,
        CB=np2,
        ALIGN=vec,
        HALF_KEYS=dtype != torch.float32,
        INF16=FP16_INF if dtype == torch.float16 else BF16_INF,
        num_warps=cfg.num_warps,
    )
    return cdiv(rows_total, rows), constexprs


_TOPK = FastLaunch(_topk_fwd)


@TOPK.implement(
    "triton",
    supports=_supports,
    constraints=f"x fp32/bf16/fp16 on GPU; top-k along the last dim, its length <= {MAX_N}, k <= {MAX_K}; last dim "
    "contiguous, leading dims collapsible to rows; ties -> lower index, NaN ranked highest as in torch.topk",
)
def topk_triton(x: torch.Tensor, k: int, config: LaunchConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[-1]
    values = outputs.empty((*x.shape[:-1], k), dtype=x.dtype, device=x.device)  # k values and indices of every row
    indices = outputs.empty((*x.shape[:-1], k), dtype=torch.int64, device=x.device)
    if values.numel() == 0:
        return values, indices
    x2 = x.view(-1, n)
    grid, constexprs = _plan(n, k, x.dtype, x2.stride(0), x2.shape[0], config)
    with on_device(x):
        _TOPK((grid,), (x2, x2.stride(0), values, indices, x2.shape[0]), **constexprs)
    return values, indices
