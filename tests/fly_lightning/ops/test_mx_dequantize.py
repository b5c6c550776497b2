"""``mx_dequantize``: validation before any kernel, the reference (``from_mx``), the fake for tracing, and its users
(frozen MX weights) calling it."""

import pytest
import torch

import fly_lightning
from fly_lightning.ops.mx_dequantize import mx_dequantize_op, mx_dequantize_reference
from fly_lightning.quant import formats


def _mx(fmt: str, shape=(4, 64)) -> tuple[torch.Tensor, torch.Tensor]:
    return formats.to_mx(torch.randn(*shape), fmt)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda d, s: (d[:, :-1], s, "mxfp8_e4m3", torch.bfloat16), "does not match scales"),
        (lambda d, s: (d, s[:, :1], "mxfp8_e4m3", torch.bfloat16), "does not match scales"),
        (lambda d, s: (d.float(), s, "mxfp8_e4m3", torch.bfloat16), "data must be"),
        # 1-byte tensors of another meaning: read as these formats they would decode to wrong values
        (lambda d, s: (d, s, "mxfp8_e5m2", torch.bfloat16), "mxfp8_e5m2 data must be torch.float8_e5m2 or torch.uint8"),
        (lambda d, s: (d.view(torch.bool), s, "mxfp8_e4m3", torch.bfloat16), "data must be"),
        (lambda d, s: (d, s.view(torch.float8_e4m3fn), "mxfp8_e4m3", torch.bfloat16), "scales must be float8_e8m0fnu"),
        (lambda d, s: (d, s, formats.MXFP8_E4M3, torch.bfloat16), "fmt must be a format name"),
        (lambda d, s: (d, s, ["mxfp8_e4m3"], torch.bfloat16), "fmt must be a format name"),
        (lambda d, s: (d, s, "mxfp6", torch.bfloat16), "unknown MX format"),
        (lambda d, s: (d, s, "mxfp4_e2m1", torch.bfloat16), "mxfp4_e2m1 data must be torch.uint8, got"),
        (lambda d, s: (d.view(torch.uint8), s, "mxfp4_e2m1", torch.bfloat16), "does not match scales"),  # as fp4
        (lambda d, s: (d, s, "mxfp8_e4m3", torch.int32), "dtype must be one of"),
        (lambda d, s: (d, "s", "mxfp8_e4m3", torch.bfloat16), "must be Tensors"),
    ],
)
def test_invalid_arguments_raise_before_any_kernel(build, match):
    with pytest.raises(ValueError, match=match):
        fly_lightning.mx_dequantize(*build(*_mx("mxfp8_e4m3")))
    assert fly_lightning.DISPATCH_LOG.records("mx_dequantize") == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", sorted(formats.FORMATS))
def test_public_call_is_from_mx(fmt, dtype):
    data, scale = _mx(fmt, (3, 5, 96))  # leading dims
    y = fly_lightning.mx_dequantize(data, scale, fmt, dtype)
    assert y.dtype == dtype and y.shape == (3, 5, 96)
    assert torch.equal(y, formats.from_mx(data, scale, fmt, dtype))
    # uint8 bytes as the frozen buffers hold them: the same values
    same = fly_lightning.mx_dequantize(data.view(torch.uint8), scale.view(torch.uint8), fmt, dtype)
    assert torch.equal(same, y)


@pytest.mark.parametrize("fmt", ["mxfp4_e2m1", "mxfp8_e5m2"])
def test_fake_gives_the_real_shape_and_dtype(fmt):
    from torch._subclasses.fake_tensor import FakeTensorMode

    data, scale = _mx(fmt, (64, 96))
    real = mx_dequantize_reference(data, scale, fmt, torch.bfloat16)
    with FakeTensorMode() as mode:
        fake = mx_dequantize_op(mode.from_tensor(data), mode.from_tensor(scale), fmt, torch.bfloat16)
    assert (fake.shape, fake.dtype) == (real.shape, real.dtype)


def test_under_torch_compile():
    data, scale = _mx("mxfp8_e4m3")
    fn = torch.compile(lambda d, s: fly_lightning.mx_dequantize(d, s, "mxfp8_e4m3", torch.float32) * 2, fullgraph=True)
    assert torch.equal(fn(data, scale), 2 * formats.from_mx(data, scale, "mxfp8_e4m3"))


def test_frozen_weights_dequantise_through_it():
    from torchao.quantization import quantize_

    x = torch.randn(4, 64)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    quantize_(model, fly_lightning.FlyMXConfig("mxfp4_e2m1", None, frozen=True))
    x.requires_grad_()
    y = model(x)  # weight-only forward: mx_scaled_mm on the MX bytes
    assert fly_lightning.DISPATCH_LOG.records("mx_dequantize") == []
    y.sum().backward()  # the activation gradient through the dequantised weight
    assert sum(r["calls"] for r in fly_lightning.DISPATCH_LOG.records("mx_dequantize")) == 1
    assert torch.equal(
        model[0].dequantized_weight(),
        mx_dequantize_reference(model[0].weight_data, model[0].weight_scale, "mxfp4_e2m1", torch.float32),
    )
