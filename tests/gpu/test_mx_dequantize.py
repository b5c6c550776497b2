"""The Triton MX dequantisation on the GPU (compiled: fp8 by conversion instructions, fp4 pairs by PTX, bf16
rounding of the products): the reference's values on every code under every scale, served by the dispatcher, and
a frozen MX layer's step running it."""

from __future__ import annotations

import pytest
import torch

import fly_lightning
from fly_lightning.ops.mx_dequantize import mx_dequantize_reference
from fly_lightning.quant import formats

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("fmt", sorted(formats.FORMATS))
def test_every_code_and_scale_through_the_dispatcher(fmt):
    c = 1088 // formats.as_format(fmt).per_byte  # row r: every byte under scale r, for all 256 scales
    data = (torch.arange(c, device="cuda", dtype=torch.int32) % 256).to(torch.uint8).repeat(256, 1)
    scale = torch.arange(256, device="cuda", dtype=torch.int32).to(torch.uint8)[:, None].repeat(1, 1088 // 32)
    y = fly_lightning.mx_dequantize(data, scale, fmt, torch.bfloat16)
    assert fly_lightning.DISPATCH_LOG.records("mx_dequantize")[-1]["backend"] == "triton"
    want = mx_dequantize_reference(data, scale, fmt, torch.bfloat16)
    assert torch.equal(y.isnan(), want.isnan())
    assert torch.equal(y[~want.isnan()], want[~want.isnan()])


def test_frozen_mx_linear_step_dequantises_on_triton():
    from torchao.quantization import quantize_

    model = torch.nn.Sequential(torch.nn.Linear(256, 512, dtype=torch.bfloat16, device="cuda"))
    quantize_(model, fly_lightning.FlyMXConfig("mxfp4_e2m1", None, frozen=True))
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    model(x).float().sum().backward()
    recs = fly_lightning.DISPATCH_LOG.records("mx_dequantize")
    assert recs and all(r["backend"] == "triton" for r in recs)
