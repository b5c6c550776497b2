"""The shared MX dequantisation helpers (interpreter): every fp8 code and every fp4 pair, under zero, NaN, small, unit
and large scales, equal to the fp32 dequantisation of ``formats.from_mx`` (NaN where it is NaN, inf where it is inf);
the prepass kernel (``dequantize``) on whole operands: ragged tiles, strided rows, every code, poisoned outputs."""

import pytest
import torch
import triton
import triton.language as tl

from fly_lightning.kernels.triton._mx_dequant import (
    _fp4_pair_bits,
    dequant_fp4,
    dequant_fp8,
    dequantize,
    e8m0_to_float,
    hw_cvt,
)
from fly_lightning.quant import formats


@triton.jit
def _fp8_kernel(X, S, OUT, E5M2: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    r = tl.arange(0, R)
    c = tl.arange(0, C)
    x = tl.load(X + r[:, None] * C + c[None, :])
    s = tl.load(S + r[:, None] * (C // 32) + tl.arange(0, C // 32)[None, :])
    tl.store(OUT + r[:, None] * C + c[None, :], dequant_fp8(x, s, E5M2, True))


@triton.jit
def _fp4_kernel(X, S, OUT, R: tl.constexpr, C: tl.constexpr):
    r = tl.arange(0, R)
    x = tl.load(X + r[:, None] * (C // 2) + tl.arange(0, C // 2)[None, :])
    s = tl.load(S + r[:, None] * (C // 32) + tl.arange(0, C // 32)[None, :])
    tl.store(OUT + r[:, None] * C + tl.arange(0, C)[None, :], dequant_fp4(x, s, True))


@triton.jit
def _fp4_pair_bits_kernel(X, OUT, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(OUT + i[None, :], _fp4_pair_bits(tl.load(X + i[None, :])).to(tl.int32, bitcast=True))


@triton.jit
def _scale_kernel(S, OUT, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(OUT + i, e8m0_to_float(tl.load(S + i), True))


SCALES = [0, 255, 127, 1, 254, 100, 140, 120]  # one per 32-element block: 2^-127, NaN, 1, 2^-126, 2^127, ...


def _same(y: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.equal(y.isnan(), want.isnan()) and torch.equal(y[~want.isnan()], want[~want.isnan()])


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp8_e5m2"])
def test_fp8_every_code(fmt):
    x = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(4, 1)  # rows: all 256 codes, 8 blocks
    s = torch.tensor([SCALES, SCALES[::-1], [127] * 8, [3] * 8], dtype=torch.uint8)
    y = torch.empty(4, 256)
    _fp8_kernel[(1,)](x, s, y, E5M2=fmt == "mxfp8_e5m2", R=4, C=256)
    want = formats.from_mx(x.view(formats.FORMATS[fmt].torch_dtype), s.view(torch.float8_e8m0fnu), fmt)
    assert _same(y, want)
    assert want[2].isinf().any() == (fmt == "mxfp8_e5m2")  # at scale 1 only e5m2 has inf codes: covered


def test_fp4_every_pair():
    x = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(2, 1)  # 512 elements a row: 16 blocks
    s = torch.tensor([SCALES * 2, [127] * 16], dtype=torch.uint8)
    y = torch.empty(2, 512)
    _fp4_kernel[(1,)](x, s, y, R=2, C=512)
    want = formats.from_mx(x, s.view(torch.float8_e8m0fnu), "mxfp4_e2m1")
    assert _same(y, want)


def test_fp4_pair_bits_on_every_byte():
    """The GPU's pairwise fp4 decode (``dequant_fp4`` with ``PTX``) starts from these words: for every byte, both
    nibbles' bf16 bit patterns (value * 2^-126), the low nibble in the low half."""
    x = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = torch.empty(256, dtype=torch.int32)
    _fp4_pair_bits_kernel[(1,)](x, out, N=256)
    codes = torch.stack([x.int() & 0xF, x.int() >> 4])
    halves = ((codes & 8) << 12) | ((codes & 7) << 6)
    assert torch.equal(out, halves[0] | (halves[1] << 16))  # int32 wraps like the kernel's uint32 for sign bit 31
    values = halves.to(torch.int16).view(torch.bfloat16).float() * 2.0**126
    unit = torch.full((1, 16), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)  # scale 1
    assert torch.equal(values, formats.from_mx(x.reshape(1, 256), unit, "mxfp4_e2m1").reshape(256, 2).t())


def test_scales():
    s = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    y = torch.empty(256)
    _scale_kernel[(1,)](s, y, N=256)
    want = torch.exp2(torch.arange(256, dtype=torch.float32) - 127)
    want[255] = float("nan")
    assert _same(y, want)


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp4_e2m1"])
def test_dequantize_whole_operands(fmt):
    """Rows and columns off the program tile (16 x 512), every code under every scale, rows of a wider buffer."""
    per_byte = 2 if fmt == "mxfp4_e2m1" else 1
    r, c = 19, 544 * per_byte  # 544 bytes a row: every code at least twice
    codes = torch.arange(r * c // per_byte, dtype=torch.int32).to(torch.uint8).view(r, -1)
    wide = torch.zeros(r, codes.shape[1] + 64, dtype=torch.uint8)
    wide[:, 32 : 32 + codes.shape[1]] = codes
    data = wide[:, 32 : 32 + codes.shape[1]]  # row stride past the row's end
    s = torch.tensor(SCALES * (r * c // 32 // len(SCALES) + 1), dtype=torch.uint8)[: r * c // 32].view(r, -1)
    if per_byte == 1:
        data = data.view(formats.FORMATS[fmt].torch_dtype)
    y = dequantize(data, s.view(torch.float8_e8m0fnu), fmt)  # outputs are poisoned (NaN) in tests
    want = formats.from_mx(data.contiguous(), s.view(torch.float8_e8m0fnu), fmt)
    assert y.shape == (r, c) and y.dtype == torch.float32  # the interpreter's values in fp32: the same values
    assert _same(y, want)
    assert dequantize(data[:0], s[:0].view(torch.float8_e8m0fnu), fmt).shape == (0, c)
    assert not hw_cvt(data)  # CPU: bit placement, no conversion instructions


def test_dequantize_two_operands_in_one_launch():
    """Two operands of the same K and different formats and row counts: each equals its own dequantisation."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 1024, generator=g), torch.randn(33, 1024, generator=g) * 1e3
    xd, xs = formats.to_mx(x, "mxfp8_e5m2")
    wd, ws = formats.to_mx(w, "mxfp4_e2m1")
    xh, wh = dequantize(xd, xs, "mxfp8_e5m2", wd, ws, "mxfp4_e2m1")
    assert _same(xh, formats.from_mx(xd, xs, "mxfp8_e5m2")) and _same(wh, formats.from_mx(wd, ws, "mxfp4_e2m1"))
    with pytest.raises(ValueError, match="same K"):
        dequantize(xd, xs, "mxfp8_e5m2", wd[:, :256], ws[:, :16], "mxfp4_e2m1")
    with pytest.raises(ValueError, match="does not match scales"):  # before any launch: no out-of-bounds read
        dequantize(xd[:, :512], xs, "mxfp8_e5m2")


def test_dequantize_skips_groups_without_rows():
    """With a grouped GEMM's end offsets, the weight rows of groups that get no rows (clamped as the GEMM clamps:
    negative, repeated, past the rows, decreasing) are neither read nor written: they keep the poison (NaN); every
    other group's rows, and the activations, equal their dequantisation."""
    g = torch.Generator().manual_seed(0)
    m, e, n = 20, 6, 24  # 24 rows per group: groups straddle the kernel's 16-row tiles
    xd, xs = formats.to_mx(torch.randn(m, 512, generator=g), "mxfp8_e4m3")
    wd, ws = formats.to_mx(torch.randn(e * n, 512, generator=g), "mxfp4_e2m1")
    offs = torch.tensor([-3, 4, 4, 30, 7, 20], dtype=torch.int32)  # sizes after clamping to [0, 20]: 0 4 0 16 0 13
    xh, wh = dequantize(xd, xs, "mxfp8_e4m3", wd, ws, "mxfp4_e2m1", offs=offs)
    assert _same(xh, formats.from_mx(xd, xs, "mxfp8_e4m3"))
    want = formats.from_mx(wd, ws, "mxfp4_e2m1").view(e, n, -1)
    got = wh.view(e, n, -1)
    for grp, live in enumerate((False, True, False, True, False, True)):
        assert _same(got[grp], want[grp]) if live else got[grp].isnan().all(), grp
    with pytest.raises(ValueError, match="multiple of the groups"):
        dequantize(xd, xs, "mxfp8_e4m3", wd[:25], ws[:25], "mxfp4_e2m1", offs=offs)
    with pytest.raises(ValueError, match="needs two operands"):
        dequantize(wd, ws, "mxfp4_e2m1", offs=offs)


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp4_e2m1"])
def test_dequantize_in_fragment_order(fmt):
    """``fragment_order``: the first operand's columns stored in ``fragment_k``'s order within each 128 (what the
    swapped grouped tiles read with contiguous loads), rows off the program tile; the second operand in natural order.
    K off a multiple of 128 is refused before any launch."""
    g = torch.Generator().manual_seed(1)
    xd, xs = formats.to_mx(torch.randn(19, 640, generator=g), fmt)  # 640: one program tile and a partial one
    wd, ws = formats.to_mx(torch.randn(7, 640, generator=g), fmt)
    nat = torch.arange(128)
    nat = 32 * ((nat // 2) % 4) + 4 * (nat // 16) + 2 * ((nat // 8) % 2) + nat % 2  # fragment_k's map, by hand
    want = formats.from_mx(xd, xs, fmt).view(19, 5, 128)[:, :, nat].reshape(19, 640)
    assert _same(dequantize(xd, xs, fmt, fragment_order=True), want)
    xh, wh = dequantize(xd, xs, fmt, wd, ws, fmt, fragment_order=True)
    assert _same(xh, want) and _same(wh, formats.from_mx(wd, ws, fmt))
    with pytest.raises(ValueError, match="K % 128"):
        dequantize(xd[:, : 96 // (2 if fmt == "mxfp4_e2m1" else 1)], xs[:, :3], fmt, fragment_order=True)
