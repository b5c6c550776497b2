"""MX element and scale arithmetic shared by the Triton MX casts (``mx_cast``, ``mx_fake_quantize``): block scales
(floor, and rceil from bf16), elements rounded to nearest even and saturated, and back to their values. Bit-exact with
``fly_lightning.quant.formats`` (the reference, itself bit-exact with torchao)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fly_lightning.quant import formats

# per format: exponent bits, mantissa bits, exponent bias (the element format's)
ELEMENT_BITS = {"mxfp8_e4m3": (4, 3, 7), "mxfp8_e5m2": (5, 2, 15), "mxfp4_e2m1": (2, 1, 1)}


def cast_constants(op: str, fmt: str, mode: str, dtype: torch.dtype, hw: bool) -> dict:
    """The element and scale constexprs of a cast kernel (``EMAX`` .. ``MANT_MAX``) for ``dtype`` input; ``hw``: the
    GPU's conversion instructions. rceil from bf16 only (``rceil_biased``): other inputs raise, naming ``op``."""
    f = formats.as_format(fmt)
    rceil = formats.as_mode(mode) is formats.ScaleMode.RCEIL
    if rceil and dtype != torch.bfloat16:
        raise ValueError(f"{op}: the Triton kernel takes rceil scales from bf16 only, got {dtype}")
    ebits, mbits, bias = ELEMENT_BITS[f.name]
    return dict(
        EMAX=f.emax, MAX=f.max, EBITS=ebits, MBITS=mbits, BIAS=bias, FP4=f.bits == 4, BF16=dtype == torch.bfloat16,
        HW=hw, RCEIL=rceil, MANT_MAX=mantissa_bits(f.max) if rceil else 0,
    )  # fmt: skip


@triton.jit
def encode(v, EBITS: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr):
    """Saturated fp32 values to element codes (int32), round to nearest even; the sign in the top bit."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    mag_bits = bits & 0x7FFFFFFF
    mag = mag_bits.to(tl.float32, bitcast=True)
    shift: tl.constexpr = 23 - MBITS
    lsb = (mag_bits >> shift) & 1
    normal = ((mag_bits + ((1 << (shift - 1)) - 1) + lsb) >> shift) - ((127 - BIAS) << MBITS)
    # below the smallest normal: a multiple of the subnormal step (code 2^MBITS is the smallest normal, contiguous)
    sub_step: tl.constexpr = 2.0 ** (BIAS - 1 + MBITS)
    # adding and subtracting 1.5 * 2^23 rounds an fp32 below 2^22 to an integer, ties to even
    sub = ((mag * sub_step + 12582912.0) - 12582912.0).to(tl.int32)
    min_normal: tl.constexpr = 2.0 ** (1 - BIAS)
    code = tl.where(mag < min_normal, sub, normal)
    return code | (sign << (EBITS + MBITS))


@triton.jit
def rceil_biased(amax, EMAX: tl.constexpr, MANT_MAX: tl.constexpr):
    """``rceil`` E8M0 scales of bf16 blocks (``amax`` their largest magnitude, in fp32; not NaN): ``ceil(log2(amax /
    max))`` clamped to +-127, plus 127, where ``max = (1 + MANT_MAX * 2^-23) * 2^EMAX`` is the format's largest value.
    From the bits: ``exponent(amax) - EMAX``, plus one where amax's mantissa exceeds max's. torchao takes ``ceil`` of
    an fp32 ``log2`` of the fp32 quotient; for bf16 ``amax`` (8 significant bits) that quotient is a power of two or
    at least 0.4% above one, so the rounding of ``log2`` never reaches the integer and the two agree (fp32 input can
    land within an ulp of a power of two: not taken here). Zero and subnormal blocks (exponent field 0): 0; inf: 254."""
    bits = amax.to(tl.int32, bitcast=True)
    field = (bits >> 23) & 0xFF
    up = ((bits & 0x7FFFFF) > MANT_MAX).to(tl.int32)
    biased = tl.minimum(tl.maximum(field - EMAX + up, 0), 254)  # field - 127 - EMAX + up, clamped to +-127, + 127
    return tl.where(field == 255, 254, biased)


@triton.jit
def _pow2_multiplier(biased, e):
    """fp32 ``2^e`` built from bits (``e`` from -127, the fp32 subnormal 2^-127, to 126), 0 where ``biased`` is 255
    (NaN blocks, whatever ``e`` is there): no division, so no question of the GPU's approximate reciprocal."""
    mult = tl.where(e >= -126, (e + 127) << 23, 1 << 22).to(tl.float32, bitcast=True)
    return tl.where(biased == 255, 0.0, mult)


@triton.jit
def block_scales(amax, has_nan, EMAX: tl.constexpr, RCEIL: tl.constexpr, MANT_MAX: tl.constexpr):
    """Per block (``amax``: its largest magnitude in fp32): ``(biased E8M0 scale, fp32 multiplier to elements)``."""
    if RCEIL:  # bf16 input only (``rceil_biased``)
        biased = tl.where(has_nan, 255, rceil_biased(amax, EMAX, MANT_MAX))
        # 2^(127 - biased), 1 for scale 0 (torchao leaves such blocks unscaled), 2^-127 for 254 (inf blocks: fp32
        # subnormal), 0 in a NaN block (torchao's codes there are NaN: unspecified here)
        mult = _pow2_multiplier(biased, 127 - tl.where(biased == 0, 127, biased))
    else:
        field = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # floor(log2(amax)) + 127; 0: zero and subnormals
        biased = tl.minimum(tl.maximum(field - EMAX, 0), 255)
        biased = tl.where(has_nan, 255, biased)
        # torchao's 1 / max(2^(biased - 127), 2^-126): 2^126 for scale 0, 0 for 255 (1 / inf); equal to the division
        # for every biased value, checked exhaustively in the tests
        mult = _pow2_multiplier(biased, 127 - tl.maximum(biased, 1))
    return biased, mult


@triton.jit
def codes_of(
    scaled, MAX: tl.constexpr, EBITS: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, FP4: tl.constexpr,
    HW: tl.constexpr,
):  # fmt: skip
    """Scaled fp32 values to element codes, saturated at +-MAX, rounded to nearest even."""
    scaled = tl.minimum(tl.maximum(scaled, -MAX), MAX)
    if HW and not FP4:  # the GPU's fp32 -> fp8 conversion: round to nearest even, as torchao's .to() (finite here)
        if EBITS == 5:
            codes = scaled.to(tl.float8e5).to(tl.uint8, bitcast=True)
        else:
            codes = scaled.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        codes = encode(scaled, EBITS, MBITS, BIAS)
    return codes


@triton.jit
def widened(x, BF16: tl.constexpr, HW: tl.constexpr):
    if BF16 and not HW:  # bf16 bits (int16) widened by hand: the interpreter's bf16 -> fp32 mangles subnormals
        return ((x.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


def mantissa_bits(v: float) -> int:
    """The 23 mantissa bits of ``v`` in fp32 (the format's largest value, for ``rceil_biased``)."""
    return int(torch.tensor(v, dtype=torch.float32).view(torch.int32)) & 0x7FFFFF


@triton.jit
def decode(codes, EBITS: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr):
    """Element codes (``encode``'s, sign in bit ``EBITS + MBITS``) to their fp32 values, exactly. The format's NaN
    codes read as finite here: they occur only in NaN-scale blocks, whose scale value is NaN."""
    c = codes.to(tl.int32)
    e = (c >> MBITS) & ((1 << EBITS) - 1)
    m = c & ((1 << MBITS) - 1)
    significand = tl.where(e == 0, m, m + (1 << MBITS)).to(tl.float32)  # subnormals: no implicit bit
    step = ((tl.maximum(e, 1) - BIAS - MBITS + 127) << 23).to(tl.float32, bitcast=True)  # 2^(exponent - MBITS)
    v = significand * step
    return tl.where(((c >> (EBITS + MBITS)) & 1) == 1, -v, v)


@triton.jit
def element_values(
    scaled, MAX: tl.constexpr, EBITS: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, FP4: tl.constexpr,
    HW: tl.constexpr,
):  # fmt: skip
    """The fp32 values of the elements ``codes_of`` gives for ``scaled``."""
    if HW and not FP4:  # the GPU's conversions, there and back
        scaled = tl.minimum(tl.maximum(scaled, -MAX), MAX)
        if EBITS == 5:
            v = scaled.to(tl.float8e5).to(tl.float32)
        else:
            v = scaled.to(tl.float8e4nv).to(tl.float32)
    else:
        v = decode(codes_of(scaled, MAX, EBITS, MBITS, BIAS, FP4, HW), EBITS, MBITS, BIAS)
    return v


@triton.jit
def scale_values(biased):
    """E8M0 scales to their fp32 values ``2^(biased - 127)``: 0 is the subnormal 2^-127, 255 NaN (``from_mx``)."""
    v = tl.where(biased == 0, 1 << 22, biased << 23).to(tl.float32, bitcast=True)
    return tl.where(biased == 255, float("nan"), v)


@triton.jit
def bf16_bits(v):
    """fp32 to bf16 bits (int16) rounded to nearest even, by integer arithmetic: the interpreter's conversion
    truncates. NaN stays NaN (quiet), inf inf."""
    b = v.to(tl.int32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return tl.where(v != v, (b >> 16) | 0x40, r).to(tl.int16)
