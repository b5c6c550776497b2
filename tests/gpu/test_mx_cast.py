"""The Triton MX cast on the GPU (compiled: bf16 widened and fp8 rounded by conversion instructions, which the
interpreter cannot show), bit-exact with torchao's ``to_mx`` and the reference on the blocks where casts go wrong,
in three launch plans, with the integer-rounding form compiled too."""

from __future__ import annotations

import pytest
import torch

from fly_lightning.kernels.triton import mx_cast as kernel
from fly_lightning.ops.mx_cast import mx_cast_reference
from fly_lightning.quant import formats

pytestmark = pytest.mark.gpu


def _blocks(dtype: torch.dtype, rows: int = 300, k: int = 640) -> torch.Tensor:
    """Rows of 32-value blocks, each random at its own magnitude, with zero, subnormal, huge, inf, NaN, saturating
    and rounding-tie blocks mixed in."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, k, device="cuda", generator=g)
    mag = torch.exp2(torch.randint(-140, 120, (rows, k // 32, 1), device="cuda", generator=g).float())
    x = (x.view(rows, k // 32, 32) * mag).view(rows, k)
    tiny = torch.finfo(torch.float32).tiny
    x[::7, :32] = 0.0
    x[1::7, 32:64] *= tiny
    x[2::7, 64:72] = torch.tensor([float("inf"), float("-inf"), 3e38, -0.0, 448.0 * 1.9, 57344.0 * 1.1, 5.0, tiny / 8])
    x[3::7, 96:128] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4, device="cuda")
    x[4::7, 128:160] = torch.tensor([1 + 2**-4, 1 + 3 * 2**-4, 1 + 2**-3, 1 + 2**-5] * 8, device="cuda")
    x[5, 200] = float("nan")
    return x.to(dtype)


def _assert_same(x, data, scale, want_data, want_scale, mode="floor"):
    """Scales equal; data bytes equal but those holding a NaN or inf input in a NaN-scale block (floor: finite values
    there are +-0, as torchao's division by an infinite scale gives; NaN and inf codes are unspecified), and with
    rceil none of a NaN block's (torchao's codes there are NaN)."""
    assert torch.equal(scale.view(torch.uint8), want_scale.view(torch.uint8))
    per_block = x.shape[-1] // scale.shape[-1]
    in_nan_block = (want_scale.view(torch.uint8) == formats.E8M0_NAN).repeat_interleave(per_block, dim=-1)
    ok = ~in_nan_block | (x.isfinite() if mode == "floor" else False)
    valid = ok.reshape(*ok.shape[:-1], data.shape[-1], -1).all(-1)
    assert torch.equal(data.view(torch.uint8)[valid], want_data.view(torch.uint8)[valid])


@pytest.mark.parametrize("plan", [kernel.PLAN, (64, 8, 8), (8, 16, 4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", sorted(formats.FORMATS))
def test_bit_exact_with_torchao(fmt, dtype, plan):
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    x = _blocks(dtype)
    data, scale = kernel.launch(x, fmt, plan)
    want_scale, want_data = to_mx(x, formats.FORMATS[fmt].torch_dtype, 32, ScaleCalculationMode.FLOOR)
    _assert_same(x, data, scale, want_data, want_scale)
    _assert_same(x, data, scale, *mx_cast_reference(x, fmt, "floor", -1))


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp4_e2m1"])
def test_both_roundings_agree(fmt, monkeypatch):
    """The conversion instructions (the GPU default; fp4: PTX f16x2 conversion and min) and the integer rounding or
    per-element conversions the interpreter runs, both compiled."""
    x = _blocks(torch.bfloat16)
    hw = kernel.launch(x, fmt)
    monkeypatch.setattr(kernel, "HW_CVT", False)
    bits = kernel.launch(x, fmt)
    assert torch.equal(hw[1].view(torch.uint8), bits[1].view(torch.uint8))
    _assert_same(x, hw[0], hw[1], *bits)


def test_fp4_pairs_on_every_bf16_value(monkeypatch):
    """Every bf16 value, alone in its block and under larger ones, cast to MXFP4 by the pair kernel in its PTX form
    and in its portable form: the same bits as torchao's ``to_mx``."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(-1, 32)
    blocks = [bits]
    for top in (1.0, 6.0, 7.9, 3e38, 1e-38, 2.0**-130, 448.0):
        y = bits.clone()
        y[:, 0] = top
        blocks.append(y)
    x = torch.cat(blocks).reshape(-1, 256).cuda()
    want_scale, want_data = to_mx(x, formats.FORMATS["mxfp4_e2m1"].torch_dtype, 32, ScaleCalculationMode.FLOOR)
    assert kernel._as_pairs(x) is not None and kernel.ptx_pairs(x)  # the pair kernel, in its PTX form first
    _assert_same(x, *kernel.launch(x, "mxfp4_e2m1"), want_data, want_scale)
    monkeypatch.setattr(kernel, "HW_CVT", False)
    _assert_same(x, *kernel.launch(x, "mxfp4_e2m1"), want_data, want_scale)


@pytest.mark.parametrize("portable", [False, True], ids=["hw", "portable"])
@pytest.mark.parametrize("fmt", sorted(formats.FORMATS))
def test_rceil_from_bf16_bit_exact_with_torchao(fmt, portable, monkeypatch):
    """rceil scales from bf16 (exponent and mantissa bits, no log2) on the special blocks and on every bf16 value as
    a block's largest: torchao's ``to_mx`` with ``RCEIL`` (fp32 quotient, ``ceil(log2)``) on the GPU."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    if portable:
        monkeypatch.setattr(kernel, "HW_CVT", False)
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(-1, 32)
    for x in (_blocks(torch.bfloat16), every.cuda()):
        want_scale, want_data = to_mx(x, formats.FORMATS[fmt].torch_dtype, 32, ScaleCalculationMode.RCEIL)
        _assert_same(x, *kernel.launch(x, fmt, mode="rceil"), want_data, want_scale, "rceil")
        _assert_same(x, *kernel.launch(x, fmt, mode="rceil"), *mx_cast_reference(x, fmt, "rceil", -1), "rceil")


MODES = [("floor", torch.bfloat16), ("floor", torch.float32), ("rceil", torch.bfloat16)]


# bf16 -> MXFP4 column-wise: each kernel, the word kernel also with two blocks per program and with 32-bit block
# maxima (its form before sm90)
FP4_KERNELS = [("pairs", None), ("words", None), ("words", (64, 2, 1)), ("words-max32", None)]
COLS_VARIANTS = [(f, m, d, None, None) for f in sorted(formats.FORMATS) for m, d in MODES] + [
    ("mxfp4_e2m1", m, torch.bfloat16, fp4, plan) for m in ("floor", "rceil") for fp4, plan in FP4_KERNELS
]


@pytest.mark.parametrize("fmt, mode, dtype, fp4, plan", COLS_VARIANTS)
def test_column_wise_bit_exact_with_torchao(fmt, mode, dtype, fp4, plan, monkeypatch):
    """Blocks down the columns of ``[K, N]``: torchao's ``to_mx`` of the transpose, transposed back; bf16 -> MXFP4
    by each of its kernels (``fp4``: the pair and two-column word kernels; ``plan``: a launch plan other than the
    default, two blocks per program)."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    if fp4 == "words-max32":
        monkeypatch.setattr(kernel, "ptx_u16x2", lambda t: False)
        fp4 = "words"

    xs = [_blocks(dtype).t().contiguous()]  # [640, 300]: the special blocks run down the columns
    if dtype == torch.bfloat16:  # every bf16 value, a block per column (bf16 -> fp4 pairs rows of a column)
        every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
        xs.append(every.reshape(-1, 32).t().contiguous().cuda())
    for x in xs:
        data, scale = kernel.launch_cols(x, fmt, mode, plan, fp4_words=None if fp4 is None else fp4 == "words")
        want_scale, want_data = to_mx(
            x.t().contiguous(), formats.FORMATS[fmt].torch_dtype, 32, ScaleCalculationMode(mode)
        )
        _assert_same(x.t(), data.t(), scale.t(), want_data, want_scale, mode)
        ref_data, ref_scale = mx_cast_reference(x, fmt, mode, 0)
        _assert_same(x.t(), data.t(), scale.t(), ref_data.t(), ref_scale.t(), mode)
