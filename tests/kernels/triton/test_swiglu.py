"""Triton swiglu (interpreter): every output element written, equal to the reference for both input forms and
strided rows, and the inputs it leaves to ATen recorded with their reason."""

import pytest
import torch

import fly_lightning as fl
from fly_lightning.kernels.triton.swiglu import swiglu_triton
from fly_lightning.ops.swiglu import swiglu_reference


def _run(gate, up):
    torch.use_deterministic_algorithms(True)  # outputs are poisoned (conftest.py): unwritten elements would show
    try:
        return swiglu_triton(gate, up)
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("s, i", [(1, 1), (33, 96), (5, 3000), (70, 17)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_reference(s, i, dtype):
    hid = (torch.randn(s, 2 * i) * 4).to(dtype)
    y = _run(hid, None)
    ref = swiglu_reference(hid, None)
    assert y.dtype == dtype and y.is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6)
    else:  # the interpreter truncates fp32 -> bf16/fp16 where a GPU rounds: one unit in the last place
        torch.testing.assert_close(y.float(), ref.float(), rtol=8e-3, atol=1e-3)
    g, u = hid[:, :i].contiguous(), hid[:, i:].contiguous()
    assert torch.equal(_run(g, u), y)


def test_extremes():
    g = torch.tensor([[-1e4, -88.0, 0.0, 88.0, 1e4, float("inf"), float("nan"), -0.0]])
    u = torch.full_like(g, 2.0)
    torch.testing.assert_close(_run(g, u), swiglu_reference(g, u), equal_nan=True)


def test_fallback_on_non_contiguous_last_dim():
    hid = torch.randn(16, 12).t().contiguous().t()  # column-major
    torch.testing.assert_close(fl.swiglu(hid), swiglu_reference(hid, None))
    reasons = fl.DISPATCH_LOG.summary()["swiglu"]["fallback_reasons"]
    assert any("last dim not contiguous" in r for r in reasons), reasons


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_geglu_matches_reference(activation, dtype):
    hid = (torch.randn(33, 2 * 96) * 4).to(dtype)
    y = swiglu_triton(hid, None, activation)
    ref = swiglu_reference(hid, None, activation)
    assert not torch.equal(ref, swiglu_reference(hid, None))  # another function than SiLU
    if dtype == torch.float32:  # 1 + erf(x) cancels for x << 0: each erf's last-place error shows there, absolutely
        torch.testing.assert_close(y, ref, rtol=2e-6, atol=1e-5)
    else:  # the interpreter truncates where a GPU rounds: one unit in the last place
        torch.testing.assert_close(y.float(), ref.float(), rtol=8e-3, atol=1e-3)
    g, u = hid[:, :96].contiguous(), hid[:, 96:].contiguous()
    assert torch.equal(swiglu_triton(g, u, activation), y)


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_geglu_extremes(activation):
    g = torch.tensor([[-1e4, -88.0, -5.0, 0.0, 5.0, 88.0, 1e4, float("inf"), float("nan"), -0.0]])
    u = torch.full_like(g, 2.0)
    # the oracle in fp64: torch 2.13's vectorised fp32 GELU on some CPUs gives NaN at +inf (its scalar path: inf)
    want = swiglu_reference(g.double(), u.double(), activation).float()
    torch.testing.assert_close(_run_act(g, u, activation), want, equal_nan=True)


def _run_act(gate, up, activation):
    torch.use_deterministic_algorithms(True)
    try:
        return swiglu_triton(gate, up, activation)
    finally:
        torch.use_deterministic_algorithms(False)
