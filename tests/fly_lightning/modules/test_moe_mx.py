"""``modules.moe_mx``: the experts' two forms (``MXGroupedProjection``, ``EmulatedProjection``) on direct calls, both
weight layouts and an empty group: the products of the MX values forward, the bf16 path's gradients backward; which
form ``MXExperts`` takes."""

import sys

import pytest
import torch

from fly_lightning.modules.moe_mx import MXExperts
from fly_lightning.ops.grouped_mm import grouped_mm

E, M, K, N = 3, 40, 64, 96


def _operands(k_major: bool):
    torch.manual_seed(0)
    x = torch.randn(M, K, requires_grad=True)
    w = torch.randn(E, K, N) if k_major else torch.randn(E, N, K).transpose(1, 2)  # K-major, or HF's [E, N, K]
    w = w.detach().requires_grad_()
    offs = torch.tensor([16, 16, M], dtype=torch.int32)  # the middle expert gets no rows
    return x, w, offs


def _bf16_path(x, w, offs, g):
    """The gradients of the unquantized ``grouped_mm``: what both forms' straight-through backward must give."""
    xb, wb = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    grouped_mm(xb, wb, offs).backward(g)
    return xb.grad, wb.grad


@pytest.mark.parametrize("k_major", [False, True])
@pytest.mark.parametrize("fmts", [("mxfp8_e4m3", "mxfp8_e4m3"), ("mxfp4_e2m1", "mxfp4_e2m1"), ("mxfp8_e4m3", None)])
def test_both_forms_multiply_the_mx_values_and_pass_the_bf16_gradients(k_major, fmts):
    mx = MXExperts(fmts[0], fmts[1], "floor", kernel_preference="mx_gemm")
    x, w, offs = _operands(k_major)
    xe, we = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    (y,) = mx.project(x, offs, w)
    y_e = mx.emulated(xe, mx.act(xe.detach()), we, offs)
    on_grid = grouped_mm(mx.act(x.detach()), mx.weight(w.detach()), offs)  # the products of the MX values
    torch.testing.assert_close(y, on_grid, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y_e, on_grid, rtol=1e-5, atol=1e-5)
    assert (on_grid - grouped_mm(x.detach(), w.detach(), offs)).abs().max() > 1e-2  # the casts changed the numbers
    g = torch.randn_like(y)
    y.backward(g)
    y_e.backward(g)
    dx, dw = _bf16_path(x, w, offs, g)
    for got in ((x.grad, w.grad), (xe.grad, we.grad)):
        torch.testing.assert_close(got[0], dx, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], dw, rtol=1e-5, atol=1e-5)
        assert got[1].stride() == w.stride()  # the master's own layout: no copy by autograd
    assert w.grad[1].abs().max() == 0  # the empty expert


@pytest.mark.parametrize("fmts", [("mxfp8_e4m3", "mxfp8_e4m3"), ("mxfp4_e2m1", None)])
def test_separate_weights_share_one_cast_of_the_rows(monkeypatch, fmts):
    """Separate gate and up weights: the rows are cast once for both; each output equals the products of the MX
    values, every gradient the bf16 path's, and an output left out of the loss adds nothing to the rows' gradient."""
    moe_mx = sys.modules["fly_lightning.modules.moe_mx"]
    casts = []
    real_cast = moe_mx.mx_cast
    monkeypatch.setattr(moe_mx, "mx_cast", lambda t, *a: casts.append(tuple(t.shape)) or real_cast(t, *a))
    mx = MXExperts(fmts[0], fmts[1], "floor", kernel_preference="mx_gemm")
    x, gate, offs = _operands(k_major=False)
    up = torch.randn(E, K, N).requires_grad_()  # the other layout for the second weight
    y_gate, y_up = mx.project(x, offs, gate, up)
    assert casts.count((M, K)) == (fmts[1] is not None)  # the rows once (weight-only: never)
    for y, w in ((y_gate, gate), (y_up, up)):
        torch.testing.assert_close(y, grouped_mm(mx.act(x.detach()), mx.weight(w.detach()), offs), rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y_gate)
    (y_gate * g + y_up * g.flip(0)).sum().backward()
    ref = [t.detach().clone().requires_grad_() for t in (x, gate, up)]
    (grouped_mm(ref[0], ref[1], offs) * g + grouped_mm(ref[0], ref[2], offs) * g.flip(0)).sum().backward()
    for t, r in zip((x, gate, up), ref, strict=True):
        torch.testing.assert_close(t.grad, r.grad, rtol=1e-5, atol=1e-5)
    x.grad, up.grad = None, None
    y_gate, y_up = mx.project(x, offs, gate, up)
    (y_gate * g).sum().backward()  # only the gate output: the up weight gets no gradient, the rows the gate's alone
    torch.testing.assert_close(x.grad, _bf16_path(x, gate, offs, g)[0], rtol=1e-5, atol=1e-5)
    assert up.grad is None


def test_which_form(monkeypatch):
    op = sys.modules["fly_lightning.ops.mx_scaled_mm"]  # the module (the package exports the function by that name)
    x = torch.randn(8, 128)
    on_bounds = (torch.randn(4, 128, 256), torch.randn(4, 128, 128))
    off_bounds = (torch.randn(4, 96, 256), torch.randn(4, 128, 96))
    auto = MXExperts("mxfp8_e4m3", "mxfp8_e4m3", "rceil")
    assert not auto.mx_gemm(x, *on_bounds)  # no native backend: per-expert rows unknown, the emulated form
    monkeypatch.setattr(op, "native_backend", lambda name, device: "flydsl")
    assert auto.mx_gemm(x, *on_bounds) and not auto.mx_gemm(x, *off_bounds)
    too_many = (torch.randn(1025, 128, 4), torch.randn(1025, 4, 128))  # FlyDSL takes up to 1024 experts
    assert not auto.mx_gemm(x, *too_many)
    monkeypatch.setattr(op, "NATIVE_MAX_BYTES", 128 * 256 * 4)  # each MX tensor under 2 GiB, scaled down here
    assert not auto.mx_gemm(x, *on_bounds)
    monkeypatch.setattr(op, "NATIVE_MAX_BYTES", 2**31)
    assert not MXExperts("mxfp8_e4m3", None, "rceil").mx_gemm(x, *on_bounds)  # weight-only: native takes MX x MX
    assert not MXExperts("mxfp8_e4m3", "mxfp8_e4m3", "rceil", frozen=True).mx_gemm(x, *on_bounds)
    assert not MXExperts("mxfp8_e4m3", "mxfp8_e4m3", "rceil", kernel_preference="emulated").mx_gemm(x, *on_bounds)
    forced = MXExperts("mxfp8_e4m3", "mxfp8_e4m3", "rceil", kernel_preference="mx_gemm")
    assert forced.mx_gemm(x, *off_bounds)  # asked for: the op's own fallback decides what runs
