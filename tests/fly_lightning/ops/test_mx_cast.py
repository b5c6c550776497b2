"""``mx_cast``: validation before any kernel, the reference along either axis, the fake for tracing."""

import pytest
import torch

import fly_lightning
from fly_lightning.ops.mx_cast import mx_cast_op, mx_cast_reference
from fly_lightning.quant import formats


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.randn(4, 33),), "multiple of 32"),
        ((torch.randn(4, 32, dtype=torch.float16),), "float32 or bfloat16"),
        ((torch.randn(4, 32), "mxfp6"), "unknown MX format"),
        ((torch.randn(4, 32), "mxfp8_e4m3", "even"), "^mx_cast: unsupported MX scale mode 'even'"),
        ((torch.randn(4, 32), "mxfp8_e4m3", None), "^mx_cast: unsupported MX scale mode None"),
        ((torch.randn(2, 4, 32), "mxfp8_e4m3", "floor", 0), "axis must be"),
        ((torch.randn(4, 32), "mxfp8_e4m3", "floor", "0"), "got axis='0'"),  # a string is named as one
        ((torch.randn(4, 32), "mxfp8_e4m3", "floor", 1), "axis must be"),
        (("x",), "must be a Tensor"),
    ],
)
def test_invalid_arguments_raise_before_any_kernel(args, match):
    with pytest.raises(ValueError, match=match):
        fly_lightning.mx_cast(*args)
    assert fly_lightning.DISPATCH_LOG.records("mx_cast") == []


@pytest.mark.parametrize("fmt", sorted(formats.FORMATS))
def test_column_wise_is_the_row_wise_cast_of_the_transpose(fmt):
    w = torch.randn(96, 40)
    data, scale = mx_cast_reference(w, fmt, "floor", 0)
    data_t, scale_t = formats.to_mx(w.t().contiguous(), fmt, "floor")
    assert torch.equal(data.view(torch.uint8), data_t.t().view(torch.uint8))
    assert torch.equal(scale.view(torch.uint8), scale_t.t().view(torch.uint8))
    assert data.shape == ((96, 40) if formats.FORMATS[fmt].bits == 8 else (48, 40)) and scale.shape == (3, 40)


def test_public_call_matches_the_reference_and_takes_torchao_modes():
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    x = torch.randn(8, 64, requires_grad=True)
    data, scale = fly_lightning.mx_cast(x, "mxfp8_e4m3", ScaleCalculationMode.FLOOR)
    want = mx_cast_reference(x.detach(), "mxfp8_e4m3", "floor", -1)
    assert torch.equal(data.view(torch.uint8), want[0].view(torch.uint8)) and not data.requires_grad
    assert torch.equal(scale.view(torch.uint8), want[1].view(torch.uint8))


@pytest.mark.parametrize("fmt, axis", [("mxfp4_e2m1", -1), ("mxfp4_e2m1", 0), ("mxfp8_e5m2", 0)])
def test_fake_gives_the_real_shapes_and_dtypes(fmt, axis):
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(64, 96)
    real = fly_lightning.mx_cast(x, fmt, "floor", axis)
    with FakeTensorMode() as mode:
        fake = mx_cast_op(mode.from_tensor(x), fmt, "floor", axis)
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]
