"""moe_combine: reference semantics, the ATen path, validation, the per-call index check and the ATen backward."""

import sys

import pytest
import torch

import fly_lightning as fl

mc = sys.modules["fly_lightning.ops.moe_combine"]  # the package re-exports the function under the module's name


def _case(t=9, k=3, h=10, dtype=torch.float64, index=True):
    rows = torch.randn(t * k, h, dtype=dtype)
    w = torch.rand(t, k, dtype=dtype)
    idx = torch.randperm(t * k).int() if index else None
    return rows, w, idx


def _loop(rows, w, idx):
    """Oracle of the oracle: an explicit per-token, per-slot loop in fp64."""
    t, k = w.shape
    y = torch.zeros(t, rows.shape[1], dtype=torch.float64)
    for ti in range(t):
        for j in range(k):
            r = ti * k + j if idx is None else int(idx[ti * k + j])
            y[ti] += w[ti, j].double() * rows[r].double()
    return y


@pytest.mark.parametrize("index", [True, False])
def test_reference_and_aten_match_a_loop(index):
    rows, w, idx = _case(index=index)
    torch.testing.assert_close(mc.moe_combine_reference(rows, w, idx), _loop(rows, w, idx))
    torch.testing.assert_close(mc._moe_combine_aten(rows, w, idx, None), _loop(rows, w, idx))


@pytest.mark.parametrize("chunk", [2**25, 7])  # one chunk; chunks of one token
def test_aten_forward_and_backward_in_chunks(chunk, monkeypatch):
    monkeypatch.setattr(mc, "CHUNK_ELEMENTS", chunk)
    rows, w, idx = _case()
    rows.requires_grad_()
    w.requires_grad_()
    with fl.dispatch_config(backends=("aten",)):
        assert torch.autograd.gradcheck(lambda r, ww: fl.moe_combine(r, ww, idx), (rows, w))
        assert torch.autograd.gradcheck(lambda r, ww: fl.moe_combine(r, ww), (rows, w))


def test_bf16_rows_fp32_weights_keep_fp32_sums_and_weight_gradients():
    rows, w, idx = _case(t=16, k=4, h=32, dtype=torch.float32)
    rb = rows.bfloat16().requires_grad_()
    wf = w.clone().requires_grad_()
    y = fl.moe_combine(rb, wf, idx, out_dtype=torch.float32)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), _loop(rb.detach(), w, idx), rtol=1e-6, atol=1e-6)
    assert (y != y.bfloat16().float()).float().mean() > 0.5  # summed in fp32, not in bf16
    g = torch.randn_like(y)
    with fl.dispatch_config(backends=("aten",)):  # the row gradient's dispatch: the interpreter truncates to bf16
        y.backward(g)
    assert rb.grad.dtype == torch.bfloat16 and wf.grad.dtype == torch.float32
    rg = rb.detach().double().index_select(0, idx.long()).view(16, 4, 32)
    torch.testing.assert_close(wf.grad.double(), torch.einsum("tkh,th->tk", rg, g.double()), rtol=1e-5, atol=1e-5)
    # the row gradient is rounded once from fp32: equal to the exact product rounded to bf16
    exact = (g.double().unsqueeze(1) * w.double().unsqueeze(-1)).view(-1, 32)
    inv = torch.empty(64, dtype=torch.long).scatter_(0, idx.long(), torch.arange(64))
    torch.testing.assert_close(rb.grad, exact.index_select(0, inv).bfloat16(), rtol=0, atol=0)


@pytest.mark.parametrize("backends", [("aten",), ("triton",)])
def test_autocast_does_not_reach_the_fp32_sums(backends):
    # autocast reaches ATen calls inside a custom op: left on, the ATen path's bmm would run in bf16
    rows, w, idx = _case(t=32, k=4, h=64, dtype=torch.float32)
    rb = rows.bfloat16().requires_grad_()
    wf = w.clone().requires_grad_()
    with fl.dispatch_config(backends=backends), torch.autocast("cpu", dtype=torch.bfloat16):
        y = fl.moe_combine(rb, wf, idx, out_dtype=torch.float32)
        y.square().sum().backward()
    torch.testing.assert_close(y.double(), _loop(rb.detach(), w, idx), rtol=1e-6, atol=1e-6)
    g = 2 * y.detach().double()
    rg = rb.detach().double().index_select(0, idx.long()).view(32, 4, 64)
    torch.testing.assert_close(wf.grad.double(), torch.einsum("tkh,th->tk", rg, g), rtol=1e-5, atol=1e-5)


def test_opcheck():
    rows, w, idx = _case(dtype=torch.float32)
    for args in ((rows, w, idx, None), (rows.bfloat16(), w, None, torch.float32), (rows[:, ::2], w, idx, None)):
        torch.library.opcheck(mc.moe_combine_op, args)


def test_default_output_dtype_is_the_rows_and_empty_shapes():
    rows, w, idx = _case(dtype=torch.float32)
    assert fl.moe_combine(rows.half(), w, idx).dtype == torch.float16
    assert fl.moe_combine(torch.empty(0, 5), torch.empty(0, 3)).shape == (0, 5)
    assert torch.equal(fl.moe_combine(torch.empty(0, 5), torch.empty(4, 0)), torch.zeros(4, 5))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda r, w, i: (r[:-1], w, None), "need T\\*k"),
        (lambda r, w, i: (r, w[0], None), "weights must be a 2-D"),
        (lambda r, w, i: (r.int(), w, None), "must be floating"),
        (lambda r, w, i: (r, w, i.long()), "index must be int32"),
        (lambda r, w, i: (r, w, i[:-1]), "index must be int32"),
        (lambda r, w, i: (r, w, torch.zeros_like(i)), "permutation"),
        (lambda r, w, i: (r, w, i + 1), "permutation"),
    ],
)
def test_invalid_arguments_raise_before_any_kernel(make, match):
    rows, w, idx = _case(dtype=torch.float32)
    with pytest.raises(ValueError, match=match):
        fl.moe_combine(*make(rows, w, idx))


def test_a_valid_call_does_not_let_a_later_invalid_index_through():
    rows, w, idx = _case(dtype=torch.float32)
    fl.moe_combine(rows, w, idx)
    bad = idx.clone()
    bad[0] = bad[1]
    with pytest.raises(ValueError, match="permutation"):
        fl.moe_combine(rows, w, bad)  # same signature: the per-call check still runs


def test_compiles_fullgraph():
    rows, w, idx = _case(dtype=torch.float32)
    fn = torch.compile(lambda r, ww, i: fl.moe_combine(r, ww, i), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(fn(rows, w, idx), mc.moe_combine_reference(rows, w, idx))


# --- moe_dispatch: the adjoint ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("backends", [("aten",), ("triton",)])
@pytest.mark.parametrize("weighted", [True, False])
def test_dispatch_forward_and_gradients_against_fp64_autograd(backends, weighted):
    t, k, h = 9, 3, 24
    g = torch.Generator().manual_seed(0)
    x0, w0 = torch.randn(t, h, generator=g), torch.rand(t, k, generator=g)
    perm = torch.randperm(t * k, generator=g).int()
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    with fl.dispatch_config(backends=backends):
        y = fl.moe_dispatch(x, perm, k, w if weighted else None)
        up = torch.randn(y.shape, generator=g)
        y.backward(up)
    xd, wd = x0.double().requires_grad_(), w0.double().requires_grad_()
    yd = mc.moe_dispatch_reference(xd, perm, k, wd if weighted else None)
    yd.backward(up.double())
    torch.testing.assert_close(y.double(), yd, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), xd.grad, rtol=1e-5, atol=1e-5)
    if weighted:
        torch.testing.assert_close(w.grad.double(), wd.grad, rtol=1e-5, atol=1e-5)
    assert fl.DISPATCH_LOG.records("moe_dispatch")[-1]["backend"] == backends[0]
    # its input gradient is moe_combine's forward: the adjoint pair
    assert fl.DISPATCH_LOG.records("moe_combine")


def test_combine_and_dispatch_are_adjoint():
    """<combine(r, w, inv), y> == <r, dispatch(y, perm, w)> in fp64: each is the other's input gradient."""
    t, k, h = 7, 4, 16
    r = torch.randn(t * k, h, dtype=torch.float64)
    y = torch.randn(t, h, dtype=torch.float64)
    w = torch.rand(t, k, dtype=torch.float64)
    perm = torch.randperm(t * k).int()
    inv = torch.argsort(perm.long()).int()
    lhs = (fl.moe_combine(r, w, inv) * y).sum()
    rhs = (r * fl.moe_dispatch(y, perm, k, w)).sum()
    torch.testing.assert_close(lhs, rhs)


def test_combine_row_gradient_runs_dispatch():
    rows, w, idx = _case(dtype=torch.float32)
    rows.requires_grad_()
    fl.moe_combine(rows, w, idx).sum().backward()
    assert sum(r["calls"] for r in fl.DISPATCH_LOG.records("moe_dispatch")) == 1


def test_dispatch_opcheck_and_compile():
    t, k, h = 6, 2, 8
    x, w = torch.randn(t, h), torch.rand(t, k)
    perm = torch.randperm(t * k).int()
    for args in ((x, perm, k, w, None), (x.bfloat16(), perm, k, None, torch.float32)):
        torch.library.opcheck(mc.moe_dispatch_op, args)
    fn = torch.compile(lambda a, p, ww: fl.moe_dispatch(a, p, k, ww), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(fn(x, perm, w), mc.moe_dispatch_reference(x, perm, k, w))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda x, p, w: (x, p[:-1], 2, w), "perm must be int32"),
        (lambda x, p, w: (x, p.long(), 2, w), "perm must be int32"),
        (lambda x, p, w: (x, p, 0, w), "topk must be a positive int"),
        (lambda x, p, w: (x, p, 2, w[:, :1]), "weights must be floating"),
        (lambda x, p, w: (x.int(), p, 2, w), "x must be a floating"),
        (lambda x, p, w: (x, torch.zeros_like(p), 2, w), "permutation"),
    ],
)
def test_dispatch_invalid_arguments_raise_before_any_kernel(make, match):
    x, w = torch.randn(5, 8), torch.rand(5, 2)
    perm = torch.randperm(10).int()
    with pytest.raises(ValueError, match=match):
        fl.moe_dispatch(*make(x, perm, w))


def test_dispatch_weight_gradient_sums_fp32_inputs_in_fp32():
    # out_dtype narrower than x: d w = <x, grad> with x as it is, not rounded to grad's dtype first
    from fly_lightning.ops.moe_combine import moe_dispatch, moe_dispatch_reference

    torch.manual_seed(0)
    t, k, h = 8, 2, 256
    x, perm = torch.randn(t, h), torch.randperm(t * k).int()
    w = torch.rand(t, k, requires_grad=True)
    y = moe_dispatch(x, perm, k, w, out_dtype=torch.bfloat16)
    g = torch.randn_like(y)
    (dw,) = torch.autograd.grad(y, w, g)
    (want,) = torch.autograd.grad(moe_dispatch_reference(x, perm, k, w, torch.bfloat16), w, g)
    torch.testing.assert_close(dw, want, rtol=1e-5, atol=1e-5)


def test_combine_with_no_slots_has_a_backward():
    rows = torch.randn(0, 4, requires_grad=True)
    w = torch.rand(3, 0, requires_grad=True)
    out = fl.moe_combine(rows, w)
    assert out.shape == (3, 4) and not out.any()
    d_rows, d_w = torch.autograd.grad(out.sum(), (rows, w))
    assert d_rows.shape == (0, 4) and d_w.shape == (3, 0)
