"""Grouped GEMM on fp8 tensor cores for MX operands re-expressed as e4m3 with one fp32 scale per 128 values along K
(``_mx_requant``): the MX grouped GEMM's plan on Hopper where each weight tile feeds enough rows (cuBLAS's blockwise
fp8 GEMM, which the dense plan calls, has no grouped form on sm90).

Per 128-wide K step: one fp8 ``tl.dot`` (fp32 result) scaled by the row's and the column's group scales, added to
the fp32 accumulator; the fp8 MMA's own sums stay within that step. Tile schedule as the bf16 grouped GEMM's
(``_grouped_mm_kernel``: offsets read on the device, a group cursor per program, bands of ``GROUP_M`` row tiles).
Under the interpreter the e4m3 codes are decoded to fp32 (its float8 dot is not trusted) and the same sums run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fly_lightning.kernels.triton._grouped_mm_kernel import _advance, _band_swizzle
from fly_lightning.kernels.triton._launch import FastLaunch
from fly_lightning.kernels.triton._math import cdiv, next_pow2
from fly_lightning.kernels.triton._mx_requant import GROUP, _values_f32
from fly_lightning.kernels.triton._support import num_sms, on_device


@triton.jit
def _operand(ptrs, UPCAST: tl.constexpr):
    raw = tl.load(ptrs)
    if UPCAST:
        v = _values_f32(raw, 1, raw.shape[1])
    else:
        v = raw.to(tl.float8e4nv, bitcast=True)
    return v


@triton.jit
def _k_step(acc, x_ptrs, w_ptrs, xs_ptrs, ws_ptrs, kk, stride_xsk, stride_wsk, UPCAST: tl.constexpr):
    """One 128-wide K step: the fp8 product, scaled by its row and column group scales, into ``acc``."""
    p = tl.dot(_operand(x_ptrs + kk * 128, UPCAST), tl.trans(_operand(w_ptrs + kk * 128, UPCAST)))
    sa = tl.load(xs_ptrs + kk * stride_xsk)
    sb = tl.load(ws_ptrs + kk * stride_wsk)
    return acc + p * (sa[:, None] * sb[None, :])


# fmt: off
@triton.jit
def _fp8_tile(
    tile, g, g_first, g_start, g_size, X, XS, W, WS, OUT, N, stride_xm, stride_xsk, stride_we, stride_wn, stride_wsk,
    stride_om, num_n, k_tiles, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid_m, pid_n = _band_swizzle(tile - g_first, tl.cdiv(g_size, BLOCK_M), num_n, GROUP_M)
    rows = g_start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < g_start + g_size
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    src = tl.where(row_ok, rows, 0).to(tl.int64)  # in bounds: such rows are read, never stored
    col = tl.where(col_ok, cols, 0).to(tl.int64)
    ks = tl.arange(0, 128)
    x_ptrs = X + src[:, None] * stride_xm + ks[None, :]
    w_ptrs = W + g.to(tl.int64) * stride_we + col[:, None] * stride_wn + ks[None, :]
    xs_ptrs = XS + src  # group scales [K / 128, M] and [K / 128, E * N]: step kk at kk * stride
    ws_ptrs = WS + g.to(tl.int64) * N + col
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if INTERPRET:  # the interpreter cannot range over a device value
        kk = 0
        while kk < k_tiles:
            acc = _k_step(acc, x_ptrs, w_ptrs, xs_ptrs, ws_ptrs, kk, stride_xsk, stride_wsk, UPCAST)
            kk += 1
    else:  # a for loop: the software pipeline prefetches its loads
        for kk in range(0, k_tiles):
            acc = _k_step(acc, x_ptrs, w_ptrs, xs_ptrs, ws_ptrs, kk, stride_xsk, stride_wsk, UPCAST)
    o_ptrs = OUT + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(o_ptrs, acc.to(OUT.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _fp8_grouped_mm_kernel(
    X, XS, W, WS, OUT, OFFS, M, N, K, E, stride_xm, stride_xsk, stride_we, stride_wn, stride_wsk, stride_om,
    NUM_PROGS, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    k_tiles = K // 128
    e_ids = tl.arange(0, E_POW2)
    ends = tl.minimum(tl.maximum(tl.load(OFFS + e_ids, mask=e_ids < E, other=0), 0), M)
    starts = tl.minimum(tl.maximum(tl.load(OFFS + e_ids - 1, mask=(e_ids > 0) & (e_ids < E), other=0), 0), M)
    total = tl.sum(tl.cdiv(tl.maximum(ends - starts, 0), BLOCK_M) * num_n, axis=0)
    g = pid * 0
    g_first = pid * 0
    g_start = pid * 0
    g_end = tl.minimum(tl.maximum(tl.load(OFFS), 0), M)
    g_size = tl.maximum(g_end - g_start, 0)
    g_tiles = tl.cdiv(g_size, BLOCK_M) * num_n
    if INTERPRET:
        tile = pid
        while tile < total:
            g, g_first, g_start, g_end, g_size, g_tiles = _advance(
                tile, g, g_first, g_start, g_end, g_size, g_tiles, OFFS, M, E, num_n, BLOCK_M)
            _fp8_tile(tile, g, g_first, g_start, g_size, X, XS, W, WS, OUT, N, stride_xm, stride_xsk, stride_we,
                      stride_wn, stride_wsk, stride_om, num_n, k_tiles, BLOCK_M, BLOCK_N, GROUP_M, UPCAST, INTERPRET)
            tile += NUM_PROGS
    else:
        for tile in range(pid, total, NUM_PROGS):
            g, g_first, g_start, g_end, g_size, g_tiles = _advance(
                tile, g, g_first, g_start, g_end, g_size, g_tiles, OFFS, M, E, num_n, BLOCK_M)
            _fp8_tile(tile, g, g_first, g_start, g_size, X, XS, W, WS, OUT, N, stride_xm, stride_xsk, stride_we,
                      stride_wn, stride_wsk, stride_om, num_n, k_tiles, BLOCK_M, BLOCK_N, GROUP_M, UPCAST, INTERPRET)
# fmt: on


_FP8_GROUPED = FastLaunch(_fp8_grouped_mm_kernel)


def launch(
    qx: torch.Tensor,
    sx: torch.Tensor,
    qw: torch.Tensor,
    sw: torch.Tensor,
    offs: torch.Tensor,
    out: torch.Tensor,
    block_m: int,
    block_n: int,
    group_m: int,
    num_warps: int,
    num_stages: int,
    programs_per_sm: int,
) -> torch.Tensor:
    """``out[rows of e] = (qx * sx)[rows of e] @ (qw[e] * sw[e]).T``: ``qx`` e4m3 ``[M, K]``, ``sx`` fp32 ``[K / 128,
    M]``, ``qw`` e4m3 ``[E, N, K]``, ``sw`` fp32 ``[K / 128, E * N]`` (``_mx_requant.requantize``'s layouts, last
    dims contiguous); rows past ``offs[-1]`` untouched."""
    e, n, k = qw.shape
    m = qx.shape[0]
    if k % GROUP:
        raise ValueError(f"fp8 grouped GEMM: K={k} is not a multiple of {GROUP}")
    interp = qx.device.type == "cpu"
    upper = (cdiv(m, block_m) + e) * cdiv(n, block_n)
    progs = min(3 if interp else programs_per_sm * num_sms(qx.device.index or 0), upper)
    u8 = torch.uint8
    with on_device(qx):
        _FP8_GROUPED(
            (progs,),
            (qx.view(u8), sx, qw.view(u8), sw, out, offs, m, n, k, e, qx.stride(0), sx.stride(0), qw.stride(0),
             qw.stride(1), sw.stride(0), out.stride(0), progs),
            E_POW2=max(1024, next_pow2(e)), BLOCK_M=block_m, BLOCK_N=block_n, GROUP_M=group_m, UPCAST=interp,
            INTERPRET=interp, num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    return out
