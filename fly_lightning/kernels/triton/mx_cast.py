"""Triton MX cast (``floor`` scales, and ``rceil`` from bf16; row-wise and column-wise), registered as the ``triton``
backend of ``mx_cast``.

One program casts a tile of rows x 32-value blocks: the block's largest magnitude gives its E8M0 scale from the fp32
exponent field, the elements are scaled, saturated and rounded to nearest even: fp8 on NVIDIA GPUs from sm89 by the
conversion instructions (``HW_CVT``); fp4 from bf16 on f16 bits (below); fp4 from fp32, other GPUs and the
interpreter (whose float8 conversion differs) by integer arithmetic on the fp32 bits. Stored as bytes; fp4 two per
byte, element ``2j`` in the low nibble. Bit-exact with ``fly_lightning.quant.formats.to_mx`` and so with torchao
(in NaN-scale blocks: finite values +-0, NaN and inf codes unspecified; with ``rceil`` a NaN block's codes are
unspecified, torchao's are NaN there). ``rceil`` scales come from the bits of the block's largest value
(``rceil_biased``), equal to torchao's ``ceil`` of an fp32 ``log2`` for bf16 input; from fp32 input that rounding can
differ, and such casts run on ATen, recorded. The column-wise cast (``_mx_cast_cols``, blocks down the columns of a
``[K, N]`` weight) shares the scale and element arithmetic.

bf16 -> fp4 takes ``_mx_cast_fp4_pairs``: the fp4 cast is bound by instructions, not bytes (Hopper has no fp4
conversion), and working on bf16 pairs held in one int32 with f16x2 instructions halves most of them. sm90 SASS per
element: 26.75 (``encode``), then 21.75 (fp32 subnormal rounding per element), 13.3 for the pairs (fp8: 12.25);
copy bandwidth on the H200: 52-54%, 61-62%, then 78-80% (mx_cast suite, e204651 and 3216fa7). fp32 input, and bf16
rows whose storage offset or row stride is odd (not readable as int32 pairs), keep ``_mx_cast_rows``. Column-wise,
bf16 -> fp4 pairs rows ``2j`` and ``2j + 1`` of a column the same way (``_mx_cast_cols_fp4_pairs``).
Not kept: fp4 codes stored as int32 words of 8 (no shared-memory shuffle for the packed store): 53%, as byte stores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fly_lightning.kernels import outputs
from fly_lightning.kernels.layout import copy_reason
from fly_lightning.kernels.triton._launch import FastLaunch
from fly_lightning.kernels.triton._math import cdiv, next_pow2
from fly_lightning.kernels.triton._mx_dequant import hw_cvt, ptx_pairs, ptx_u16x2
from fly_lightning.kernels.triton._mx_elements import (
    block_scales,
    cast_constants,
    codes_of,
    rceil_biased,
    widened,
)
from fly_lightning.kernels.triton._support import device_reason, on_device
from fly_lightning.ops.mx_cast import MX_CAST
from fly_lightning.quant import formats


@triton.jit
def _f16x2_clamped(lo, hi, PTX: tl.constexpr):
    """fp32 pairs (each ``>= 0``) to f16x2 bits (``lo`` in the low half) rounded to nearest even, each half at most
    0x0E00 (``6 * 2^-14``; NaN and inf become it). ``PTX``: one ``cvt`` and one ``min`` per pair (sm80+); otherwise
    the same bits through per-element conversions (the interpreter, ROCm)."""
    if PTX:
        h = tl.inline_asm_elementwise(
            "{ .reg .b32 c; cvt.rn.f16x2.f32 $0, $2, $1; mov.b32 c, 0x0E000E00; min.f16x2 $0, $0, c; }",
            "=r,r,r",
            [lo, hi],
            dtype=tl.uint32,
            is_pure=True,
            pack=1,
        )
    else:
        lo16 = tl.minimum(lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.uint32) & 0xFFFF, 0x0E00)
        hi16 = tl.minimum(hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.uint32) & 0xFFFF, 0x0E00)
        h = lo16 | (hi16 << 16)
    return h


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _mx_cast_fp4_pairs(
    X, stride_x, DATA, SCALE, R, K, BR: tl.constexpr, G: tl.constexpr, PTX: tl.constexpr, RCEIL: tl.constexpr = False
):
    """bf16 rows to MXFP4 (floor scales, or ``RCEIL``: ``rceil_biased``), two elements at a time: ``X`` is read as
    int32 words, each a bf16 pair (element ``2j`` in the low half), and each word becomes the byte that packs the
    pair's codes.

    Per pair: both halves widened to fp32 by bit moves; the block's NaN-propagating amax; both scaled by
    ``2^-(scale exponent) * 2^-14`` (exact: powers of two, bf16's 8 significant bits) and converted into one f16x2
    word, which puts e2m1's grid on f16's: 0.5 becomes the subnormal 0x0200, 1 the smallest normal 0x0400, and each
    e2m1 step below 6 one step of bit 9 (exact for every value that can round to a nonzero code: f16's subnormals
    keep 10 bits). Both halves are then rounded to a multiple of 2^9, ties to even, by one integer add (no carry
    crosses a half: each is at most 0x0F00), and the two signs and codes are moved into one byte."""
    BW: tl.constexpr = G * 16  # words per row tile: G blocks of 32 values
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rows64 = rows.to(tl.int64)  # offsets past 2^31 elements
    words = tl.program_id(1) * BW + tl.arange(0, BW)
    mask = (rows[:, None] < R) & (words[None, :] < K // 2)  # K % 32 == 0: a block is wholly in or out
    w = tl.load(X + rows64[:, None] * stride_x + words[None, :], mask=mask, other=0).to(tl.uint32, bitcast=True)
    w3 = tl.reshape(w, (BR, G, 16))
    lo, hi = _halves(w3)
    biased, inv = _fp4_scales(tl.reduce(_max_nan(lo, hi), 2, _max_nan), RCEIL)
    packed = _fp4_pair_bytes(w3, lo * inv[:, :, None], hi * inv[:, :, None], PTX)
    tl.store(DATA + rows64[:, None] * (K // 2) + words[None, :], tl.reshape(packed, (BR, BW)), mask=mask)
    g = tl.program_id(1) * G + tl.arange(0, G)
    smask = (rows[:, None] < R) & (g[None, :] < K // 32)
    tl.store(SCALE + rows64[:, None] * (K // 32) + g[None, :], biased.to(tl.uint8), mask=smask)


@triton.jit
def _halves(w):
    """The two bf16 magnitudes of each pair word as fp32 (bit moves)."""
    a = w & 0x7FFF7FFF
    return (a << 16).to(tl.float32, bitcast=True), (a & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def _fp4_scales(amax, RCEIL: tl.constexpr):
    """Per block (NaN-propagating ``amax``): ``(biased E8M0 scale, 2^-(scale exponent) * 2^-14)``."""
    nan = amax != amax
    if RCEIL:
        biased = tl.where(nan, 255, rceil_biased(amax, 2, 0x400000))  # e2m1's largest value: 1.5 * 2^2
        unit = tl.where(biased == 0, 127, biased)  # torchao leaves a block of scale 0 unscaled
    else:
        field = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # floor(log2(amax)) + 127; 0 for zero and subnormals
        biased = tl.where(nan, 255, tl.maximum(field - 2, 0))  # e2m1's emax: 2
        unit = tl.maximum(biased, 1)  # torchao divides by the scale clamped to 2^-126
    # 2^(127 - unit) * 2^-14, subnormal from unit 240; 0 in a NaN block (floor: torchao divides by the scale as inf,
    # so its finite values become +-0 there too; rceil: torchao's codes there are NaN, unspecified here)
    e = 113 - unit
    inv = tl.where(e >= -126, (e + 127) << 23, 1 << tl.minimum(e + 149, 31)).to(tl.float32, bitcast=True)
    return biased, tl.where(nan, 0.0, inv)


@triton.jit
def _fp4_code_bits(w, lo_scaled, hi_scaled, PTX: tl.constexpr):
    """Each pair word ``w`` (for its signs) and its scaled magnitudes to a word holding both e2m1 codes, sign
    included: the low element's at bits 9-12, the high one's at bits 25-28 (nothing else set at or above bit 13 of
    either half)."""
    h = _f16x2_clamped(lo_scaled, hi_scaled, PTX)
    r = h + 0x00FF00FF + ((h >> 9) & 0x00010001)  # codes at bits 9-11 and 25-27, round to nearest even
    return r | ((w >> 3) & 0x10001000)  # the bf16 signs (bits 15, 31) beside them, at bits 12 and 28


@triton.jit
def _fp4_pair_bytes(w, lo_scaled, hi_scaled, PTX: tl.constexpr):
    """Each pair word ``w`` (for its signs) and its scaled magnitudes to the byte packing both codes."""
    v = _fp4_code_bits(w, lo_scaled, hi_scaled, PTX)
    return (((v >> 9) & 0x0F) | ((v >> 21) & 0xF0)).to(tl.uint8)


@triton.jit
def _mx_cast_rows(
    X,
    stride_x,
    DATA,
    SCALE,
    R,
    K,
    BR: tl.constexpr,
    G: tl.constexpr,
    EMAX: tl.constexpr,
    MAX: tl.constexpr,
    EBITS: tl.constexpr,
    MBITS: tl.constexpr,
    BIAS: tl.constexpr,
    FP4: tl.constexpr,
    BF16: tl.constexpr,
    HW: tl.constexpr,
    RCEIL: tl.constexpr = False,
    MANT_MAX: tl.constexpr = 0,
):
    BK: tl.constexpr = G * 32
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rows64 = rows.to(tl.int64)  # offsets past 2^31 elements
    cols = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (rows[:, None] < R) & (cols[None, :] < K)  # K % 32 == 0: a block is wholly in or out
    x = widened(tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0), BF16, HW)
    x3 = tl.reshape(x, (BR, G, 32))
    amax = tl.max(tl.abs(x3), axis=2)
    has_nan = tl.max((x3 != x3).to(tl.int32), axis=2) > 0  # max need not propagate NaN; the scale must
    biased, mult = block_scales(amax, has_nan, EMAX, RCEIL, MANT_MAX)
    codes = codes_of(tl.reshape(x3 * mult[:, :, None], (BR, BK)), MAX, EBITS, MBITS, BIAS, FP4, HW)
    g = tl.program_id(1) * G + tl.arange(0, G)
    smask = (rows[:, None] < R) & (g[None, :] < K // 32)
    tl.store(SCALE + rows64[:, None] * (K // 32) + g[None, :], biased.to(tl.uint8), mask=smask)
    if FP4:
        lo, hi = tl.split(tl.reshape(codes, (BR, BK // 2, 2)))
        packed = (lo | (hi << 4)).to(tl.uint8)
        half = tl.program_id(1) * (BK // 2) + tl.arange(0, BK // 2)
        pmask = (rows[:, None] < R) & (half[None, :] < K // 2)
        tl.store(DATA + rows64[:, None] * (K // 2) + half[None, :], packed, mask=pmask)
    else:
        tl.store(DATA + rows64[:, None] * K + cols[None, :], codes.to(tl.uint8), mask=mask)


@triton.jit
def _mx_cast_cols(
    X, stride_x, DATA, SCALE, K, N,
    BN: tl.constexpr, G: tl.constexpr, EMAX: tl.constexpr, MAX: tl.constexpr, EBITS: tl.constexpr,
    MBITS: tl.constexpr, BIAS: tl.constexpr, FP4: tl.constexpr, BF16: tl.constexpr, HW: tl.constexpr,
    RCEIL: tl.constexpr, MANT_MAX: tl.constexpr,
):  # fmt: skip
    """Column-wise: ``x`` ``[K, N]`` (columns contiguous) in blocks of 32 rows. One program: ``G`` blocks of rows x
    ``BN`` columns; fp4 packs rows ``2j`` (low nibble) and ``2j + 1`` of a column into one byte of ``data``
    ``[K / 2, N]``. The scale and element arithmetic are the row kernel's."""
    BK: tl.constexpr = G * 32
    # column tiles on grid axis 0 (no 65535 limit there), blocks of rows on axis 1
    ks = tl.program_id(1) * BK + tl.arange(0, BK)
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    mask = (ks[:, None] < K) & (cols[None, :] < N)  # K % 32 == 0: a block is wholly in or out
    x = widened(tl.load(X + ks.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask, other=0), BF16, HW)
    x3 = tl.reshape(x, (G, 32, BN))
    amax = tl.max(tl.abs(x3), axis=1)
    has_nan = tl.max((x3 != x3).to(tl.int32), axis=1) > 0
    biased, mult = block_scales(amax, has_nan, EMAX, RCEIL, MANT_MAX)
    codes = codes_of(tl.reshape(x3 * mult[:, None, :], (BK, BN)), MAX, EBITS, MBITS, BIAS, FP4, HW)
    g = tl.program_id(1) * G + tl.arange(0, G)
    smask = (g[:, None] < K // 32) & (cols[None, :] < N)
    tl.store(SCALE + g.to(tl.int64)[:, None] * N + cols[None, :], biased.to(tl.uint8), mask=smask)
    if FP4:
        lo, hi = tl.split(tl.permute(tl.reshape(codes, (BK // 2, 2, BN)), (0, 2, 1)))
        half = tl.program_id(1) * (BK // 2) + tl.arange(0, BK // 2)
        pmask = (half[:, None] < K // 2) & (cols[None, :] < N)
        tl.store(DATA + half.to(tl.int64)[:, None] * N + cols[None, :], (lo | (hi << 4)).to(tl.uint8), mask=pmask)
    else:
        tl.store(DATA + ks.to(tl.int64)[:, None] * N + cols[None, :], codes.to(tl.uint8), mask=mask)


@triton.jit
def _mx_cast_cols_fp4_pairs(
    X, stride_x, DATA, SCALE, K, N, BN: tl.constexpr, G: tl.constexpr, PTX: tl.constexpr, RCEIL: tl.constexpr = False
):  # fmt: skip
    """Column-wise bf16 -> MXFP4 with ``_mx_cast_fp4_pairs``'s arithmetic: rows ``2j`` and ``2j + 1`` of a column
    (``X``: the bf16 bits as int16) make one pair word, low half first, and become byte ``j`` of that column."""
    half = tl.program_id(1) * (G * 16) + tl.arange(0, G * 16)  # rows of data: pairs of rows of x
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    mask = (half[:, None] < K // 2) & (cols[None, :] < N)  # K % 32 == 0: a block is wholly in or out
    p = X + (2 * half).to(tl.int64)[:, None] * stride_x + cols[None, :]
    lo16 = tl.load(p, mask=mask, other=0).to(tl.int32) & 0xFFFF
    hi16 = tl.load(p + stride_x, mask=mask, other=0).to(tl.int32)
    w3 = tl.reshape((lo16 | (hi16 << 16)).to(tl.uint32, bitcast=True), (G, 16, BN))
    lo, hi = _halves(w3)
    biased, inv = _fp4_scales(tl.reduce(_max_nan(lo, hi), 1, _max_nan), RCEIL)
    packed = _fp4_pair_bytes(w3, lo * inv[:, None, :], hi * inv[:, None, :], PTX)
    tl.store(DATA + half.to(tl.int64)[:, None] * N + cols[None, :], tl.reshape(packed, (G * 16, BN)), mask=mask)
    g = tl.program_id(1) * G + tl.arange(0, G)
    smask = (g[:, None] < K // 32) & (cols[None, :] < N)
    tl.store(SCALE + g.to(tl.int64)[:, None] * N + cols[None, :], biased.to(tl.uint8), mask=smask)


@triton.jit
def _max_u16x2(a, b, PTX: tl.constexpr):
    """Per 16-bit half, the larger as unsigned integers: for bf16 magnitudes (sign cleared) the larger value, with NaN
    (above 0x7F80) above inf above every finite value, so NaN propagates. ``PTX``: one ``max.u16x2`` (from sm90)."""
    if PTX:
        return tl.inline_asm_elementwise("max.u16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.uint32, is_pure=True,
                                         pack=1)  # fmt: skip
    else:
        return tl.maximum(a & 0xFFFF, b & 0xFFFF) | tl.maximum(a & 0xFFFF0000, b & 0xFFFF0000)


@triton.jit
def _max_u16x2_ptx(a, b):
    return _max_u16x2(a, b, True)


@triton.jit
def _max_u16x2_int(a, b):
    return _max_u16x2(a, b, False)


@triton.jit
def _mx_cast_cols_fp4_words(
    X, stride_w, DATA, SCALE, K, NW, BN: tl.constexpr, G: tl.constexpr, PTX: tl.constexpr, RCEIL: tl.constexpr = False,
    EVEN: tl.constexpr = False, MAX16: tl.constexpr = False,
):  # fmt: skip
    """Column-wise bf16 -> MXFP4 on int32 words of two neighbouring columns (``X``: ``[K, N / 2]`` words,
    ``stride_w`` in words), each column with its own block scale: the pair arithmetic of ``_mx_cast_fp4_pairs``
    with both halves of a word in one f16x2 conversion, then byte ``j`` of each column from its rows ``2j`` (low
    nibble) and ``2j + 1``. ``DATA`` and ``SCALE`` are int16 views: both columns' bytes in one store.

    The blocks' largest magnitudes come from the words' bits (``_max_u16x2``: both columns in one integer max), not
    from fp32 halves: the halves are then needed only for the codes, so they are not held across the reduction
    (registers and instructions: ``COLS_FP4_WORDS``). ``MAX16``: those maxima by ``max.u16x2`` (sm90 on), else two
    32-bit maxima per word. ``EVEN``: every program's tile lies inside x (no masks)."""
    BW: tl.constexpr = BN // 2
    half = tl.program_id(1) * (G * 16) + tl.arange(0, G * 16)  # rows of data: pairs of rows of x
    words = tl.program_id(0) * BW + tl.arange(0, BW)
    mask = None if EVEN else (half[:, None] < K // 2) & (words[None, :] < NW)  # a 32-block is wholly in or out
    p = X + (2 * half).to(tl.int64)[:, None] * stride_w + words[None, :]
    other = None if EVEN else 0
    we = tl.reshape(tl.load(p, mask=mask, other=other).to(tl.uint32, bitcast=True), (G, 16, BW))
    wo = tl.reshape(tl.load(p + stride_w, mask=mask, other=other).to(tl.uint32, bitcast=True), (G, 16, BW))
    ae = we & 0x7FFF7FFF
    ao = wo & 0x7FFF7FFF
    if MAX16:
        amax = tl.reduce(_max_u16x2_ptx(ae, ao), 1, _max_u16x2_ptx)
    else:
        amax = tl.reduce(_max_u16x2_int(ae, ao), 1, _max_u16x2_int)
    b_lo, inv_lo = _fp4_scales((amax << 16).to(tl.float32, bitcast=True), RCEIL)  # columns 2c
    b_hi, inv_hi = _fp4_scales((amax & 0xFFFF0000).to(tl.float32, bitcast=True), RCEIL)  # columns 2c + 1
    lo_e, hi_e = _halves(ae)
    lo_o, hi_o = _halves(ao)
    ve = _fp4_code_bits(we, lo_e * inv_lo[:, None, :], hi_e * inv_hi[:, None, :], PTX)
    vo = _fp4_code_bits(wo, lo_o * inv_lo[:, None, :], hi_o * inv_hi[:, None, :], PTX)
    # column 2c's byte (even row's code low) in bits 0-7 of s, column 2c + 1's in bits 16-23 (others: don't care),
    # then both into the low 16 bits (the rest is cut by the int16 store)
    s = ((ve >> 9) & 0x000F000F) | ((vo >> 5) & 0xFFF0FFF0)
    packed = tl.reshape((s & 0xFF) | ((s >> 8) & 0xFFFFFF00), (G * 16, BW)).to(tl.int16)
    tl.store(DATA + half.to(tl.int64)[:, None] * NW + words[None, :], packed, mask=mask)
    g = tl.program_id(1) * G + tl.arange(0, G)
    smask = None if EVEN else (g[:, None] < K // 32) & (words[None, :] < NW)
    scales = (b_lo | (b_hi << 8)).to(tl.int16)
    tl.store(SCALE + g.to(tl.int64)[:, None] * NW + words[None, :], scales, mask=smask)


def cast_support(x: torch.Tensor, fmt: str, mode: str, axis: int) -> bool | str:
    """What the Triton casts take (``mx_cast``'s and ``mx_fake_quantize``'s kernels share the layouts and modes)."""
    if (reason := device_reason(x)) is not None:
        return reason
    if mode == "rceil" and x.dtype != torch.bfloat16:
        # torchao takes ceil of an fp32 log2 of an fp32 quotient, which rounds some just above a power of two down
        return f"rceil scales from {x.dtype} input (torchao's fp32 log2 rounding; the kernel takes rceil from bf16)"
    if axis == 0:
        if x.shape[1] > 1 and x.stride(1) != 1:
            return copy_reason("x", x, "columns not contiguous (column-wise cast)")
        return True
    k = x.shape[-1]
    if k > 1 and x.stride(-1) != 1:
        return copy_reason("x", x)
    try:
        if x.numel():  # empty input launches nothing (and view(-1, 0) cannot infer its rows)
            x.view(-1, k)
    except RuntimeError:
        return copy_reason("x", x, "leading dims not collapsible to rows")
    return True


@MX_CAST.implement(
    "triton",
    supports=cast_support,
    constraints="x fp32/bf16, blocks of 32 along the last dim (contiguous, leading dims collapsible to rows) or "
    "down the columns of a 2-D x (columns contiguous); floor scales, rceil from bf16; e4m3, e5m2, e2m1 (packed); "
    "rceil from fp32 on ATen",
)
def mx_cast_triton(x: torch.Tensor, fmt: str, mode: str, axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    return launch_cols(x, fmt, mode) if axis == 0 else launch(x, fmt, mode=mode)


PLAN = (16, 8, 4)
"""(rows, 32-value blocks along K, warps) per program."""
HW_CVT = True
"""On NVIDIA GPUs, bf16 widened and fp8 elements rounded by conversion instructions (from sm89) rather than the
integer arithmetic the interpreter needs (``encode``), and bf16 -> fp4 pairs converted by PTX f16x2 instructions
(from sm80, ``ptx_pairs``) rather than per element (``_f16x2_clamped``). Both forms bit-exact with torchao: the
GPU tests compare them on every special block, and fp4 on every bf16 value (sm90)."""


def _hw_cvt(x: torch.Tensor) -> bool:
    """Whether ``x``'s device rounds fp8 by ``HW_CVT``'s instructions. Not before sm89 (Triton has no fp8 type there)
    nor on ROCm, where Triton converts fp32 to OCP fp8 through fp16 before gfx950 (two roundings: not bit-exact)."""
    return HW_CVT and hw_cvt(x)


_CAST = FastLaunch(_mx_cast_rows)
_CAST_FP4_PAIRS = FastLaunch(_mx_cast_fp4_pairs)


_CAST_COLS = FastLaunch(_mx_cast_cols)
_CAST_COLS_FP4_PAIRS = FastLaunch(_mx_cast_cols_fp4_pairs)
_CAST_COLS_FP4_WORDS = FastLaunch(_mx_cast_cols_fp4_words)
COLS_PLAN = (64, 1, 1)
"""Column-wise: (columns, 32-row blocks, warps) per program. One warp reduces a block's 32 rows without a barrier:
copy bandwidth 83-85% for 4096x16384 bf16 -> MXFP8 on the H200, against 20-22% in four warps (64, 2, 4), whose
amax went through shared memory (mx_cast suite's plan scan, b71629c)."""
COLS_FP4_WORDS = True
"""Column-wise bf16 -> MXFP4 through ``_mx_cast_cols_fp4_words`` (two columns per int32 word) where x reads as
words, in ``COLS_FP4_PLAN``; otherwise ``_mx_cast_cols_fp4_pairs`` in ``COLS_PLAN``. sm90 SASS per word (Triton 3.6,
the GPU image's, compiled on the CPU), words kernel in (128, 1, 2): 29.8 instructions, 92 registers (34.2 and 120
with fp32 block maxima, 87cae86). The suite's plan scan for 4096x16384 on the H100 (1af4533): words (128, 1, 2) 95%
of copy bandwidth (89% with fp32 maxima, 4914d71), (64, 1, 1) and (128, 1, 1) 94%, the best pairs plan 86%
(64, 2, 1). On the H200 with fp32 maxima (87cae86) every plan stayed under 75%: words (256, 1, 2) 68%, (128, 1, 2)
66%, the pairs kernel's best 64% (64, 2, 1): 2.8 TB/s, about the H100's 2.7 (bound by instructions, not bytes).
Not taken: the words arithmetic one row of words at a time per thread (an amax pass, then the codes from cache; two
4-byte loads per word where this kernel has a quarter of one 16-byte load), H100, dd18252: at best 83% (256, 1, 4)
against this kernel's 88% then (128, 1, 2) in the same scan; in git history."""
COLS_FP4_PLAN = (128, 1, 2)
"""The words kernel's plan (``COLS_FP4_WORDS``); see there."""


def launch_cols(
    x: torch.Tensor,
    fmt: str,
    mode: str = "floor",
    plan: tuple[int, int, int] | None = None,
    fp4_words: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Column-wise cast of a supported 2-D ``x`` ``[K, N]``: ``data`` ``[K / per_byte, N]``, ``scale``
    ``[K / 32, N]``. ``fp4_words``: bf16 -> MXFP4 by ``_mx_cast_cols_fp4_words`` where x reads as int32 words (None:
    ``COLS_FP4_WORDS``). ``plan`` None: ``COLS_FP4_PLAN`` for that kernel, else ``COLS_PLAN``."""
    f = formats.as_format(fmt)
    consts = cast_constants("mx_cast", fmt, mode, x.dtype, _hw_cvt(x))
    k, n = x.shape
    data = outputs.empty(k // f.per_byte, n, dtype=torch.uint8, device=x.device)
    scale = outputs.empty(k // formats.BLOCK, n, dtype=torch.uint8, device=x.device)
    if x.numel():
        fp4 = f.bits == 4 and x.dtype == torch.bfloat16
        words = _as_pairs(x) if fp4 and (COLS_FP4_WORDS if fp4_words is None else fp4_words) else None
        bn, g, warps = plan or (COLS_FP4_PLAN if words is not None else COLS_PLAN)
        g = min(g, next_pow2(k // formats.BLOCK))
        while cdiv(k, g * formats.BLOCK) > 65535:  # grid axis 1 holds at most 65535 programs: more blocks each
            g *= 2
        if fp4:
            extra = {}
            if words is not None:
                cast, args = _CAST_COLS_FP4_WORDS, (words, words.stride(0), data.view(torch.int16),
                                                    scale.view(torch.int16), k, n // 2)  # fmt: skip
                extra.update(EVEN=n % bn == 0 and k % (g * formats.BLOCK) == 0, MAX16=HW_CVT and ptx_u16x2(x))
            else:
                cast, args = _CAST_COLS_FP4_PAIRS, (x.view(torch.int16), x.stride(0), data, scale, k, n)
            with on_device(x):
                cast(
                    (cdiv(n, bn), cdiv(k, g * formats.BLOCK)), args,
                    BN=bn, G=g, PTX=HW_CVT and ptx_pairs(x), RCEIL=consts["RCEIL"], num_warps=warps, **extra,
                )  # fmt: skip
            return data.view(formats.data_dtype(fmt)), scale.view(torch.float8_e8m0fnu)
        with on_device(x):
            _CAST_COLS(
                (cdiv(n, bn), cdiv(k, g * formats.BLOCK)),
                (x.view(torch.int16) if consts["BF16"] and not consts["HW"] else x, x.stride(0), data, scale, k, n),
                BN=bn, G=g, **consts, num_warps=warps,
            )  # fmt: skip
    return data.view(formats.data_dtype(fmt)), scale.view(torch.float8_e8m0fnu)


def _as_pairs(x2: torch.Tensor) -> torch.Tensor | None:
    """``x2`` (bf16 rows, K even) read as int32 words of two elements, or None where its row stride or offset is odd
    (such rows take ``_mx_cast_rows``)."""
    try:
        return x2.view(torch.int32)
    except RuntimeError:
        return None


def launch(
    x: torch.Tensor, fmt: str, plan: tuple[int, int, int] = PLAN, mode: str = "floor"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise cast of a supported ``x`` (``cast_support``) in one launch ``plan`` (the benchmark times others)."""
    f = formats.as_format(fmt)
    consts = cast_constants("mx_cast", fmt, mode, x.dtype, _hw_cvt(x))
    k = x.shape[-1]
    data = outputs.empty(*x.shape[:-1], k // f.per_byte, dtype=torch.uint8, device=x.device)
    scale = outputs.empty(*x.shape[:-1], k // formats.BLOCK, dtype=torch.uint8, device=x.device)
    if x.numel():
        x2 = x.view(-1, k)
        bf16 = x.dtype == torch.bfloat16
        r = x2.shape[0]
        br, g, warps = plan
        g = min(g, next_pow2(k // formats.BLOCK))
        if f.bits == 4 and bf16 and (pairs := _as_pairs(x2)) is not None:
            with on_device(x):
                _CAST_FP4_PAIRS(
                    (cdiv(r, br), cdiv(k, g * formats.BLOCK)),
                    (pairs, pairs.stride(0), data, scale, r, k),
                    BR=br, G=g, PTX=HW_CVT and ptx_pairs(x), RCEIL=consts["RCEIL"], num_warps=warps,
                )  # fmt: skip
            return data.view(formats.data_dtype(fmt)), scale.view(torch.float8_e8m0fnu)
        with on_device(x):
            _CAST(
                (cdiv(r, br), cdiv(k, g * formats.BLOCK)),
                (x2.view(torch.int16) if bf16 and not consts["HW"] else x2, x2.stride(0), data, scale, r, k),
                BR=br, G=g, **consts, num_warps=warps,
            )  # fmt: skip
    return data.view(formats.data_dtype(fmt)), scale.view(torch.float8_e8m0fnu)
