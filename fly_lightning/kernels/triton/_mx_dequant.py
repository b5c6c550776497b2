"""MX tile dequantisation in registers, shared by the Triton MX GEMMs (``mx_scaled_mm``, ``mx_grouped_mm``).

Each helper turns a tile of MX elements plus its E8M0 scales (one per 32 elements along the tile's last dim) into
bf16 values ready for ``tl.dot``: no table gather, no hardware float8 conversion. The element's magnitude bits are
moved into a bf16 bit pattern whose exponent field is the element's own (e4m3 / e5m2 / e2m1 exponent, bias not yet
corrected), so normal and subnormal elements alike read as ``value * 2^-(127 - element bias)``; one multiply by the
missing power of two (2^120, 2^112, 2^126) and one by the block scale ``2^(s - 127)`` (built from its bits) give the
value. Every step is exact while the product stays in bf16's normal range (fp8 / fp4 values have at most 3
significant bits), so the result equals the fp32 dequantisation of ``fly_lightning.quant.formats.from_mx`` up to
underflow below 2^-126 (bf16 subnormals keep 7 bits).

Specials: scale 255 is NaN (the whole block decodes to NaN); e4m3 code 0x7F and e5m2 exponent 31 decode to NaN /
inf as torch's float8 types do (``to_mx`` never emits them outside NaN blocks, but the oracle honours them).

``FP32=True`` does the multiplies in fp32 and returns fp32: the Triton interpreter's bf16 arithmetic works on raw
bits and its bf16 -> fp32 conversion flushes subnormals, so kernels pass ``FP32=INTERPRET`` (values are the same).
Function names and signatures are stable: other kernels import them.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fly_lightning.kernels import outputs
from fly_lightning.kernels.triton._fragment_k import STEP as FRAGMENT_STEP
from fly_lightning.kernels.triton._fragment_k import fragment_k, to_fragment_order
from fly_lightning.kernels.triton._launch import FastLaunch
from fly_lightning.kernels.triton._math import cdiv
from fly_lightning.kernels.triton._support import interpreting, on_device

FMT_CODE = {None: 0, "mxfp8_e4m3": 1, "mxfp8_e5m2": 2, "mxfp4_e2m1": 3}
"""Element format codes (kernel constexprs); 0 is high precision (bf16/fp32 activations)."""


@triton.jit
def _as_u8(x):
    if x.dtype != tl.uint8:
        x = x.to(tl.uint8, bitcast=True)
    return x


@triton.jit
def _from_bf16_bits(bits, FP32: tl.constexpr):
    """A bf16 bit pattern held in an int32 to bf16 (or, ``FP32``, to the same value in fp32)."""
    # if/else, no early return: compiled (not interpreted), the code after a return in a constexpr branch is built too
    if FP32:
        out = (bits << 16).to(tl.float32, bitcast=True)
    else:
        out = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    return out


@triton.jit
def _e8m0_bits(s):
    """E8M0 codes (widened integers) to the bf16 bits of ``2^(s - 127)``: 0 -> 0x0040 (2^-127), 255 -> 0x7FC0 (NaN)."""
    return (s << 7) | tl.where((s == 0) | (s == 255), 0x40, 0)


@triton.jit
def _e8m0_bf16_pairs(scale_u8):
    """E8M0 scales (uint8) to uint32 words holding the bf16 scale in both halves (``fma.rn.bf16x2``'s operand)."""
    b = _e8m0_bits(_as_u8(scale_u8).to(tl.uint32))
    return b | (b << 16)


@triton.jit
def e8m0_to_float(scale_u8, FP32: tl.constexpr = False):
    """E8M0 scales (uint8) to ``2^(s - 127)`` in bf16 (fp32 with ``FP32``); 0 is 2^-127 (a subnormal), 255 NaN."""
    return _from_bf16_bits(_e8m0_bits(_as_u8(scale_u8).to(tl.int32)), FP32)


@triton.jit
def _apply_scale(v, scale_u8, FP32: tl.constexpr):
    """``v`` [R, C] times its block's scale, ``scale_u8`` [R, C / 32]."""
    R: tl.constexpr = v.shape[0]
    C: tl.constexpr = v.shape[1]
    s = e8m0_to_float(scale_u8, FP32)
    v3 = tl.reshape(v, (R, C // 32, 32)) * s[:, :, None]
    return tl.reshape(v3, (R, C))


@triton.jit
def dequant_fp8(
    x_u8_or_fp8, scale_e8m0_u8, E5M2: tl.constexpr = False, FP32: tl.constexpr = False, HW_CVT: tl.constexpr = False
):
    """MXFP8 tile ``[R, C]`` (uint8 codes or float8 values; e4m3, or e5m2 with ``E5M2``) with scales ``[R, C / 32]``
    (uint8) to bf16 ``[R, C]`` (fp32 with ``FP32``).

    ``HW_CVT`` (GPU only): the elements through the hardware's float8 -> f16 conversion, then f32 and bf16 (exact,
    specials kept): about a third of the bit path's instructions on sm90 (554 against 1719 per K step of a 128x128
    tile), but conversions issue at a quarter of the integer rate; which is faster is measured, not assumed."""
    if HW_CVT and not FP32:
        if E5M2:
            v = _as_u8(x_u8_or_fp8).to(tl.float8e5, bitcast=True).to(tl.float16).to(tl.float32).to(tl.bfloat16)
        else:
            v = _as_u8(x_u8_or_fp8).to(tl.float8e4nv, bitcast=True).to(tl.float16).to(tl.float32).to(tl.bfloat16)
        return _apply_scale(v, scale_e8m0_u8, FP32)
    x = _as_u8(x_u8_or_fp8).to(tl.int32)
    sign = (x & 0x80) << 8
    mag = x & 0x7F
    if E5M2:
        bits = sign | (mag << 5)  # exponent field at bf16's, bias 15 instead of 127
        bits = tl.where(mag >= 0x7C, sign | 0x7F80 | tl.where(mag > 0x7C, 0x40, 0), bits)  # inf / NaN
        bias: tl.constexpr = 2.0**112
    else:
        bits = sign | (mag << 4)  # bias 7 instead of 127
        bits = tl.where(mag == 0x7F, 0x7FC0, bits)  # e4m3fn has no inf; 0x7F / 0xFF are NaN
        bias: tl.constexpr = 2.0**120
    v = _from_bf16_bits(bits, FP32) * bias
    return _apply_scale(v, scale_e8m0_u8, FP32)


@triton.jit
def _fp4_pair_bits(packed_u8):
    """Bytes of two e2m1 codes ``[R, CP]`` to uint32 words of two bf16 bit patterns (element ``2j``, the low nibble,
    in the low half), each ``value * 2^-126``: two multiplies place both nibbles' sign and exponent-mantissa bits
    (the byte's copies at 6 and 18, and at 12 and 24, never overlap), two masks keep them."""
    b = _as_u8(packed_u8).to(tl.uint32)
    return ((b * 0x00040040) & 0x01C001C0) | ((b * 0x01001000) & 0x80008000)


FP4_WORDS_LUT_ASM = tl.constexpr(
    "{ .reg .b32 m, g, m2, g2, l0, h0, s0, l1, h1, s1, z;"
    " and.b32 m, $4, 0x77777777; and.b32 g, $4, 0x88888888; shr.u32 g, g, 3;"
    " shr.u32 m2, m, 16; shr.u32 g2, g, 16;"
    # magnitude code c -> bf16 bytes: low [00 00 80 C0 00 40 80 C0], high [00 3F 3F 3F 40 40 40 40]
    " prmt.b32 l0, 0xC0800000, 0xC0804000, m; prmt.b32 h0, 0x3F3F3F00, 0x40404040, m;"
    " prmt.b32 s0, 0x8000, 0, g; or.b32 h0, h0, s0;"
    " prmt.b32 l1, 0xC0800000, 0xC0804000, m2; prmt.b32 h1, 0x3F3F3F00, 0x40404040, m2;"
    " prmt.b32 s1, 0x8000, 0, g2; or.b32 h1, h1, s1;"
    " prmt.b32 $0, l0, h0, 0x5140; prmt.b32 $1, l0, h0, 0x7362;"
    " prmt.b32 $2, l1, h1, 0x5140; prmt.b32 $3, l1, h1, 0x7362;"
    " mov.b32 z, 0x80008000;"
    " fma.rn.bf16x2 $0, $0, $5, z; fma.rn.bf16x2 $1, $1, $5, z;"
    " fma.rn.bf16x2 $2, $2, $5, z; fma.rn.bf16x2 $3, $3, $5, z; }"
)
"""``_fp4_words_lut``'s PTX: ``$4`` a word of eight e2m1 codes, ``$5`` the bf16 scale pair, ``$0``-``$3`` the scaled
bf16 pairs of bytes 0-3. Public: a Gluon kernel's inline asm takes it as it is."""


@triton.jit
def _fp4_words_lut(words_u32, s_pair):
    """uint32 words of eight e2m1 codes (byte ``j``: elements ``2j`` low nibble, ``2j + 1``) and their bf16 scale
    pairs (the scale in both halves) to four uint32 words of two bf16 values each, scaled (word ``j`` from byte
    ``j``). The magnitudes index two byte tables (``prmt``: the low and high bytes of the bf16 value), the signs a
    third, and one exact ``fma.rn.bf16x2`` (-0 addend) per word applies the scale: 21 instructions for eight
    elements, and half the pair form's scale multiplies (``dequant_fp4``; loop counts in ``mx_scaled_mm``)."""
    return tl.inline_asm_elementwise(
        FP4_WORDS_LUT_ASM,
        "=r,=r,=r,=r,r,r",
        [words_u32, s_pair],
        dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
        is_pure=True,
        pack=1,
    )


@triton.jit
def dequant_fp4_words(words_u32, scale):
    """MXFP4 tile as uint32 words of eight e2m1 codes ``[R, C / 8]`` (little-endian bytes: element ``2j`` in byte
    ``j``'s low nibble) with scales ``[R, C / 32]`` (uint8) to bf16 ``[R, C]``: ``_fp4_words_lut`` (NVIDIA sm80+)."""
    R: tl.constexpr = words_u32.shape[0]
    KW: tl.constexpr = words_u32.shape[1]
    s_pair = tl.reshape(tl.broadcast_to(_e8m0_bf16_pairs(scale)[:, :, None], (R, KW // 4, 4)), (R, KW))
    o0, o1, o2, o3 = _fp4_words_lut(words_u32, s_pair)
    return words_to_bf16(o0, o1, o2, o3)


@triton.jit
def words_to_bf16(o0, o1, o2, o3):
    """Four ``[R, KW]`` uint32 tiles of bf16 pairs (tile ``j`` from byte ``j`` of each source word) to bf16
    ``[R, KW * 8]`` in element order."""
    R: tl.constexpr = o0.shape[0]
    KW: tl.constexpr = o0.shape[1]
    w = tl.reshape(tl.join(tl.join(o0, o2), tl.join(o1, o3)), (R, KW * 4))  # word j of each group in order
    lo = w.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    hi = (w >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return tl.reshape(tl.join(lo, hi), (R, KW * 8))


@triton.jit
def dequant_fp4(packed_u8, scale, FP32: tl.constexpr = False, PTX: tl.constexpr = False):
    """MXFP4 tile packed two e2m1 codes per byte along the last dim (element ``2j`` in the low nibble), ``[R, C / 2]``
    uint8, with scales ``[R, C / 32]`` (uint8) to bf16 ``[R, C]`` (fp32 with ``FP32``).

    ``PTX`` (NVIDIA sm80+, ``ptx_pairs``; ignored with ``FP32``): each byte's pair stays in one 32-bit word through
    both power-of-two multiplies (``fma.rn.bf16x2`` with a -0 addend, exact) and is split into bf16 halves only for
    the dot."""
    R: tl.constexpr = packed_u8.shape[0]
    CP: tl.constexpr = packed_u8.shape[1]
    if PTX and not FP32:
        w = _fp4_pair_bits(packed_u8)
        G: tl.constexpr = CP // 16
        s_pair = tl.broadcast_to(_e8m0_bf16_pairs(scale)[:, :, None], (R, G, 16))
        w = tl.inline_asm_elementwise(
            "{ .reg .b32 c, z; mov.b32 c, 0x7E807E80; mov.b32 z, 0x80008000; "
            "fma.rn.bf16x2 $0, $1, c, z; fma.rn.bf16x2 $0, $0, $2, z; }",
            "=r,r,r",
            [tl.reshape(w, (R, G, 16)), s_pair],
            dtype=tl.uint32,
            is_pure=True,
            pack=1,
        )
        w = tl.reshape(w, (R, CP))
        lo = w.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        hi = (w >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        out = tl.reshape(tl.join(lo, hi), (R, CP * 2))
    else:  # per element: the interpreter (FP32), ROCm, pre-sm80, and fp4 x fp4 grouped tiles (16 bytes of spills)
        p = _as_u8(packed_u8).to(tl.int32)
        codes = tl.reshape(tl.join(p & 0xF, p >> 4), (R, CP * 2))  # join puts the low nibble first: element 2j
        bits = ((codes & 8) << 12) | ((codes & 7) << 6)  # sign; exponent (2 bits) and mantissa (1) at bf16's, bias 1
        v = _from_bf16_bits(bits, FP32) * 2.0**126
        out = _apply_scale(v, scale, FP32)
    return out


@triton.jit
def load_operand(
    row_ptrs,
    scale_ptrs,
    kk,
    FMT: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32: tl.constexpr,
    HW_CVT: tl.constexpr = False,
    PTX: tl.constexpr = False,
    LUT: tl.constexpr = False,
    FRAG_K: tl.constexpr = False,
):
    """K step ``kk`` (elements ``[kk * BLOCK_K, (kk + 1) * BLOCK_K)``) of a tile's rows as a dot operand
    ``[rows, BLOCK_K]``, the MX GEMMs' one loader: bf16, or fp32 with ``FP32`` (the interpreter, whose bf16 arithmetic
    and dot are unreliable). Offsets are step index times a constant: no divisions, and Triton's pipeliner then
    prefetches every load of the loop (the scales included) as an async copy.

    ``row_ptrs`` ``[rows, 1]`` point at each row's first element (its first byte for MX), ``scale_ptrs`` at its first
    scale (unused for ``FMT`` 0). ``FMT`` 0: high-precision rows read as they are (bf16, or fp32 rounded to bf16), in
    ``fragment_k`` order with ``FRAG_K``. MXFP4 with ``LUT``: rows read as 32-bit words (``dequant_fp4_words``; rows
    4-byte aligned, the caller's check); ``HW_CVT`` and ``PTX`` as in ``dequant_fp8`` and ``dequant_fp4``."""
    # if/else, no early returns: Triton generates the code after a return in a constexpr branch too
    if FMT == 0:
        ks = fragment_k(BLOCK_K) if FRAG_K else tl.arange(0, BLOCK_K)
        v = tl.load(row_ptrs + kk * BLOCK_K + ks[None, :])
        if not FP32:
            v = v.to(tl.bfloat16)
        elif v.dtype == tl.bfloat16:  # widened by hand: the interpreter's bf16 -> fp32 conversion flushes subnormals
            v = ((v.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        else:
            v = v.to(tl.float32)
    else:
        s = tl.load(scale_ptrs + kk * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)[None, :])
        if FMT == 3:
            if LUT:
                words = (
                    row_ptrs.to(tl.pointer_type(tl.uint32)) + kk * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)[None, :]
                )
                v = dequant_fp4_words(tl.load(words), s)
            else:
                x = tl.load(row_ptrs + kk * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)[None, :])
                v = dequant_fp4(x, s, FP32, PTX)
        else:
            x = tl.load(row_ptrs + kk * BLOCK_K + tl.arange(0, BLOCK_K)[None, :])
            v = dequant_fp8(x, s, FMT == 2, FP32, HW_CVT)
    return v


# Prepass dequantisation: a whole MX operand to bf16 in memory, for the GEMM plans that then run a bf16 GEMM
# (cuBLAS, or the bf16 grouped kernel). Hopper has no MX tensor cores: at many rows per weight, writing the bf16
# operand once and running the bf16 GEMM at its full rate beats converting every tile in the GEMM's main loop.
@triton.jit
def group_has_rows(OFFS, grp, valid, M):
    """Whether groups ``grp`` have rows in a grouped GEMM, its int32 end offsets ``OFFS`` clamped to [0, M] as it
    clamps them (``valid``: which lanes may read)."""
    end = tl.minimum(tl.maximum(tl.load(OFFS + grp, mask=valid, other=0), 0), M)
    start = tl.minimum(tl.maximum(tl.load(OFFS + grp - 1, mask=(grp > 0) & valid, other=0), 0), M)
    return end > start


DEQUANT_ROWS = 16  # rows x 512 elements per program: 8K elements, enough bytes in flight per program
DEQUANT_COLS = 512


@triton.jit
def _dequant_tile(
    DATA, SCALE, OUT, R, C, stride_d, stride_s, stride_o, tile, n_col_tiles,
    FMT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, FP32: tl.constexpr, HW_CVT: tl.constexpr,
    PTX: tl.constexpr, OFFS=None, GROUP_ROWS=1, M=0, SKIP_EMPTY: tl.constexpr = False, FRAG: tl.constexpr = False,
):  # fmt: skip
    rows = (tile // n_col_tiles) * BR + tl.arange(0, BR)
    cb = tile % n_col_tiles
    cols = cb * BC + tl.arange(0, BC)
    rmask = rows[:, None] < R
    if SKIP_EMPTY:  # rows of groups with no rows in the grouped GEMM: neither read nor written
        rmask = rmask & group_has_rows(OFFS, rows // GROUP_ROWS, rows < R, M)[:, None]
    rows64 = rows.to(tl.int64)
    g = cb * (BC // 32) + tl.arange(0, BC // 32)
    s = tl.load(SCALE + rows64[:, None] * stride_s + g[None, :], mask=rmask & (g[None, :] < C // 32), other=127)
    if FMT == 3:
        half = cb * (BC // 2) + tl.arange(0, BC // 2)
        x = tl.load(DATA + rows64[:, None] * stride_d + half[None, :], mask=rmask & (half[None, :] < C // 2), other=0)
        v = dequant_fp4(x, s, FP32, PTX)
    else:
        x = tl.load(DATA + rows64[:, None] * stride_d + cols[None, :], mask=rmask & (cols[None, :] < C), other=0)
        v = dequant_fp8(x, s, FMT == 2, FP32, HW_CVT)
    if FRAG:  # each 128-wide step in fragment_k's order (C % 128 == 0, the caller's check), reordered in registers:
        # scattered 2-byte stores would write partial sectors (about 10x slower, mx_grouped_mm suite, H100, 8a88425)
        v = tl.reshape(to_fragment_order(tl.reshape(v, (BR * (BC // 128), 128))), (BR, BC))
    tl.store(OUT + rows64[:, None] * stride_o + cols[None, :], v, mask=rmask & (cols[None, :] < C))


@triton.jit
def _dequant_kernel(
    A, A_SCALE, A_OUT, RA, stride_a, stride_as, stride_ao,
    B, B_SCALE, B_OUT, RB, stride_b, stride_bs, stride_bo, C, OFFS, GROUP_ROWS,
    A_FMT: tl.constexpr, B_FMT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, FP32: tl.constexpr,
    HW_CVT: tl.constexpr, PTX: tl.constexpr, SKIP_EMPTY: tl.constexpr = False, A_FRAG: tl.constexpr = False,
):  # fmt: skip
    """Two operands of the same K in one launch (each launch costs the host tens of microseconds): the first
    ``cdiv(RA, BR) * cdiv(C, BC)`` programs take A's tiles, the rest B's (``A_FRAG``: A stored in ``fragment_k``'s
    order). ``SKIP_EMPTY``: B holds ``GROUP_ROWS`` rows per group and A the grouped GEMM's rows, ``OFFS`` its int32
    end offsets: B's rows of groups without rows are skipped (the offsets clamped to [0, RA] as the grouped GEMM
    clamps them)."""
    n_col_tiles = tl.cdiv(C, BC)
    tiles_a = tl.cdiv(RA, BR) * n_col_tiles
    pid = tl.program_id(0)
    if pid < tiles_a:
        _dequant_tile(A, A_SCALE, A_OUT, RA, C, stride_a, stride_as, stride_ao, pid, n_col_tiles,
                      A_FMT, BR, BC, FP32, HW_CVT, PTX, FRAG=A_FRAG)  # fmt: skip
    else:
        _dequant_tile(B, B_SCALE, B_OUT, RB, C, stride_b, stride_bs, stride_bo, pid - tiles_a, n_col_tiles,
                      B_FMT, BR, BC, FP32, HW_CVT, PTX, OFFS, GROUP_ROWS, RA, SKIP_EMPTY)  # fmt: skip


def hw_cvt(t: torch.Tensor) -> bool:
    """Whether ``t``'s device converts fp8 by instruction (``dequant_fp8``'s ``HW_CVT``): NVIDIA from sm89 (Triton has
    no fp8 type before); not ROCm, nor the interpreter."""
    return _nvidia_capability(t.device) >= (8, 9)


def ptx_pairs(t: torch.Tensor) -> bool:
    """Whether ``t``'s device runs the inline-PTX pair forms (``dequant_fp4``'s ``PTX``, the bf16 -> MXFP4 cast):
    NVIDIA from sm80 (``cvt.rn.f16x2.f32``, ``min.f16x2``, ``fma.rn.bf16x2``); not ROCm, nor the interpreter."""
    return _nvidia_capability(t.device) >= (8, 0)


def ptx_u16x2(t: torch.Tensor) -> bool:
    """Whether ``t``'s device takes PTX's 16-bit-pair integer forms (``max.u16x2``): NVIDIA from sm90."""
    return _nvidia_capability(t.device) >= (9, 0)


def hopper(t: torch.Tensor) -> bool:
    """Whether ``t``'s device is an NVIDIA Hopper (sm90: warpgroup MMAs; not Blackwell, whose MMAs and shared memory
    differ; not ROCm, nor the interpreter): the launch plans whose register layouts were written and timed there."""
    return _nvidia_capability(t.device)[0] == 9


def _nvidia_capability(device: torch.device) -> tuple[int, int]:
    """``device``'s compute capability when compiled Triton runs on it and it is an NVIDIA GPU, else (0, 0)."""
    if device.type != "cuda" or torch.version.hip is not None or interpreting():
        return (0, 0)
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _capability(index: int) -> tuple[int, int]:  # the query costs the host microseconds on every call
    return torch.cuda.get_device_capability(index)


_DEQUANT = FastLaunch(_dequant_kernel)


def _rows(data: torch.Tensor, scale: torch.Tensor, fmt: str) -> int:
    """``data``'s rows after checking it against its scales (before any launch: no out-of-bounds read)."""
    r, g = scale.shape
    if data.shape != (r, g * 32 // (2 if fmt == "mxfp4_e2m1" else 1)):
        raise ValueError(f"dequantize: {fmt} data {tuple(data.shape)} does not match scales {tuple(scale.shape)}")
    return r


def dequantize(
    data: torch.Tensor,
    scale: torch.Tensor,
    fmt: str,
    *more: torch.Tensor | str,
    offs: torch.Tensor | None = None,
    fragment_order: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """MX rows ``data`` ``[R, C / per_byte]`` (last dim contiguous, any row stride) with E8M0 ``scale`` ``[R, C / 32]``
    to a new ``[R, C]`` tensor: bf16 on the GPU; fp32 under the interpreter (same values: its bf16 is unreliable).

    ``dequantize(a, a_scale, a_fmt, b, b_scale, b_fmt)``: two operands of the same K in one launch, a pair back.
    ``offs``: a grouped GEMM's int32 end offsets (``[E]``, contiguous) over ``a``'s rows, ``b`` holding E groups of
    equal rows (its weights): rows of ``b``'s groups that have no rows of ``a`` are left unwritten.
    ``fragment_order``: ``a``'s columns stored in ``_fragment_k``'s order within each 128 (C % 128 == 0), the layout
    the swapped grouped GEMM then reads with contiguous loads.
    Runs on every GEMM call of the prepass plans: its host time is kept low (one shape check per operand, and
    ``FastLaunch``)."""
    if more and (len(more) != 3 or scale.shape[1] != more[1].shape[1]):
        raise ValueError("dequantize: one operand, or two (data, scale, fmt) of the same K")
    if offs is not None and (not more or offs.numel() == 0 or more[1].shape[0] % offs.numel()):
        raise ValueError("dequantize: offs needs two operands, the second's rows a multiple of the groups")
    ra = _rows(data, scale, fmt)
    if fragment_order and scale.shape[1] % (FRAGMENT_STEP // 32):
        raise ValueError(f"dequantize: fragment_order needs K % {FRAGMENT_STEP} == 0, not {scale.shape[1] * 32}")
    b, b_s, b_fmt = more if more else (data, scale, fmt)
    rb = _rows(b, b_s, b_fmt) if more else 0
    c = scale.shape[1] * 32
    dev = data.device
    dtype = torch.bfloat16 if data.is_cuda else torch.float32
    # one allocation for both (host time); skipped groups' rows stay unwritten but are never read (their groups have
    # no rows in the GEMM): no deterministic-mode fill for them either
    out = outputs.empty(ra + rb, c, dtype=dtype, device=dev)
    a_out, b_out = (out[:ra], out[ra:]) if more else (out, out)
    tiles = (cdiv(ra, DEQUANT_ROWS) + cdiv(rb, DEQUANT_ROWS)) * cdiv(c, DEQUANT_COLS)
    if tiles:
        hw = hw_cvt(data)
        s_u8 = scale.view(torch.uint8)
        bs_u8 = b_s.view(torch.uint8) if more else s_u8
        with on_device(data):
            _DEQUANT(
                (tiles,),
                (data.view(torch.uint8), s_u8, a_out, ra, data.stride(0), scale.stride(0), c,
                 b.view(torch.uint8), bs_u8, b_out, rb, b.stride(0), b_s.stride(0), c, c,
                 s_u8 if offs is None else offs, 1 if offs is None else rb // offs.numel()),  # s_u8: unread
                A_FMT=FMT_CODE[fmt], B_FMT=FMT_CODE[b_fmt], BR=DEQUANT_ROWS, BC=DEQUANT_COLS, FP32=not data.is_cuda,
                HW_CVT=hw, PTX=hw or ptx_pairs(data),  # sm89 (hw) implies sm80
                SKIP_EMPTY=offs is not None, A_FRAG=fragment_order, num_warps=4,
            )  # fmt: skip
    return (a_out, b_out) if more else a_out
