"""The MX GEMM tests' fp64 oracle: the product of the dequantised operands in fp64, and the most a kernel that
multiplies them exactly (bf16 MMAs) and sums in fp32 may differ from it, elementwise."""

import torch

from fly_lightning.quant import formats

FP32_EPS = 2.0**-24
# one unit in the last place of the output dtype, relative: the interpreter truncates its fp32 -> bf16 stores
ROUNDING = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def _dequantised(data, scale, fmt) -> torch.Tensor:
    return data.double() if fmt is None else formats.from_mx(data, scale, fmt, torch.float32).double()


def fp64_mm(a, a_scale, a_fmt, b, b_scale, b_fmt) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a @ b^T, |a| @ |b|^T)`` of the dequantised ``a [M, K]`` and ``b [N, K]``, in fp64."""
    da, db = _dequantised(a, a_scale, a_fmt), _dequantised(b, b_scale, b_fmt)
    return da @ db.t(), da.abs().nan_to_num(0) @ db.abs().nan_to_num(0).t()


def fp64_grouped_mm(x, x_scale, x_fmt, w, w_scale, w_fmt, offs) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp64_mm`` per group: rows ``offs[e-1]:offs[e]`` of ``x [M, K]`` times expert ``e`` of ``w [E, N, K]``; rows
    past the last offset NaN (unspecified)."""
    dx, dw = _dequantised(x, x_scale, x_fmt), _dequantised(w, w_scale, w_fmt)
    want = torch.full((dx.shape[0], dw.shape[1]), float("nan"), dtype=torch.float64)
    size = torch.full_like(want, float("nan"))
    start = 0
    for e, end in enumerate(offs.tolist()):
        want[start:end] = dx[start:end] @ dw[e].t()
        size[start:end] = dx[start:end].abs().nan_to_num(0) @ dw[e].abs().nan_to_num(0).t()
        start = end
    return want, size


def assert_within_fp32_sums(y: torch.Tensor, want: torch.Tensor, size: torch.Tensor, k: int) -> None:
    """``y`` within fp32 summation of K exact products (``2 K eps32 |a| |b|``, twice the classic bound: the
    hardware's sum order and split-K partials) plus one unit in the last place of ``y``'s dtype, wherever ``want``
    is a number; NaN exactly where ``want`` is NaN. A wrong scale, block or element is off by far more."""
    nan = want.isnan()
    assert torch.equal(y.isnan(), nan), "NaN positions differ"
    err = (y.double() - want).abs()[~nan]
    allowed = (2 * k * FP32_EPS * size + ROUNDING[y.dtype] * want.abs())[~nan] + 1e-300
    assert (err <= allowed).all(), f"worst error / bound {(err / allowed).max().item():.3g}"
