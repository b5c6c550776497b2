"""topk: the dispatched op against its reference and torch.topk, ties and NaN, gradients, compile, determinism,
fallbacks and errors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fly_lightning import DISPATCH_LOG
from fly_lightning.ops.topk import topk, topk_op, topk_reference


def _last():
    recs = DISPATCH_LOG.records("topk")
    assert recs, "no dispatch recorded"
    return recs[-1]


def _bits(t):
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@settings(max_examples=30, deadline=None)
@given(
    lead=st.sampled_from([(), (0,), (5,), (3, 7), (41,)]),
    n=st.sampled_from([1, 2, 7, 8, 60, 128, 160, 1000]),
    k=st.integers(0, 16),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    scale=st.sampled_from([1e-3, 1.0, 1e3]),
)
def test_matches_reference_and_torch_topk(lead, n, k, dtype, scale):
    k = min(k, n)
    x = (torch.randn(*lead, n) * scale).to(dtype)
    v, i = topk(x, k)
    rv, ri = topk_reference(x, k)
    assert v.shape == (*lead, k) and i.dtype == torch.int64
    if x.numel() and k:
        assert _last()["backend"] == "triton"
    assert torch.equal(i, ri) and torch.equal(_bits(v), _bits(rv))  # values: the input's exact bits
    tv, ti = torch.topk(x, k)
    assert torch.equal(v, tv)  # same values as ATen; indices may differ only on ties
    assert torch.equal(x.gather(-1, ti), x.gather(-1, i))


@pytest.mark.parametrize("shape,k", [((3, 0), 0), ((0, 5), 2), ((2, 0, 5), 3)])
def test_empty_input_runs_on_triton_without_a_launch(shape, k):
    v, i = topk(torch.randn(shape), k)
    assert v.shape == (*shape[:-1], k) and i.shape == v.shape
    assert _last()["backend"] == "triton" and not _last()["fallback"]


def test_ties_rank_lower_index_first_unlike_aten():
    x = torch.randint(0, 3, (64, 24)).float()
    _, i = topk(x, 5)
    assert torch.equal(i, torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :5])
    assert not torch.equal(i, torch.topk(x, 5).indices), "ATen happened to order every tie by index"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nan_ranks_highest_like_aten_and_zeros_keep_their_sign(dtype):
    x = torch.randn(3, 10).to(dtype)
    x[0, 4] = float("nan")
    x[1, 2] = -float("nan")
    x[2] = torch.tensor([0.0, -0.0, -1.0, 0.0, -0.0, 2.0, -3.0, 0.0, 1.0, -0.0]).to(dtype)
    v, i = topk(x, 4)
    tv, ti = torch.topk(x, 4)
    assert i[0, 0] == 4 and i[1, 0] == 2 and torch.isnan(v[:2, 0]).all()
    assert torch.equal(i[:2, 0], ti[:2, 0])
    assert i[2].tolist() == [5, 8, 0, 1] and torch.signbit(v[2, 3])  # -0.0 == +0.0: index order, bits kept


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_match_torch_topk(dtype):
    x0 = torch.randn(6, 5, 40).to(dtype)
    g = torch.randn(6, 5, 3).to(dtype)
    x = x0.clone().requires_grad_()
    topk(x, 3).values.backward(g)
    xr = x0.clone().requires_grad_()
    torch.topk(xr, 3).values.backward(g)
    torch.testing.assert_close(x.grad, xr.grad)


def test_opcheck():
    torch.library.opcheck(topk_op, (torch.randn(5, 33, requires_grad=True), 4))


def test_torch_compile_fullgraph_forward_and_backward():
    torch._dynamo.reset()
    fn = torch.compile(lambda x: topk(x, 4).values.sum(), fullgraph=True, backend="aot_eager")
    x = torch.randn(9, 50, requires_grad=True)
    fn(x).backward()
    xr = x.detach().clone().requires_grad_()
    torch.topk(xr, 4).values.sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)
    assert _last()["backend"] == "triton"


def test_deterministic_algorithms_same_result_and_all_outputs_written(poisoned_outputs):
    x = torch.randn(70, 200, dtype=torch.bfloat16)
    v0, i0 = topk(x, 8)
    torch.use_deterministic_algorithms(True)
    try:
        DISPATCH_LOG.reset()
        v1, i1 = topk(x, 8)
    finally:
        torch.use_deterministic_algorithms(False)
    assert _last()["backend"] == "triton"
    assert torch.equal(v0, v1) and torch.equal(i0, i1)


@pytest.mark.parametrize(
    "x, k, reason",
    [
        (torch.randn(4, 8, dtype=torch.float64), 2, "dtype torch.float64"),
        (torch.randint(0, 9, (4, 8)), 2, "dtype torch.int64"),
        (torch.randn(4, 32), 17, "k=17 > 16"),
        (torch.randn(2, 1025), 2, "last dim 1025 > 1024"),
        (torch.randn(16, 4).t(), 2, "last dim not contiguous"),
        (torch.randn(4, 6, 8).transpose(0, 1), 2, "not collapsible"),
    ],
)
def test_unsupported_inputs_fall_back_with_reason(x, k, reason):
    v, i = topk(x, k)
    rec = _last()
    assert rec["backend"] == "aten" and rec["fallback"] and reason in rec["reason"]
    rv, ri = topk_reference(x, k)
    assert torch.equal(v, rv) and torch.equal(i, ri)


@pytest.mark.parametrize(
    "x, k, match",
    [
        (torch.randn(4, 8), 9, r"k=9 must be in \[0, 8\]"),
        (torch.randn(4, 8), -1, r"must be in \[0, 8\]"),
        (torch.tensor(1.0), 1, "at least one dimension"),
        (torch.ones(4, 8, dtype=torch.bool), 1, "real and ordered"),
    ],
)
def test_invalid_arguments_raise_before_dispatch(x, k, match):
    with pytest.raises(ValueError, match=match):
        topk(x, k)
    assert DISPATCH_LOG.records() == []
