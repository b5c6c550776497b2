"""MX formats: bit-exact with torchao's ``to_mx`` for every format and scale mode, on the blocks where formats go
wrong (random, zero, subnormal, huge, infinite, NaN, saturating, ties); round trips; argument errors."""

from __future__ import annotations

import logging

import pytest
import torch

from fly_lightning.quant import formats as mx

logging.getLogger("torchao").setLevel(logging.ERROR)  # its CUDA extensions fail to load on CPU machines
torchao_mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402

FORMATS = [mx.MXFP8_E4M3, mx.MXFP8_E5M2, mx.MXFP4_E2M1]
MODES = [mx.ScaleMode.FLOOR, mx.ScaleMode.RCEIL]


def _blocks(dtype: torch.dtype) -> torch.Tensor:
    """Rows of 32-value blocks, each a case that breaks a naive cast."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    tiny = torch.finfo(torch.float32).tiny
    rows = [
        r(32),  # random
        r(32) * 1e4,
        r(32) * 1e-4,
        torch.zeros(32),  # all zero
        torch.full((32,), -0.0),
        r(32) * tiny * 1e-3,  # fp32 subnormals only
        torch.cat([r(31) * 1e-3, torch.tensor([tiny / 4])]),
        r(32) * 3e38,  # huge, near fp32's max
        torch.cat([r(31), torch.tensor([float("inf")])]),  # inf
        torch.cat([r(31), torch.tensor([float("-inf")])]),
        torch.cat([r(31), torch.tensor([float("nan")])]),  # NaN
        torch.full((32,), float("nan")),
        torch.cat([r(31), torch.tensor([448.0 * 1.9])]),  # the largest value past the element range (floor)
        torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4),  # e2m1 ties at scale 1
        torch.tensor([2.0**k for k in range(-16, 16)]),  # powers of two (exact log2)
        torch.tensor([2.0**k * 1.0000001 for k in range(-16, 16)]),
        torch.linspace(-7, 7, 32),
    ]
    x = torch.stack(rows)
    return torch.cat([x, r(8, 96).reshape(-1, 32)]).to(dtype)


def _torchao(x: torch.Tensor, fmt: mx.MXFormat, mode: mx.ScaleMode) -> tuple[torch.Tensor, torch.Tensor]:
    scale, data = torchao_mx.to_mx(x, fmt.torch_dtype, 32, ScaleCalculationMode(mode.value))
    return data.view(torch.uint8), scale.view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_bit_exact_with_torchao(fmt, mode, dtype):
    x = _blocks(dtype)
    data, scale = mx.to_mx(x, fmt, mode)
    want_data, want_scale = _torchao(x, fmt, mode)
    assert torch.equal(scale.view(torch.uint8), want_scale)
    # a NaN scale's block decodes to NaN whatever its elements hold (unspecified): compare the others
    valid = (want_scale != mx.E8M0_NAN).repeat_interleave(32 // fmt.per_byte, dim=-1)
    got = data.view(torch.uint8)
    assert got.shape == want_data.shape
    assert torch.equal(got[valid], want_data[valid])
    assert (~valid).any() and valid.any()  # the cases include both


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_shapes_dtypes_and_leading_dims(fmt, mode):
    x = torch.randn(2, 3, 64)
    data, scale = mx.to_mx(x, fmt.name, mode.value)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (2, 3, 2)
    assert data.shape == ((2, 3, 64) if fmt.bits == 8 else (2, 3, 32))
    assert data.dtype == (fmt.torch_dtype if fmt.bits == 8 else torch.uint8)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_round_trip_error_is_the_element_formats(fmt, mode):
    x = torch.randn(64, 256)
    back = mx.from_mx(*mx.to_mx(x, fmt, mode), fmt)
    rel = ((back - x).norm() / x.norm()).item()
    # 3 / 2 / 1 mantissa bits: relative rounding error about 2^-4, 2^-3, and fp4's coarse grid
    assert rel < {"mxfp8_e4m3": 0.04, "mxfp8_e5m2": 0.08, "mxfp4_e2m1": 0.2}[fmt.name], rel
    assert rel > 0  # it did quantise


def test_special_values_decode_as_documented():
    x = torch.zeros(3, 32)
    x[0, 5] = float("nan")
    x[1, 0] = float("inf")
    x[1, 1] = 1.0
    x[2] = torch.linspace(-1, 1, 32)
    for fmt in FORMATS:
        for mode in MODES:
            back = mx.from_mx(*mx.to_mx(x, fmt, mode), fmt)
            assert back[0].isnan().all()  # a NaN poisons its block
            # inf saturates to the largest element at a scale whose product with it passes fp32's range: inf again;
            # the block's finite values are tiny next to that scale
            assert back[1, 0] == float("inf") and torch.isfinite(back[1, 1:]).all()
            assert torch.isfinite(back[2]).all()
    zeros = mx.from_mx(*mx.to_mx(torch.zeros(2, 64), "mxfp4_e2m1"), "mxfp4_e2m1")
    assert torch.equal(zeros, torch.zeros(2, 64))


def test_fp4_packs_element_2j_in_the_low_nibble():
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = 0.5, 6.0  # codes 1 and 7 at scale 1 (amax 6: floor gives 2^(2-2))
    data, scale = mx.to_mx(x, mx.MXFP4_E2M1, "floor")
    assert scale.view(torch.uint8).item() == 127
    assert data[0, 0].item() == 0x71


def test_torchao_scale_mode_enum_is_accepted():
    data, _ = mx.to_mx(torch.randn(1, 32), "mxfp8_e4m3", ScaleCalculationMode.RCEIL)
    assert data.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.randn(2, 33), "mxfp8_e4m3"), "multiple of 32"),
        ((torch.randn(2, 32).half(), "mxfp8_e4m3"), "float32 or bfloat16"),
        ((torch.randn(2, 32), "mxfp6"), "unknown MX format"),
        ((torch.randn(2, 32), "mxfp8_e4m3", "even"), "unsupported MX scale mode"),
        (([1.0] * 32, "mxfp8_e4m3"), "must be a Tensor"),
    ],
)
def test_invalid_arguments_are_named(args, match):
    with pytest.raises(ValueError, match=match):
        mx.to_mx(*args)
