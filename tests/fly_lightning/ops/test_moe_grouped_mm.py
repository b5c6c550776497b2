"""moe_grouped_mm: gather/scatter through the routing permutation, against composed references; grads; errors."""

import pytest
import torch

from fly_lightning import DISPATCH_LOG
from fly_lightning.ops.grouped_mm import grouped_mm_reference
from fly_lightning.ops.moe_grouped_mm import moe_grouped_mm, moe_grouped_mm_reference


def _routing(t, k, e, seed=0, skew=None):
    """Expert ids [T, k] (distinct per token), offsets and the stable permutation, as a router would give them."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(t, e, generator=gen)
    if skew is not None:
        scores = scores + skew
    ids = scores.topk(k, dim=-1).indices
    flat = ids.reshape(-1)
    offs = torch.cumsum(torch.bincount(flat, minlength=e), 0).to(torch.int32)
    perm = torch.argsort(flat, stable=True).to(torch.int32)
    return ids, offs, perm


def _rel_err(y, ref):
    return ((y.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("gather,scatter", [(True, False), (False, True), (True, True), (False, False)])
@pytest.mark.parametrize("k_major", [False, True])
def test_matches_gather_grouped_mm_scatter(gather, scatter, k_major):
    t, k, e, kk, n = 19, 3, 6, 40, 24
    _, offs, perm = _routing(t, k, e, skew=torch.tensor([0.0, 0, 5, 0, 0, 0]))  # expert 2 hot, some empty
    x_tok = torch.randn(t, kk).half()
    x = x_tok if gather else x_tok[perm.long() // k]
    w = torch.randn(e, n, kk).half().transpose(1, 2) if k_major else torch.randn(e, kk, n).half()
    y = moe_grouped_mm(x, w, offs, perm, topk=k, gather=gather, scatter=scatter)
    assert DISPATCH_LOG.records("moe_grouped_mm")[-1]["backend"] == "triton"
    sorted_ref = grouped_mm_reference(x_tok.double()[perm.long() // k], w.double(), offs)
    ref = torch.empty_like(sorted_ref)
    if scatter:
        ref[perm.long()] = sorted_ref
    else:
        ref = sorted_ref
    assert y.shape == (t * k, n)
    assert _rel_err(y, ref) < 2e-3
    assert _rel_err(y, moe_grouped_mm_reference(x.double(), w.double(), offs, perm, k, gather, scatter)) < 2e-3


@pytest.mark.parametrize("gather,scatter", [(True, False), (False, True), (True, True)])
def test_gradients_equal_the_composed_aten_graph(gather, scatter):
    t, k, e, kk, n = 13, 2, 4, 16, 24
    _, offs, perm = _routing(t, k, e, seed=3)
    p = perm.long()
    x_tok = torch.randn(t, kk).bfloat16()
    x0 = x_tok if gather else x_tok[p // k]
    w0 = torch.randn(e, n, kk).bfloat16().transpose(1, 2)
    g = torch.randn(t * k, n).bfloat16()
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    (moe_grouped_mm(x, w, offs, perm, topk=k, gather=gather, scatter=scatter).float() * g.float()).sum().backward()
    # the same function composed from ATen ops, differentiated by autograd
    x2, w2 = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    xs = x2[p // k] if gather else x2
    y2 = torch._grouped_mm(xs, w2, offs=offs)
    if scatter:
        y2 = y2[torch.argsort(p)]
    (y2.float() * g.float()).sum().backward()
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-2, atol=1e-2)
    assert w.grad.stride() == w.stride()


def test_gather_gradient_is_deterministic_and_sums_each_tokens_slots():
    t, k, e, kk, n = 11, 4, 5, 16, 16
    _, offs, perm = _routing(t, k, e, seed=5)
    w = torch.randn(e, kk, n)
    x = torch.randn(t, kk).requires_grad_()
    grads = []
    for _ in range(2):
        x.grad = None
        moe_grouped_mm(x, w, offs, perm, topk=k, gather=True).sum().backward()
        grads.append(x.grad.clone())
    assert torch.equal(grads[0], grads[1])
    # each token's gradient: the sum over its k experts of the column sums of W_e
    ids = torch.empty(t * k, dtype=torch.long)
    ids[perm.long()] = torch.repeat_interleave(torch.arange(e), torch.diff(offs, prepend=offs.new_zeros(1)).long())
    expected = w.sum(2)[ids.view(t, k)].sum(1)
    torch.testing.assert_close(grads[0], expected, rtol=1e-5, atol=1e-5)


def test_torch_compile_fullgraph():
    t, k, e, kk, n = 9, 2, 3, 16, 16
    _, offs, perm = _routing(t, k, e, seed=7)
    x = torch.randn(t, kk).half().requires_grad_()
    w = torch.randn(e, kk, n).half().requires_grad_()

    def f(x, w):
        h = moe_grouped_mm(x, w, offs, perm, topk=k, gather=True)
        return moe_grouped_mm(h, w.transpose(1, 2).contiguous().transpose(1, 2), offs, perm, topk=k, scatter=True)

    eager = f(x, w)
    compiled = torch.compile(f, fullgraph=True)(x, w)
    torch.testing.assert_close(compiled, eager)
    gx, gw = torch.autograd.grad(compiled.float().sum(), (x, w))
    ex, ew = torch.autograd.grad(eager.float().sum(), (x, w))
    torch.testing.assert_close(gx, ex)
    torch.testing.assert_close(gw, ew)


def test_invalid_inputs():
    t, k, e = 6, 2, 3
    _, offs, perm = _routing(t, k, e)
    x, w = torch.randn(t, 8).half(), torch.randn(e, 8, 8).half()

    def bad(msg, *args, **kw):
        with pytest.raises(ValueError, match=msg):
            moe_grouped_mm(*args, **kw)

    bad("perm must be a 1-D int32", x, w, offs, perm.long(), topk=k, gather=True)
    bad("T\\*topk", x[:5], w, offs, perm, topk=k, gather=True)
    bad("x has 6 rows but perm has 12", x, w, offs, perm, topk=k)
    bad("topk must be a positive int", x, w, offs, perm, topk=0, gather=True)
    bad("must equal the number of rows", x, w, offs - 1, perm, topk=k, gather=True)
    bad("perm values", x, w, offs, perm + 1, topk=k, gather=True)
    bad("contraction dims", x, torch.randn(e, 4, 8).half(), offs, perm, topk=k, gather=True)
    bad("offs must be int32", x, w, offs.long(), perm, topk=k, gather=True)


def test_strided_permutation_after_a_contiguous_one_falls_back_with_reason():
    t, k, e, kk, n = 9, 2, 3, 16, 8
    _, offs, perm = _routing(t, k, e)
    x, w = torch.randn(t, kk).half(), torch.randn(e, kk, n).half()
    moe_grouped_mm(x, w, offs, perm, topk=k, gather=True)
    strided = torch.stack([perm, torch.zeros_like(perm)], 1).reshape(-1)[::2]  # same values, stride 2
    y = moe_grouped_mm(x, w, offs, strided, topk=k, gather=True)
    rec = DISPATCH_LOG.records("moe_grouped_mm")[-1]
    assert rec["backend"] == "aten" and "perm not contiguous" in rec["reason"]
    ref = moe_grouped_mm_reference(x.double(), w.double(), offs, perm, k, True, False)
    assert _rel_err(y, ref) < 2e-3


def test_permutation_values_are_checked_on_every_call_also_through_the_custom_op():
    t, k, e, kk, n = 4, 2, 3, 16, 8
    _, offs, perm = _routing(t, k, e)
    x, w = torch.randn(t, kk).half(), torch.randn(e, kk, n).half()
    torch.ops.fly.moe_grouped_mm(x, w, offs, perm, k, True, True, None)
    repeated = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3], dtype=torch.int32)  # in range, not a permutation
    with pytest.raises(ValueError, match="must be a permutation"):
        torch.ops.fly.moe_grouped_mm(x, w, offs, repeated, k, True, True, None)
    with pytest.raises(ValueError, match="must be a permutation"):
        moe_grouped_mm(x, w, offs, repeated, topk=k, gather=True, scatter=True)
