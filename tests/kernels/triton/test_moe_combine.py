"""Triton moe_combine (interpreter): every output element written, equal to the reference, strided inputs, and the
inputs it leaves to ATen recorded with their reason."""

import pytest
import torch

import fly_lightning as fl
from fly_lightning.kernels.triton.moe_combine import moe_combine_triton, moe_dispatch_triton
from fly_lightning.ops.moe_combine import moe_combine_reference, moe_dispatch_reference


def _run(rows, w, idx, out_dtype=None):
    torch.use_deterministic_algorithms(True)  # outputs are poisoned (conftest.py): unwritten elements would show
    try:
        return moe_combine_triton(rows, w, idx, out_dtype)
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("t, k, h", [(1, 1, 8), (37, 3, 200), (5, 8, 1030), (3, 2, 4097)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("index", [True, False])
def test_matches_reference(t, k, h, dtype, index):
    rows = torch.randn(t * k, h).to(dtype)
    w = torch.rand(t, k)
    idx = torch.randperm(t * k).int() if index else None
    y = _run(rows, w, idx, torch.float32)  # fp32 out: only the summation order differs from the reference
    torch.testing.assert_close(y, moe_combine_reference(rows, w, idx, torch.float32), rtol=2e-6, atol=2e-6)
    y = _run(rows, w, idx)
    assert y.dtype == dtype
    # the interpreter truncates fp32 -> bf16/fp16 where a GPU rounds: one unit in the last place
    torch.testing.assert_close(y.float(), moe_combine_reference(rows, w, idx).float(), rtol=8e-3, atol=1e-3)


def test_strided_rows_and_weights():
    t, k, h = 11, 4, 96
    wide = torch.randn(t * k, h + 32, dtype=torch.bfloat16)
    rows = wide[:, 16 : 16 + h]  # row stride h + 32
    w = torch.rand(k, t).t()  # column-major weights
    idx = torch.randperm(t * k).int()
    y = _run(rows, w, idx, torch.float32)
    torch.testing.assert_close(y, moe_combine_reference(rows, w, idx, torch.float32), rtol=2e-6, atol=2e-6)


def test_bf16_weights_and_output_dtype():
    rows = torch.randn(24, 64, dtype=torch.bfloat16)
    w = torch.rand(8, 3, dtype=torch.bfloat16)
    y = _run(rows, w, None, torch.float16)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y.float(), moe_combine_reference(rows, w, None, torch.float32), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda: (torch.randn(40, 8).t().contiguous().t(), torch.rand(10, 4), None), "last dim not contiguous"),
        (lambda: (torch.randn(33 * 2, 8), torch.rand(2, 33), None), "k=33"),
        (lambda: (torch.randn(6, 8, dtype=torch.float64), torch.rand(3, 2), None), "dtypes"),
        (lambda: (torch.randn(8, 8), torch.rand(4, 2), torch.zeros(1)), "index not contiguous"),
    ],
)
def test_unsupported_inputs_fall_back_with_reason(make, reason):
    rows, w, idx = make()
    if idx is not None:  # a strided view of a permutation of range(8)
        base = torch.zeros(16, dtype=torch.int32)
        base[::2] = torch.randperm(8).int()
        idx = base[::2]
    y = fl.moe_combine(rows, w, idx)
    torch.testing.assert_close(y, moe_combine_reference(rows, w, idx))
    reasons = fl.DISPATCH_LOG.summary()["moe_combine"]["fallback_reasons"]
    assert any(reason in r for r in reasons), reasons


@pytest.mark.parametrize("t, k, h", [(1, 1, 8), (37, 3, 200), (5, 8, 1030)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [True, False])
def test_dispatch_matches_reference(t, k, h, dtype, weighted):
    x = torch.randn(t, h).to(dtype)
    w = torch.rand(t, k) if weighted else None
    perm = torch.randperm(t * k).int()
    torch.use_deterministic_algorithms(True)  # poisoned outputs: an unwritten element would show
    try:
        y = moe_dispatch_triton(x, perm, k, w, torch.float32)
        y16 = moe_dispatch_triton(x, perm, k, w, None)
    finally:
        torch.use_deterministic_algorithms(False)
    torch.testing.assert_close(y, moe_dispatch_reference(x, perm, k, w, torch.float32), rtol=1e-6, atol=1e-6)
    assert y16.dtype == dtype
    torch.testing.assert_close(y16.float(), moe_dispatch_reference(x, perm, k, w).float(), rtol=8e-3, atol=1e-3)
