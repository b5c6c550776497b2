"""The shared MX operand checks (``formats.data_dtype``, ``formats.check_operand``) that ``mx_scaled_mm`` and
``mx_grouped_mm`` validate with: accepted layouts give K, each malformed operand a ValueError naming the op."""

from __future__ import annotations

import pytest
import torch

from fly_lightning.quant import formats as mx

E8M0 = torch.float8_e8m0fnu


def _operand(fmt: str, lead: tuple[int, ...], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return mx.to_mx(torch.randn(*lead, k), fmt)


@pytest.mark.parametrize(
    "fmt, want",
    [("mxfp8_e4m3", torch.float8_e4m3fn), ("mxfp8_e5m2", torch.float8_e5m2), ("mxfp4_e2m1", torch.uint8)],
)
def test_data_dtype_is_what_to_mx_returns(fmt, want):
    assert mx.data_dtype(fmt) == want and mx.data_dtype(mx.FORMATS[fmt]) == want
    assert _operand(fmt, (2,), 64)[0].dtype == want


def test_data_dtype_rejects_an_unknown_format():
    with pytest.raises(ValueError, match="unknown MX format"):
        mx.data_dtype("mxfp6")


@pytest.mark.parametrize("fmt", sorted(mx.FORMATS))
@pytest.mark.parametrize("lead", [(5,), (3, 5)])
def test_valid_operands_give_k(fmt, lead):
    data, scale = _operand(fmt, lead, 96)
    assert mx.check_operand("op", "w", data, scale, fmt, len(lead) + 1) == 96


def _fp8(lead=(4,), k=64):
    return _operand("mxfp8_e4m3", lead, k)


@pytest.mark.parametrize(
    "make, dims, match",
    [
        (lambda: ([0] * 64, _fp8()[1]), 2, r"my_op: w must be a 2-D torch.float8_e4m3fn tensor .*got list of \? dims"),
        (lambda: (_fp8()[0].view(torch.uint8), _fp8()[1]), 2, "my_op: w must be a 2-D torch.float8_e4m3fn"),
        (lambda: _fp8(), 3, r"my_op: w must be a 3-D torch.float8_e4m3fn tensor for mxfp8_e4m3, got .* of 2 dims"),
        (lambda: (_fp8()[0], _fp8()[1].view(torch.uint8)), 2, "my_op: w_scale must be a 2-D float8_e8m0fnu"),
        (lambda: (_fp8()[0], _fp8()[1][0]), 2, "my_op: w_scale must be a 2-D float8_e8m0fnu"),
        (lambda: (_fp8()[0], _fp8()[1][:, :1]), 2, r"my_op: w \[4, 64\] .*needs K % 32 == 0 and scales \[4, 2\]"),
        (lambda: (_fp8()[0][:, :48], torch.ones(4, 1).to(E8M0)), 2, r"K % 32 == 0 .* got K=48"),
        (lambda: (_fp8()[0], _fp8()[1].to("meta")), 2, "my_op: w and its scales are on cpu and meta"),
    ],
)
def test_malformed_operands_raise_naming_the_op(make, dims, match):
    data, scale = make()
    with pytest.raises(ValueError, match=match):
        mx.check_operand("my_op", "w", data, scale, "mxfp8_e4m3", dims)


def test_fp4_k_counts_two_elements_per_byte():
    data, scale = _operand("mxfp4_e2m1", (4,), 64)
    assert data.shape == (4, 32)
    with pytest.raises(ValueError, match=r"scales \[4, 2\], got K=64 and scales \[4, 1\]"):
        mx.check_operand("my_op", "x", data, scale[:, :1], "mxfp4_e2m1", 2)
