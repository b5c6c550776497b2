"""The Triton MX fake quantisation on the GPU (compiled: fp8 and bf16 by conversion instructions): the reference's
values (cast then ``from_mx``, torchao's arithmetic) on every bf16 value, row-wise and column-wise, in both forms
(instructions, and the integer arithmetic the interpreter runs), served by the dispatcher."""

from __future__ import annotations

import pytest
import torch

import fly_lightning
from fly_lightning.kernels.triton import mx_fake_quantize as kernel
from fly_lightning.ops.mx_fake_quantize import mx_fake_quantize_reference
from fly_lightning.quant import formats

pytestmark = pytest.mark.gpu


def _every_bf16() -> torch.Tensor:
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(-1, 32)
    blocks = [x]
    for top in (1.0, 6.0, 3e38, 1e-38, 2.0**-130, 448.0):
        y = x.clone()
        y[:, 0] = top
        blocks.append(y)
    return torch.cat(blocks).reshape(-1, 256).cuda()


@pytest.mark.parametrize("portable", [False, True], ids=["hw", "portable"])
@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("mode", ["floor", "rceil"])
@pytest.mark.parametrize("fmt", sorted(formats.FORMATS))
def test_every_bf16_value(fmt, mode, axis, portable, monkeypatch):
    if portable:
        monkeypatch.setattr(kernel, "HW_CVT", False)
    x = _every_bf16()
    x = x if axis == -1 else x.t().contiguous()
    y = fly_lightning.mx_fake_quantize(x, fmt, mode, axis)
    assert fly_lightning.DISPATCH_LOG.records("mx_fake_quantize")[-1]["backend"] == "triton"
    want = mx_fake_quantize_reference(x, fmt, mode, axis)
    assert torch.equal(y.isnan(), want.isnan())
    assert torch.equal(y[~want.isnan()], want[~want.isnan()])


def test_fp32_input():
    x = torch.randn(320, 640, device="cuda") * torch.exp2(torch.randint(-60, 60, (320, 1), device="cuda").float())
    for fmt in sorted(formats.FORMATS):
        for axis in (-1, 0):
            y = fly_lightning.mx_fake_quantize(x, fmt, "floor", axis)
            assert torch.equal(y, mx_fake_quantize_reference(x, fmt, "floor", axis))
