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
