"""``mx_grouped_mm``: every format pair (MX x MX, bf16/fp32 x MX) against the fp32 per-group product of the dequantised
operands, the ATen path equal to the reference on CPU, empty groups, rows past the last offset, validation before any
kernel, the fake, and torch.compile."""

import pytest
import torch

import fly_lightning
from fly_lightning.ops.mx_grouped_mm import mx_grouped_mm_op, mx_grouped_mm_reference
from fly_lightning.quant import formats

PAIRS = [("mxfp8_e4m3", "mxfp8_e4m3"), ("mxfp8_e5m2", "mxfp8_e5m2"), ("mxfp4_e2m1", "mxfp4_e2m1"),
         ("mxfp8_e5m2", "mxfp8_e4m3"), (None, "mxfp8_e4m3"), (None, "mxfp8_e5m2"), (None, "mxfp4_e2m1")]  # fmt: skip
COUNTS = [0, 5, 33, 0, 12, 1]  # empty groups (first, middle), a single row


def _cast_w(w_ENK: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    e, n, k = w_ENK.shape
    data, scale = fly_lightning.mx_cast(w_ENK.reshape(e * n, k), fmt)
    return data.view(e, n, -1), scale.view(e, n, -1)


def _problem(x_fmt, w_fmt, counts=COUNTS, k=64, n=24, tail=3, x_dtype=torch.float32):
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    x = torch.randn(int(offs[-1]) + tail, k)
    w = torch.randn(len(counts), n, k)
    xd, xs = (x.to(x_dtype), None) if x_fmt is None else fly_lightning.mx_cast(x, x_fmt)
    return x, w, (xd, xs, x_fmt, *_cast_w(w, w_fmt), w_fmt, offs)


def _call(args, out_dtype=torch.float32):
    xd, xs, x_fmt, wd, ws, w_fmt, offs = args
    return fly_lightning.mx_grouped_mm(xd, wd, ws, w_fmt, offs, x_scale=xs, x_fmt=x_fmt, out_dtype=out_dtype)


def _exact(x, w, offs):
    start, rows = 0, []
    for e, end in enumerate(offs.tolist()):
        rows.append(x[start:end] @ w[e].t())
        start = end
    return torch.cat(rows)


@pytest.mark.parametrize("x_fmt, w_fmt", PAIRS)
def test_product_of_the_dequantised_operands_per_group(x_fmt, w_fmt):
    x, w, args = _problem(x_fmt, w_fmt)
    with fly_lightning.dispatch_config(disabled_ops={"mx_grouped_mm"}):  # ATen
        y = _call(args)
    assert fly_lightning.DISPATCH_LOG.records("mx_grouped_mm")[-1]["backend"] == "aten"
    ref = mx_grouped_mm_reference(*args, torch.float32)
    end = int(args[-1][-1])
    assert y.shape == (x.shape[0], 24) and torch.equal(y[:end], ref[:end])  # CPU ATen: fp32 per group, as the oracle
    # the oracle is the plain product of the dequantised operands, group by group
    dx = x if x_fmt is None else formats.from_mx(args[0], args[1], x_fmt)
    dw = formats.from_mx(args[3], args[4], w_fmt)
    torch.testing.assert_close(ref[:end], _exact(dx, dw, args[-1]), rtol=1e-5, atol=1e-5)
    # and close to the unquantised product: the element formats' rounding only
    exact = _exact(x, w, args[-1])
    rel = ((y[:end] - exact).norm() / exact.norm()).item()
    assert 0 < rel < (0.25 if "fp4" in f"{x_fmt}{w_fmt}" else 0.1), rel


def test_empty_groups_and_rows_past_the_last_offset():
    x, w, args = _problem("mxfp8_e4m3", "mxfp8_e4m3", counts=[0, 0, 7, 0], tail=4)
    y = mx_grouped_mm_reference(*args, torch.float32)
    assert y.shape == (11, 24)
    ref = formats.from_mx(args[0], args[1], "mxfp8_e4m3")[:7] @ formats.from_mx(args[3], args[4], "mxfp8_e4m3")[2].t()
    torch.testing.assert_close(y[:7], ref)
    all_empty = list(args)
    all_empty[-1] = torch.zeros(4, dtype=torch.int32)
    assert _call(all_empty).shape == (11, 24)  # nothing to compute, nothing raised


def test_out_dtype_and_bf16_weight_only():
    _, _, args = _problem(None, "mxfp4_e2m1", x_dtype=torch.bfloat16)
    y = _call(args, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and y.shape == (args[0].shape[0], 24)
    ref = mx_grouped_mm_reference(*args, torch.float32)
    end = int(args[-1][-1])
    assert ((y[:end].float() - ref[:end]).norm() / ref[:end].norm()).item() < 1e-2


def _valid():
    return list(_problem("mxfp8_e4m3", "mxfp8_e4m3")[2])


def _set(i, value):
    def change(args):
        args[i] = value(args) if callable(value) else value
        return args

    return change


@pytest.mark.parametrize(
    "change, match",
    [
        (_set(3, lambda a: a[3].view(torch.uint8)), "3-D torch.float8_e4m3fn"),
        (_set(3, lambda a: a[3][0]), "3-D"),
        (_set(4, lambda a: a[4].view(torch.uint8)), "float8_e8m0fnu"),
        (_set(4, lambda a: a[4][:, :, :1]), "scales"),
        (_set(5, "mxfp4_e2m1"), "torch.uint8"),
        (_set(5, "mxfp6"), "unknown MX format"),
        (_set(0, lambda a: a[0][:, :32]), "scales"),
        (lambda a: [torch.randn(a[0].shape[0], 64).half(), None, None, *a[3:]], "bf16/fp32"),
        (lambda a: [torch.randn(a[0].shape[0], 96), None, None, *a[3:]], "K=96"),
        (_set(1, None), "needs x_scale"),
        (lambda a: [torch.randn(a[0].shape[0], 64), a[1], None, *a[3:]], "x_scale given without x_fmt"),
        (_set(6, lambda a: a[6].long()), "int32"),
        (_set(6, lambda a: a[6][:3]), "length E=6"),
        (_set(6, torch.tensor([0, 5, 3, 3, 3, 3], dtype=torch.int32)), "non-decreasing"),
        (_set(6, torch.tensor([0, 5, 38, 38, 50, 999], dtype=torch.int32)), "exceeds"),
    ],
)
def test_invalid_arguments_raise_before_any_kernel(change, match):
    args = change(_valid())
    with pytest.raises(ValueError, match=match):
        _call(args)
    with pytest.raises(ValueError, match="out_dtype"):
        _call(_valid(), torch.int8)
    assert fly_lightning.DISPATCH_LOG.records("mx_grouped_mm") == []


def test_fake_gives_the_real_shape_and_compile_runs():
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = _valid()
    real = _call(args, torch.bfloat16)
    with FakeTensorMode() as mode:
        fake = mx_grouped_mm_op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args],
                                torch.bfloat16)  # fmt: skip
    assert (fake.shape, fake.dtype) == (real.shape, real.dtype)
    fn = torch.compile(lambda *a: _call(a, torch.bfloat16), fullgraph=True, backend="eager")
    end = int(args[-1][-1])
    assert torch.equal(fn(*args)[:end], real[:end])


def test_listed_in_the_registry_and_the_support_matrix():
    from fly_lightning.support import markdown

    assert fly_lightning.get_op("mx_grouped_mm").name == "mx_grouped_mm"
    table = markdown()
    assert "| `mx_grouped_mm` | aten |" in table and "| `mx_grouped_mm` | triton |" in table


def test_an_input_requiring_grad_is_refused():
    """Forward only (MX experts train through ``MXGroupedProjection``, which has the gradient formula)."""
    _, _, args = _problem(None, "mxfp8_e4m3", k=128, x_dtype=torch.bfloat16)
    x = args[0].requires_grad_()
    with pytest.raises(ValueError, match="mx_grouped_mm: forward only"):
        fly_lightning.mx_grouped_mm(x, args[3], args[4], args[5], args[6])
    with torch.no_grad():
        y = fly_lightning.mx_grouped_mm(x, args[3], args[4], args[5], args[6], out_dtype=torch.float32)
    assert not y.requires_grad
