"""The fp8 grouped kernel (``_mx_fp8_grouped_kernel``) through the interpreter, on operands re-expressed by
``requantize``: against the fp64 product of those operands (codes times their 128-wide scales) on uneven groups,
rows past the last offset never written, NaN codes, and clamped invalid device offsets (the weights of empty groups
are left unwritten by the re-expression: never read)."""

import pytest
import torch

import fly_lightning
from fly_lightning.kernels.triton import _mx_fp8_grouped_kernel as fk
from fly_lightning.kernels.triton._mx_grouped_mm_kernel import FP8
from fly_lightning.kernels.triton._mx_requant import requantize

COUNTS = [0, 3, 70, 0, 17, 1]


def _operands(x_fmt, w_fmt, counts=COUNTS, k=256, n=40, tail=5):
    gen = torch.Generator().manual_seed(0)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    x = torch.randn(int(offs[-1]) + tail, k, generator=gen)
    w = torch.randn(len(counts), n, k, generator=gen) * torch.logspace(-3, 3, k)  # scales vary along K
    xd, xs = fly_lightning.mx_cast(x, x_fmt)
    wd, ws = fly_lightning.mx_cast(w.reshape(-1, k), w_fmt)
    qx, sx, qw, sw = requantize(xd, xs, x_fmt, wd, ws, w_fmt, offs=offs)
    return qx, sx, qw.view(len(counts), n, k), sw, offs


def _reference(qx, sx, qw, sw, offs) -> torch.Tensor:
    """fp64: every code's value times its group's scale, per group ``x @ w[g].T``."""
    e, n, k = qw.shape
    x = qx.double() * sx.double().repeat_interleave(128, 1)
    w = qw.reshape(e * n, k).double() * sw.t().double().repeat_interleave(128, 1)
    out = torch.zeros(qx.shape[0], n, dtype=torch.float64)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] @ w[g * n : (g + 1) * n].t()
        start = end
    return out


@pytest.mark.parametrize("x_fmt, w_fmt", [("mxfp8_e4m3", "mxfp8_e4m3"), ("mxfp4_e2m1", "mxfp4_e2m1"),
                                          ("mxfp8_e4m3", "mxfp4_e2m1")])  # fmt: skip
def test_matches_the_product_of_the_reexpressed_operands(x_fmt, w_fmt):
    qx, sx, qw, sw, offs = _operands(x_fmt, w_fmt)
    out = torch.full((qx.shape[0], qw.shape[1]), float("nan"))
    fk.launch(qx, sx, qw, sw, offs, out, FP8)
    end = int(offs[-1])
    ref = _reference(qx, sx, qw, sw, offs)[:end]
    assert ((out[:end].double() - ref).norm() / ref.norm()).item() < 1e-6  # fp32 sums of exact products
    assert out[end:].isnan().all()  # rows past the last offset are never written


def test_nan_codes_give_nan_rows():
    qx, sx, qw, sw, offs = _operands("mxfp8_e4m3", "mxfp8_e4m3")
    qx.view(torch.uint8)[10, 7] = 0x7F  # an e4m3 NaN code: row 10 (group 2)
    out = fk.launch(qx, sx, qw, sw, offs, torch.zeros(qx.shape[0], qw.shape[1]), FP8)
    assert out.isnan().any(1).nonzero().flatten().tolist() == [10] and out[10].isnan().all()


def test_invalid_device_offsets_are_clamped():
    qx, sx, qw, sw, offs = _operands("mxfp8_e4m3", "mxfp8_e4m3", counts=[6, 6, 6], tail=0)
    out = fk.launch(qx, sx, qw, sw, torch.tensor([-3, 500, 2], dtype=torch.int32), torch.zeros(18, 40), FP8)
    good = torch.tensor([0, 18, 18], dtype=torch.int32)  # what the kernel reads them as
    ref = _reference(qx, sx, qw, sw, good)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-6


def test_empty_shapes():
    qx, sx, qw, sw, offs = _operands("mxfp8_e4m3", "mxfp8_e4m3")
    out = torch.full((qx.shape[0], 0), 1.0)
    assert fk.launch(qx, sx, qw[:, :0], sw[:, :0], offs, out, FP8) is out
