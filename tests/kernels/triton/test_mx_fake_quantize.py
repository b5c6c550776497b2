"""The Triton MX fake quantisation (interpreter): the reference's values (cast then ``from_mx``) row-wise and
column-wise, every format and mode, on the blocks where casts go wrong and on every bf16 value; every output element
written (outputs are poisoned in tests); what it leaves to ATen named."""

import pytest
import torch

import fly_lightning
from fly_lightning.kernels.triton.mx_fake_quantize import launch
from fly_lightning.ops.mx_fake_quantize import mx_fake_quantize_reference
from fly_lightning.policy import dispatch_config
from fly_lightning.quant import formats
from tests.kernels.triton._mx_inputs import cases, every_bf16

MODES = [("floor", torch.float32), ("floor", torch.bfloat16), ("rceil", torch.bfloat16)]


def _check(x: torch.Tensor, fmt: str, mode: str, axis: int) -> None:
    y = launch(x, fmt, mode, axis)
    want = mx_fake_quantize_reference(x, fmt, mode, axis)
    assert y.dtype == x.dtype and y.shape == x.shape and y.is_contiguous()
    nan = want.isnan()
    assert torch.equal(y.isnan(), nan)  # NaN blocks: NaN throughout, as from_mx's NaN scale gives
    assert torch.equal(y[~nan], want[~nan])


@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("mode, dtype", MODES, ids=[f"{m}-{str(d)[6:]}" for m, d in MODES])
@pytest.mark.parametrize("fmt", sorted(formats.FORMATS))
def test_special_blocks_equal_the_reference(fmt, mode, dtype, axis):
    x = cases(dtype).repeat(3, 2)[:, :96]  # K of 3 blocks, rows off the tile
    _check(x if axis == -1 else x.t().contiguous(), fmt, mode, axis)


@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("mode", ["floor", "rceil"])
@pytest.mark.parametrize("fmt", sorted(formats.FORMATS))
def test_every_bf16_value(fmt, mode, axis):
    """Every bf16 value, alone in its block and under larger maxima: subnormal products rounded to bf16 as
    ``from_mx``'s ``.to(bfloat16)`` rounds them (to nearest even; the interpreter's conversion truncates)."""
    x = every_bf16()
    _check(x if axis == -1 else x.t().contiguous(), fmt, mode, axis)


def test_leading_dims_strided_rows_and_empty():
    x = cases(torch.bfloat16)[:36].reshape(2, 9, 64)
    _check(x, "mxfp4_e2m1", "floor", -1)
    wide = torch.randn(40, 200, dtype=torch.bfloat16)
    _check(wide[:, 8:136], "mxfp8_e4m3", "rceil", -1)  # rows of a wider tensor
    _check(wide[:32, 8:136], "mxfp8_e4m3", "floor", 0)  # row stride past N, column-wise
    assert launch(torch.empty(0, 64), "mxfp8_e4m3").shape == (0, 64)


@pytest.mark.parametrize(
    "args, reason",
    [
        ((torch.randn(4, 64), "mxfp8_e4m3", "rceil", -1), "rceil scales from torch.float32"),
        ((torch.randn(4, 64).t(), "mxfp8_e4m3", "floor", 0), "columns not contiguous"),
    ],
)
def test_unsupported_inputs_run_on_aten_with_the_reason(args, reason):
    with dispatch_config(backends=("triton",)):
        y = fly_lightning.mx_fake_quantize(*args)
    assert torch.equal(y, mx_fake_quantize_reference(*args))
    (rec,) = fly_lightning.DISPATCH_LOG.records("mx_fake_quantize")
    assert rec["backend"] == "aten" and reason in rec["reason"]


def test_dispatch_serves_it():
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    y = fly_lightning.mx_fake_quantize(x, "mxfp4_e2m1", "rceil")
    assert fly_lightning.DISPATCH_LOG.records("mx_fake_quantize")[-1]["backend"] == "triton"
    assert torch.equal(y, mx_fake_quantize_reference(x, "mxfp4_e2m1", "rceil", -1))


def test_column_launch_stays_within_the_grid_limit(monkeypatch):
    # a column past 65535 row blocks of the plan: each program takes more blocks (grid axis 1 holds 65535 at most)
    from fly_lightning.kernels.triton import mx_fake_quantize as kernel

    grids = []
    monkeypatch.setattr(kernel, "_FAKE_QUANT_COLS", lambda grid, args, **kw: grids.append((grid, kw["G"])))
    monkeypatch.setattr(kernel, "COLS_PLAN", (64, 2, 1))
    k = 32 * (65535 * 2 + 3)
    launch(torch.zeros(k, 2, dtype=torch.bfloat16), "mxfp8_e4m3", "floor", axis=0)
    ((grid, g),) = grids
    assert grid[1] <= 65535 and grid[1] * g * 32 >= k and g == 4
