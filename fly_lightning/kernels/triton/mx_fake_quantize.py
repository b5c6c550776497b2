"""Triton MX fake quantisation, registered as the ``triton`` backend of ``mx_fake_quantize``.

One pass per tile: the cast's block scales and rounded elements (``_mx_elements``, the arithmetic of ``mx_cast``'s
kernels), then each element's value times its scale's, stored in ``x``'s dtype: 2 bytes read and 2 written per bf16
element, where a cast and a dequantisation move 6 (and ATen's ``from_mx`` about 14 more). Row-wise (blocks along the
last dim) and column-wise (down the columns of a ``[K, N]`` weight, as MoE experts stored K-major are): the MoE
experts' MX training numerics without a transposed copy of the master weights. Same layouts and modes as the cast
(``mx_cast.cast_support``); fp4 takes the element arithmetic (not the cast's bf16-pair kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fly_lightning.kernels import outputs
from fly_lightning.kernels.triton._launch import FastLaunch
from fly_lightning.kernels.triton._math import cdiv, next_pow2
from fly_lightning.kernels.triton._mx_dequant import hw_cvt
from fly_lightning.kernels.triton._mx_elements import (
    bf16_bits,
    block_scales,
    cast_constants,
    element_values,
    scale_values,
    widened,
)
from fly_lightning.kernels.triton._support import on_device
from fly_lightning.kernels.triton.mx_cast import cast_support
from fly_lightning.ops.mx_fake_quantize import MX_FAKE_QUANTIZE
from fly_lightning.quant import formats


@triton.jit
def _store(OUT, offsets, v, mask, BITS: tl.constexpr):
    if BITS:  # bf16 rounded by integer arithmetic into an int16 view (the interpreter's conversion truncates)
        tl.store(OUT + offsets, bf16_bits(v), mask=mask)
    else:
        tl.store(OUT + offsets, v.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _fake_quant_rows(
    X, stride_x, OUT, R, K,
    BR: tl.constexpr, G: tl.constexpr, EMAX: tl.constexpr, MAX: tl.constexpr, EBITS: tl.constexpr,
    MBITS: tl.constexpr, BIAS: tl.constexpr, FP4: tl.constexpr, BF16: tl.constexpr, HW: tl.constexpr,
    RCEIL: tl.constexpr, MANT_MAX: tl.constexpr,
):  # fmt: skip
    BK: tl.constexpr = G * 32
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rows64 = rows.to(tl.int64)
    cols = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (rows[:, None] < R) & (cols[None, :] < K)  # K % 32 == 0: a block is wholly in or out
    x3 = tl.reshape(widened(tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0), BF16, HW),
                    (BR, G, 32))  # fmt: skip
    amax = tl.max(tl.abs(x3), axis=2)
    has_nan = tl.max((x3 != x3).to(tl.int32), axis=2) > 0
    biased, mult = block_scales(amax, has_nan, EMAX, RCEIL, MANT_MAX)
    v = element_values(x3 * mult[:, :, None], MAX, EBITS, MBITS, BIAS, FP4, HW) * scale_values(biased)[:, :, None]
    _store(OUT, rows64[:, None] * K + cols[None, :], tl.reshape(v, (BR, BK)), mask, BF16 and not HW)


@triton.jit
def _fake_quant_cols(
    X, stride_x, OUT, K, N,
    BN: tl.constexpr, G: tl.constexpr, EMAX: tl.constexpr, MAX: tl.constexpr, EBITS: tl.constexpr,
    MBITS: tl.constexpr, BIAS: tl.constexpr, FP4: tl.constexpr, BF16: tl.constexpr, HW: tl.constexpr,
    RCEIL: tl.constexpr, MANT_MAX: tl.constexpr,
):  # fmt: skip
    BK: tl.constexpr = G * 32
    ks = (tl.program_id(1) * BK + tl.arange(0, BK)).to(tl.int64)  # column tiles on axis 0: no 65535 limit
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    mask = (ks[:, None] < K) & (cols[None, :] < N)
    x3 = tl.reshape(widened(tl.load(X + ks[:, None] * stride_x + cols[None, :], mask=mask, other=0), BF16, HW),
                    (G, 32, BN))  # fmt: skip
    amax = tl.max(tl.abs(x3), axis=1)
    has_nan = tl.max((x3 != x3).to(tl.int32), axis=1) > 0
    biased, mult = block_scales(amax, has_nan, EMAX, RCEIL, MANT_MAX)
    v = element_values(x3 * mult[:, None, :], MAX, EBITS, MBITS, BIAS, FP4, HW) * scale_values(biased)[:, None, :]
    _store(OUT, ks[:, None] * N + cols[None, :], tl.reshape(v, (BK, BN)), mask, BF16 and not HW)


HW_CVT = True
"""On NVIDIA GPUs from sm89, bf16 and fp8 converted by instructions (else by integer arithmetic, as the interpreter
needs); both exact."""
PLAN = (16, 8, 4)
"""Row-wise: (rows, 32-value blocks, warps) per program."""
COLS_PLAN = (64, 1, 1)
"""Column-wise: (columns, 32-row blocks, warps) per program. One warp reduces a block's 32 rows without a barrier
(15 in four warps, sm90 PTX). 4096x16384 bf16 on an H100, against (64, 2, 4) (``probe_mx_fake_quant_cols``,
0fbac22, equal outputs): 94% / 51% of copy bandwidth to MXFP8, 66% / 44% to MXFP4 (floor; rceil alike)."""
_FAKE_QUANT_ROWS = FastLaunch(_fake_quant_rows)
_FAKE_QUANT_COLS = FastLaunch(_fake_quant_cols)


def launch(x: torch.Tensor, fmt: str, mode: str = "floor", axis: int = -1) -> torch.Tensor:
    """``x`` (supported: ``cast_support``) on the MX grid along ``axis``, contiguous, in ``x``'s dtype."""
    consts = cast_constants("mx_fake_quantize", fmt, mode, x.dtype, HW_CVT and hw_cvt(x))
    out = outputs.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    bits = consts["BF16"] and not consts["HW"]  # bf16 moved as int16 bits (``widened``, ``_store``)
    src, dst = (x.view(torch.int16), out.view(torch.int16)) if bits else (x, out)
    with on_device(x):
        if axis == 0:
            k, n = x.shape
            bn, g, warps = COLS_PLAN
            g = min(g, next_pow2(k // formats.BLOCK))
            while cdiv(k, g * formats.BLOCK) > 65535:  # grid axis 1 holds at most 65535 programs: more blocks each
                g *= 2
            _FAKE_QUANT_COLS(
                (cdiv(n, bn), cdiv(k, g * formats.BLOCK)), (src, x.stride(0), dst, k, n),
                BN=bn, G=g, **consts, num_warps=warps,
            )  # fmt: skip
        else:
            k = x.shape[-1]
            src2 = src.view(-1, k)
            br, g, warps = PLAN
            g = min(g, next_pow2(k // formats.BLOCK))
            _FAKE_QUANT_ROWS(
                (cdiv(src2.shape[0], br), cdiv(k, g * formats.BLOCK)), (src2, src2.stride(0), dst, src2.shape[0], k),
                BR=br, G=g, **consts, num_warps=warps,
            )  # fmt: skip
    return out


@MX_FAKE_QUANTIZE.implement(
    "triton",
    supports=cast_support,
    constraints="as the Triton mx_cast: x fp32/bf16, blocks along the last dim (contiguous, leading dims collapsible "
    "to rows) or down the columns of a 2-D x (columns contiguous); floor scales, rceil from bf16; one pass, output "
    "in x's dtype",
)
def mx_fake_quantize_triton(x: torch.Tensor, fmt: str, mode: str, axis: int) -> torch.Tensor:
    return launch(x, fmt, mode, axis)
