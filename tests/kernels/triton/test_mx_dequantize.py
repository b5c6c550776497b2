"""The Triton MX dequantisation (interpreter): the reference's values on every code under every scale, rows of any
leading shape and row stride, every output element written (outputs are poisoned in tests); what it leaves to ATen
named."""

import pytest
import torch

import fly_lightning
from fly_lightning.kernels.triton.mx_dequantize import _supports, mx_dequantize_triton
from fly_lightning.ops.mx_dequantize import mx_dequantize_reference
from fly_lightning.policy import dispatch_config
from fly_lightning.quant import formats


def _every_code_and_scale(fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Row ``r``: every byte (fp4: every pair of codes) under scale ``r``, for all 256 scales, 0 (2^-127: subnormal
    products), 254 and 255 (NaN) included; 1088 values per row, off the kernel's 512-wide tile."""
    per_byte = formats.as_format(fmt).per_byte
    c = 1088 // per_byte
    data = (torch.arange(c, dtype=torch.int32) % 256).to(torch.uint8).repeat(256, 1)
    scale = torch.arange(256, dtype=torch.int32).to(torch.uint8)[:, None].repeat(1, 1088 // 32)
    return data, scale


@pytest.mark.parametrize("fmt", sorted(formats.FORMATS))
def test_equals_the_reference_on_every_code_and_scale(fmt):
    data, scale = _every_code_and_scale(fmt)
    assert set(data[0].tolist()) == set(range(256))  # every byte in each row, under that row's scale
    y = mx_dequantize_triton(data, scale, fmt, torch.bfloat16)
    want = mx_dequantize_reference(data, scale, fmt, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and torch.equal(y.isnan(), want.isnan())
    assert torch.equal(y[~want.isnan()], want[~want.isnan()])


def test_leading_dims_strided_rows_and_empty():
    data, scale = formats.to_mx(torch.randn(2, 3, 128), "mxfp4_e2m1")
    want = mx_dequantize_reference(data, scale, "mxfp4_e2m1", torch.bfloat16)
    assert torch.equal(mx_dequantize_triton(data, scale, "mxfp4_e2m1", torch.bfloat16), want)
    wide = torch.zeros(6, 100, dtype=torch.uint8)
    wide[:, 20:84] = data.reshape(6, 64)
    rows = wide[:, 20:84]  # rows of a wider buffer
    y = mx_dequantize_triton(rows, scale.reshape(6, 4), "mxfp4_e2m1", torch.bfloat16)
    assert torch.equal(y, want.reshape(6, 128))
    empty = mx_dequantize_triton(data[:0], scale[:0], "mxfp4_e2m1", torch.bfloat16)
    assert empty.shape == (0, 3, 128)


@pytest.mark.parametrize(
    "build, reason",
    [
        (lambda d, s: (d, s, "mxfp8_e4m3", torch.float32), "float32 output"),
        (lambda d, s: (d.t().contiguous().t(), s, "mxfp8_e4m3", torch.bfloat16), "data last dim not contiguous"),
    ],
)
def test_unsupported_inputs_run_on_aten_with_the_reason(build, reason):
    args = build(*formats.to_mx(torch.randn(64, 64), "mxfp8_e4m3"))
    assert reason in _supports(*args)
    with dispatch_config(backends=("triton",)):
        y = fly_lightning.mx_dequantize(*args)
    assert torch.equal(y, mx_dequantize_reference(*args))
    (rec,) = fly_lightning.DISPATCH_LOG.records("mx_dequantize")
    assert rec["backend"] == "aten" and reason in rec["reason"]


def test_dispatch_serves_it():
    data, scale = formats.to_mx(torch.randn(8, 64), "mxfp8_e5m2")
    y = fly_lightning.mx_dequantize(data, scale, "mxfp8_e5m2")
    assert fly_lightning.DISPATCH_LOG.records("mx_dequantize")[-1]["backend"] == "triton"
    assert torch.equal(y, mx_dequantize_reference(data, scale, "mxfp8_e5m2", torch.bfloat16))
