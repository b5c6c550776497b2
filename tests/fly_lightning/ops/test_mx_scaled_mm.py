"""``mx_scaled_mm``: MXFP8 x MXFP8, MXFP4 x MXFP4 and bf16 x MX against the fp32 product of the dequantised operands
(dequantisation bit-exact with torchao's), close to the unquantised product, validation before any kernel, the fake."""

import logging

import pytest
import torch

import fly_lightning
from fly_lightning.ops.mx_scaled_mm import mx_scaled_mm_op, mx_scaled_mm_reference
from fly_lightning.quant import formats

logging.getLogger("torchao").setLevel(logging.ERROR)


@pytest.mark.parametrize("fmt", sorted(formats.FORMATS))
def test_dequantisation_is_torchaos(fmt):
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    w = torch.randn(48, 128)
    theirs = MXTensor.to_mx(w, formats.FORMATS[fmt].torch_dtype, 32, ScaleCalculationMode.FLOOR)
    ours = formats.from_mx(*formats.to_mx(w, fmt, "floor"), fmt)
    assert torch.equal(ours, theirs.dequantize(torch.float32))


PAIRS = [("mxfp8_e4m3", "mxfp8_e4m3"), ("mxfp4_e2m1", "mxfp4_e2m1"), (None, "mxfp8_e4m3"), (None, "mxfp4_e2m1"),
         ("mxfp8_e5m2", "mxfp8_e4m3")]  # fmt: skip


@pytest.mark.parametrize("a_fmt, b_fmt", PAIRS)
def test_product_of_the_dequantised_operands(a_fmt, b_fmt):
    x, w = torch.randn(40, 256), torch.randn(24, 256)
    b, b_scale = fly_lightning.mx_cast(w, b_fmt)
    a, a_scale = (x, None) if a_fmt is None else fly_lightning.mx_cast(x, a_fmt)
    y = fly_lightning.mx_scaled_mm(a, b, b_scale, b_fmt, a_scale=a_scale, a_fmt=a_fmt, out_dtype=torch.float32)
    ref = mx_scaled_mm_reference(a, a_scale, a_fmt, b, b_scale, b_fmt, torch.float32)
    # CPU: the ATen path (fp32, as the reference) or the Triton kernel in the interpreter (exact products, fp32 sums):
    # the reference up to summation order
    assert y.shape == (40, 24) and torch.allclose(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    exact = x @ w.t()
    rel = ((y - exact).norm() / exact.norm()).item()
    # the element formats' rounding: 3 (e4m3), 2 (e5m2) or 1 (e2m1) mantissa bits
    assert 0 < rel < (0.25 if "fp4" in f"{a_fmt}{b_fmt}" else 0.08 if "e5m2" in f"{a_fmt}" else 0.06), rel


def test_out_dtype_and_weight_only_bf16_activations():
    w = torch.randn(16, 64)
    b, s = fly_lightning.mx_cast(w, "mxfp8_e4m3")
    y = fly_lightning.mx_scaled_mm(torch.randn(8, 64, dtype=torch.bfloat16), b, s, "mxfp8_e4m3")
    assert y.dtype == torch.bfloat16 and y.shape == (8, 16)


def _operands(k: int = 64):
    b, s = fly_lightning.mx_cast(torch.randn(16, k), "mxfp8_e4m3")
    return torch.randn(8, k), b, s


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a, b, s: (torch.randn(8, 96), b, s, "mxfp8_e4m3", {}), "K=96"),
        (lambda a, b, s: (a, b, s, "mxfp4_e2m1", {}), "must be a 2-D torch.uint8"),
        (lambda a, b, s: (a, b, s.view(torch.uint8), "mxfp8_e4m3", {}), "float8_e8m0fnu"),
        (lambda a, b, s: (a, b, s[:, :1], "mxfp8_e4m3", {}), "scales"),
        (lambda a, b, s: (a.half(), b, s, "mxfp8_e4m3", {}), "bf16/fp32"),
        (lambda a, b, s: (a, b, s, "mxfp8_e4m3", {"a_fmt": "mxfp8_e4m3"}), "needs a_scale"),
        (lambda a, b, s: (a, b, s, "mxfp8_e4m3", {"out_dtype": torch.int8}), "out_dtype"),
        # a format object, not its name: the kernels key their constants by name
        (lambda a, b, s: (a, b, s, formats.MXFP8_E4M3, {}), "b_fmt must be a format name"),
        (lambda a, b, s: (a, b, s, ["mxfp8_e4m3"], {}), "b_fmt must be a format name"),
    ],
)
def test_invalid_arguments_raise_before_any_kernel(change, match):
    a, b, s, fmt, kw = change(*_operands())
    with pytest.raises(ValueError, match=match):
        fly_lightning.mx_scaled_mm(a, b, s, fmt, **kw)
    assert fly_lightning.DISPATCH_LOG.records("mx_scaled_mm") == []


def test_fake_gives_the_real_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    a, b, s = _operands()
    real = fly_lightning.mx_scaled_mm(a, b, s, "mxfp8_e4m3")
    with FakeTensorMode() as mode:
        fake = mx_scaled_mm_op(mode.from_tensor(a), None, None, mode.from_tensor(b), mode.from_tensor(s), "mxfp8_e4m3",
                               torch.bfloat16)  # fmt: skip
    assert (fake.shape, fake.dtype) == (real.shape, real.dtype)


def test_the_auto_form_rule_follows_the_kernels_boundaries():
    """``emulated_form``'s constants are the kernels' own (a kernel's change of boundary must move ``auto`` too)."""
    import sys

    from fly_lightning.kernels.flydsl import _mx_scaled_mm_kernel as native
    from fly_lightning.kernels.triton import mx_scaled_mm as triton_kernel

    op = sys.modules["fly_lightning.ops.mx_scaled_mm"]
    assert op.NATIVE_K_MULTIPLE == native.BK and op.NATIVE_MAX_GROUPS == native.MAX_GROUPS
    assert op.NATIVE_MAX_BYTES == native.MAX_BYTES + 1  # "under 2 GiB"
    assert op.DEQUANT_K_MULTIPLE == triton_kernel.K_ALIGN
    assert op.DEQUANT_BACKEND == "triton" and op.NATIVE_BACKENDS == ("flydsl",)
    assert not op.dequant_backend("mx_scaled_mm", torch.device("cpu"))
    assert op.native_backend("mx_scaled_mm", torch.device("cpu")) is None


@pytest.mark.parametrize("k", [128, 96])  # K=128: Triton (interpreter) runs it; K=96: ATen does
def test_an_input_requiring_grad_is_refused_whichever_backend(k):
    """Forward only: a gradient would otherwise be dropped (Triton's output) or kept (ATen's) by backend."""
    b, s = fly_lightning.mx_cast(torch.randn(16, k), "mxfp8_e4m3")
    a = torch.randn(8, k, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(ValueError, match="forward only"):
        fly_lightning.mx_scaled_mm(a, b, s, "mxfp8_e4m3")
    assert fly_lightning.DISPATCH_LOG.records("mx_scaled_mm") == []
    with torch.no_grad():
        y = fly_lightning.mx_scaled_mm(a, b, s, "mxfp8_e4m3", out_dtype=torch.float32)
    ref = mx_scaled_mm_reference(a.detach(), None, None, b, s, "mxfp8_e4m3", torch.float32)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_meta_tensors_give_the_shape():
    """Shape inference on the meta device (deferred init) goes through the op's fake, for every MX op."""
    meta = torch.device("meta")
    a = torch.empty(16, 128, dtype=torch.bfloat16, device=meta)
    b = torch.empty(24, 128, dtype=torch.float8_e4m3fn, device=meta)
    s = torch.empty(24, 4, dtype=torch.float8_e8m0fnu, device=meta)
    offs = torch.tensor([8, 16], dtype=torch.int32, device=meta)
    outs = {
        "mx_scaled_mm": fly_lightning.mx_scaled_mm(a, b, s, "mxfp8_e4m3"),
        "mx_grouped_mm": fly_lightning.mx_grouped_mm(a, b.view(2, 12, 128), s.view(2, 12, 4), "mxfp8_e4m3", offs),
        "mx_dequantize": fly_lightning.mx_dequantize(b, s, "mxfp8_e4m3"),
        "mx_cast": fly_lightning.mx_cast(a, "mxfp8_e4m3")[0],
        "mx_fake_quantize": fly_lightning.mx_fake_quantize(a, "mxfp8_e4m3"),
    }
    shapes = {name: (tuple(y.shape), y.device.type) for name, y in outs.items()}
    assert shapes == {
        "mx_scaled_mm": ((16, 24), "meta"),
        "mx_grouped_mm": ((16, 12), "meta"),
        "mx_dequantize": ((24, 128), "meta"),
        "mx_cast": ((16, 128), "meta"),
        "mx_fake_quantize": ((16, 128), "meta"),
    }
