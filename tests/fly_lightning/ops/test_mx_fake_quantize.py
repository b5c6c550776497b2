"""``mx_fake_quantize``: validation before any kernel, the reference (cast then ``from_mx``, either axis), the
straight-through gradient eagerly and under ``torch.compile``, and the MoE experts' MX numerics calling it."""

import pytest
import torch

import fly_lightning
from fly_lightning.ops.mx_fake_quantize import mx_fake_quantize_op, mx_fake_quantize_reference
from fly_lightning.quant import formats


@pytest.mark.parametrize(
    "args, match",  # the cast's validation (``validate_cast``, tested in full with ``mx_cast``)
    [
        ((torch.randn(4, 33),), "^mx_fake_quantize: dim -1 of .* multiple of 32"),  # named as itself, not mx_cast
        ((torch.randn(2, 4, 32), "mxfp8_e4m3", "floor", 0), "^mx_fake_quantize: axis must be"),
        ((torch.randn(4, 32), "mxfp8_e4m3", "even"), "^mx_fake_quantize: unsupported MX scale mode"),
        ((torch.randn(4, 32), "mxfp6"), "^mx_fake_quantize: unknown MX format"),
    ],
)
def test_invalid_arguments_raise_before_any_kernel(args, match):
    with pytest.raises(ValueError, match=match):
        fly_lightning.mx_fake_quantize(*args)
    assert fly_lightning.DISPATCH_LOG.records("mx_fake_quantize") == []


@pytest.mark.parametrize("fmt", sorted(formats.FORMATS))
def test_reference_is_the_cast_and_back_along_either_axis(fmt):
    x = torch.randn(64, 96)
    rows = mx_fake_quantize_reference(x, fmt, "floor", -1)
    assert torch.equal(rows, formats.from_mx(*formats.to_mx(x, fmt), fmt))
    cols = mx_fake_quantize_reference(x, fmt, "rceil", 0)
    assert torch.equal(cols, formats.from_mx(*formats.to_mx(x.t().contiguous(), fmt, "rceil"), fmt).t())
    assert cols.is_contiguous() and not torch.equal(cols, x)


def test_gradient_passes_straight_through():
    x = torch.randn(8, 64, requires_grad=True)
    g = torch.randn(8, 64)
    y = fly_lightning.mx_fake_quantize(x, "mxfp4_e2m1")
    y.backward(g)
    assert torch.equal(x.grad, g)
    assert torch.equal(y.detach(), mx_fake_quantize_reference(x.detach(), "mxfp4_e2m1", "floor", -1))


def test_under_torch_compile_with_its_gradient():
    x = torch.randn(64, 32, requires_grad=True)
    fn = torch.compile(lambda t: (fly_lightning.mx_fake_quantize(t, "mxfp8_e4m3", "rceil", 0) * 3).sum())
    fn(x).backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))


def test_fake_gives_the_real_shape_and_dtype():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(3, 64, 96, dtype=torch.bfloat16)
    with FakeTensorMode() as mode:
        fake = mx_fake_quantize_op(mode.from_tensor(x), "mxfp8_e5m2", "floor", -1)
    assert (fake.shape, fake.dtype) == (x.shape, x.dtype)


@pytest.mark.parametrize("k_major", [False, True])
def test_moe_experts_fake_quantise_weights_of_either_layout_without_a_copy(k_major):
    from fly_lightning.modules.moe import MXExperts

    mx = MXExperts("mxfp8_e4m3", "mxfp8_e4m3", "rceil")
    w_ENK = torch.randn(4, 48, 64)  # E, N, K
    w_EKN = w_ENK.transpose(1, 2).contiguous() if k_major else w_ENK.transpose(1, 2)
    got = mx.weight(w_EKN)
    assert got.shape == w_EKN.shape
    want = mx_fake_quantize_reference(w_ENK.reshape(-1, 64), "mxfp8_e4m3", "rceil", -1).reshape(4, 48, 64)
    assert torch.equal(got, want.transpose(1, 2))
    (rec,) = fly_lightning.DISPATCH_LOG.records("mx_fake_quantize")
    assert rec["shape"] == ("256x48" if k_major else "192x64")  # [E * K, N] column-wise, or [E * N, K] rows


def test_moe_experts_refuse_an_input_dim_off_the_blocks():
    from fly_lightning.modules.moe import MXExperts

    with pytest.raises(ValueError, match="K=48 .* not a multiple of 32"):
        MXExperts("mxfp8_e4m3", None, "floor").weight(torch.randn(2, 48, 64))  # E * K = 96: blocks would straddle
