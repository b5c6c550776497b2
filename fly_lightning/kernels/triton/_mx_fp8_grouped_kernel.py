"""Grouped GEMM on fp8 tensor cores with one fp32 scale per 128 values along K on both operands (1x128 x 1x128, the
layout ``_mx_requant.requantize`` writes): the MX grouped GEMM's ``fp8`` plan on Hopper, where cuBLAS's blockwise fp8
GEMM has no grouped form.

Per 128-wide K step an fp8 MMA into a fresh fp32 tile, then that tile times the outer product of the step's row and
column scales added to the accumulator (the sums promoted to fp32 every 128 K, as cuBLAS's blockwise kernel does).
Within a program the scaling waits for its MMA; 64x128 tiles on 4 warps leave room for two programs per SM, and one
scales while the other's MMA runs. Measured (graph replays, H100, f4e9eba, ``probe_mx_fp8_grouped``), the kernel
alone on operands already re-expressed, against the bf16 grouped GEMM: 0.77-0.96x on the compute-bound cases
(K >= 1024, >= 512 rows per group), 1.0x at 256 rows per group, 1.5-1.7x at 64-128; 128x128 tiles on 8 warps (one
program per SM) ran 0.59-0.78x and 1.2-1.3x. Scales loaded by pointers (the pipeliner stages them through shared
memory); loading them through TMA descriptors too was slower (0.43-0.53x at 128x128 from 256 rows per group) and
faulted (illegal instruction) where a group's first row put the scales' box start off 16 bytes.

Schedule as the other grouped kernels (``_grouped_mm_kernel``'s ``scan``): a grid from shapes only, the int32 end
offsets read and clamped on the device. Codes through device-side TMA descriptors (``[M, K]`` and ``[E, N, K]``
e4m3, K contiguous); a tile's rows past its group end come from the next group (or TMA's zero fill) and are never
stored. Under the interpreter (no fp8 there) the codes are bytes, decoded to fp32 and multiplied in fp32.
"""

from __future__ import annotations

from typing import Protocol

import torch
import triton
import triton.language as tl

from fly_lightning.kernels.triton import _grouped_mm_kernel as gk
from fly_lightning.kernels.triton._grouped_mm_kernel import _advance, _band_swizzle, _scan_start
from fly_lightning.kernels.triton._launch import FastLaunch
from fly_lightning.kernels.triton._math import cdiv, next_pow2
from fly_lightning.kernels.triton._mx_elements import decode
from fly_lightning.kernels.triton._support import num_sms, on_device

BLOCK_K = 128  # the K step: one scale per 128 values of each operand


class Tiles(Protocol):
    """A launch's tiles (``_mx_grouped_mm_kernel.MXGroupedMMConfig`` has them): persistent, ``programs_per_sm``."""

    block_m: int
    block_n: int
    group_m: int
    num_stages: int
    num_warps: int
    programs_per_sm: int


# the interpreter runs programs one after another: small tiles, few programs (block_m, block_n, group_m, programs)
INTERPRETER_TILES = (32, 32, 2, 3)


@triton.jit
def _codes(ptrs):
    """Interpreter: e4m3 codes (bytes) as fp32 values, NaN for the NaN codes (``decode`` reads them as finite)."""
    c = tl.load(ptrs)
    return tl.where((c & 0x7F) == 0x7F, float("nan"), decode(c, 4, 3, 7))


# fmt: off
@triton.jit
def _fp8_tile(
    tile, g, g_first, g_start, g_size, X, XS, W, WS, OUT, x_desc, w_desc, N, EN, K,
    stride_om, stride_xs, num_n, k_tiles,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid_m, pid_n = _band_swizzle(tile - g_first, tl.cdiv(g_size, BLOCK_M), num_n, GROUP_M)
    row0 = g_start + pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < g_start + g_size
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    xs_ptrs = XS + tl.where(row_ok, rows, 0)  # scales [K / 128, M] and [K / 128, E * N]: a step's are contiguous
    ws_ptrs = WS + g * N + tl.where(col_ok, cols, 0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if INTERPRET:
        ks = tl.arange(0, 128)
        x_ptrs = X + tl.where(row_ok, rows, 0).to(tl.int64)[:, None] * K + ks[None, :]
        w_ptrs = W + (g.to(tl.int64) * N + tl.where(col_ok, cols, 0))[:, None] * K + ks[None, :]
        kk = 0
        while kk < k_tiles:
            p = tl.dot(_codes(x_ptrs + kk * 128), tl.trans(_codes(w_ptrs + kk * 128)))
            acc += p * (tl.load(xs_ptrs + kk * stride_xs)[:, None] * tl.load(ws_ptrs + kk * EN)[None, :])
            kk += 1
    else:
        for kk in range(0, k_tiles):
            a = x_desc.load([row0, kk * 128])
            b = w_desc.load([g, n0, kk * 128]).reshape(BLOCK_N, 128)
            p = tl.dot(a, b.T)
            acc += p * (tl.load(xs_ptrs + kk * stride_xs)[:, None] * tl.load(ws_ptrs + kk * EN)[None, :])
    o_ptrs = OUT + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(o_ptrs, acc.to(OUT.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _fp8_grouped_kernel(
    X, XS, W, WS, OUT, OFFS, M, N, K, E, stride_om, stride_xs, NUM_PROGS,
    E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    k_tiles = K // 128
    x_desc = X  # placeholders under the interpreter (pointer loads there)
    w_desc = W
    if not INTERPRET:
        x_desc = tl.make_tensor_descriptor(X, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, 128])
        w_desc = tl.make_tensor_descriptor(W, shape=[E, N, K], strides=[N * K, K, 1], block_shape=[1, BLOCK_N, 128])
    total, g, g_first, g_start, g_end, g_size, g_tiles = _scan_start(pid, OFFS, M, E, num_n, BLOCK_M, E_POW2)
    if INTERPRET:
        tile = pid
        while tile < total:
            g, g_first, g_start, g_end, g_size, g_tiles = _advance(
                tile, g, g_first, g_start, g_end, g_size, g_tiles, OFFS, M, E, num_n, BLOCK_M)
            _fp8_tile(tile, g, g_first, g_start, g_size, X, XS, W, WS, OUT, x_desc, w_desc, N, E * N, K,
                      stride_om, stride_xs, num_n, k_tiles, BLOCK_M, BLOCK_N, GROUP_M, INTERPRET)
            tile += NUM_PROGS
    else:
        for tile in range(pid, total, NUM_PROGS):
            g, g_first, g_start, g_end, g_size, g_tiles = _advance(
                tile, g, g_first, g_start, g_end, g_size, g_tiles, OFFS, M, E, num_n, BLOCK_M)
            _fp8_tile(tile, g, g_first, g_start, g_size, X, XS, W, WS, OUT, x_desc, w_desc, N, E * N, K,
                      stride_om, stride_xs, num_n, k_tiles, BLOCK_M, BLOCK_N, GROUP_M, INTERPRET)
# fmt: on


_FP8_GROUPED = FastLaunch(_fp8_grouped_kernel)


def launch(
    qx: torch.Tensor,
    sx: torch.Tensor,
    qw: torch.Tensor,
    sw: torch.Tensor,
    offs: torch.Tensor,
    out: torch.Tensor,
    tiles: Tiles,
) -> torch.Tensor:
    """``out[rows of e] = (qx * sx)[rows of e] @ (qw[e] * sw[e]).T`` per group, each scale over its 128 values along
    K; rows past ``offs[-1]`` untouched.

    ``qx`` ``[M, K]`` e4m3 (uint8 codes under the interpreter) and ``qw`` ``[E, N, K]`` likewise, both contiguous;
    ``sx`` fp32 ``[M, K / 128]`` with stride ``(1, s)``, ``s >= M``; ``sw`` fp32 ``[K / 128, E * N]`` contiguous:
    ``_mx_requant.requantize``'s layouts for ``qx`` and ``qw.view(E * N, K)``. K % 128. ``tiles``: on the GPU (the
    interpreter takes its own)."""
    e, n, k = qw.shape
    m = qx.shape[0]
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    interp = qx.device.type == "cpu"
    if interp:  # the interpreter has no fp8: the codes as bytes
        bm, bn, gm, progs = INTERPRETER_TILES
        stages, warps = 1, 4
        qx, qw = qx.view(torch.uint8), qw.view(torch.uint8)
    else:
        bm, bn, gm, stages, warps = tiles.block_m, tiles.block_n, tiles.group_m, tiles.num_stages, tiles.num_warps
        progs = tiles.programs_per_sm * num_sms(qx.device.index or 0)
        triton.set_allocator(gk._tma_allocator)  # device-side descriptors' scratch (a context variable: per call)
    progs = min(progs, (cdiv(m, bm) + e) * cdiv(n, bn))
    with on_device(qx):
        _FP8_GROUPED(
            (progs,),
            (qx, sx, qw, sw, out, offs, m, n, k, e, out.stride(0), sx.stride(1), progs),
            E_POW2=max(1024, next_pow2(e)), BLOCK_M=bm, BLOCK_N=bn, GROUP_M=gm, INTERPRET=interp,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return out
