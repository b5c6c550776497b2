"""moe_route: the dispatched op against its reference, ties and NaN against ATen, gradients, compile, determinism,
fallbacks and errors. Triton runs through the interpreter on CPU."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fly_lightning import DISPATCH_LOG, dispatch_config
from fly_lightning.ops.moe_route import (
    moe_route,
    moe_route_backward,
    moe_route_op,
    moe_route_reference,
    ranked_values,
    routing_counts,
)

ATOL = dict(rtol=2e-5, atol=1e-6)


def _last():
    recs = DISPATCH_LOG.records("moe_route")
    assert recs, "no dispatch recorded"
    return recs[-1]


def _selection_values(logits, score, bias, n_groups, topk_groups):
    """What the experts are ranked by (fp64), to tell a near tie from a wrong choice."""
    return ranked_values(logits.double(), score, bias, n_groups is not None)


def assert_routing_matches(out, ref, args):
    """ids, counts, offsets and permutation exact; weights close. Where the ranked values are fp32 scores (bias or
    groups), a row may swap experts whose values are within fp32 rounding of each other (kernel vs torch exp)."""
    logits, k, score, renorm, bias, scale, n_groups, topk_groups, perm = args
    w, ids, counts, offsets, slots, pos = out
    rw, rids, *_ = ref
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert counts.dtype == offsets.dtype == torch.int32
    rows = torch.ones(ids.shape[0], dtype=torch.bool)
    if bias is None and n_groups is None:
        assert torch.equal(ids, rids)
    else:
        differ = (ids != rids).any(1)
        if differ.any():  # each differing row: the chosen values must equal the reference's up to rounding
            v = _selection_values(logits, score, bias, n_groups, topk_groups)[differ]
            got = v.gather(1, ids[differ].long()).sort(1).values
            want = v.gather(1, rids[differ].long()).sort(1).values
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, equal_nan=True)
            assert differ.float().mean() < 0.2, "too many rows differ for rounding alone"
        rows = ~differ
    torch.testing.assert_close(w[rows], rw[rows], equal_nan=True, **ATOL)
    # counts, offsets and permutation follow our ids exactly
    exp_counts, exp_offsets, exp_slots, exp_pos = routing_counts(ids, logits.shape[1], perm)
    assert torch.equal(counts, exp_counts) and torch.equal(offsets, exp_offsets)
    assert torch.equal(slots, exp_slots) and torch.equal(pos, exp_pos)


def _groups(draw_e, draw):
    options = [(g, t) for g in range(1, min(draw_e, 32) + 1) if draw_e % g == 0 and draw_e // g >= 2 for t in (1, g)]
    return draw(st.sampled_from(options)) if options else (None, None)


@st.composite
def routing_cases(draw):
    e = draw(st.sampled_from([2, 3, 8, 13, 16, 60, 64, 128, 160]))
    k = draw(st.integers(1, min(e, 8)))
    grouped = draw(st.booleans())
    n_groups, topk_groups = _groups(e, draw) if grouped else (None, None)
    if n_groups is not None:
        topk_groups = max(topk_groups, -(-k // (e // n_groups)))
    return dict(
        t=draw(st.integers(0, 40)),
        e=e,
        k=k,
        score=draw(st.sampled_from(["softmax", "sigmoid"])),
        renorm=draw(st.booleans()),
        bias=draw(st.booleans()),
        n_groups=n_groups,
        topk_groups=topk_groups,
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])),
        perm=draw(st.booleans()),
        scale=draw(st.sampled_from([0.1, 1.0, 8.0])),
        route_scale=draw(st.sampled_from([1.0, 2.5])),
    )


@settings(max_examples=40, deadline=None)
@given(case=routing_cases())
def test_matches_reference(case):
    logits = (torch.randn(case["t"], case["e"]) * case["scale"]).to(case["dtype"])
    bias = torch.randn(case["e"]) * 0.05 if case["bias"] else None
    args = (
        logits,
        case["k"],
        case["score"],
        case["renorm"],
        bias,
        case["route_scale"],
        case["n_groups"],
        case["topk_groups"],
        case["perm"],
    )
    out = moe_route_op(*args)
    assert _last()["backend"] == "triton"
    assert_routing_matches(out, moe_route_reference(*args), args)


def test_public_api_shapes_and_permutation_semantics():
    logits = torch.randn(37, 60, dtype=torch.bfloat16)
    r = moe_route(logits, 4, score="softmax", renormalize=False)
    assert r.weights_TK.shape == (37, 4) and r.ids_TK.shape == (37, 4)
    assert r.counts_E.shape == r.offsets_E.shape == (60,)
    assert r.sorted_slots_S is None and r.slot_pos_TK is None
    assert int(r.counts_E.sum()) == 37 * 4 and int(r.offsets_E[-1]) == 37 * 4
    p = moe_route(logits, 4, return_permutation=True)
    flat = p.ids_TK.flatten()
    assert torch.equal(p.sorted_slots_S.long(), torch.argsort(flat.long(), stable=True))
    assert torch.equal(p.slot_pos_TK.flatten()[p.sorted_slots_S.long()], torch.arange(37 * 4, dtype=torch.int32))
    assert torch.equal(flat[p.sorted_slots_S.long()], flat.sort().values)  # slots grouped by expert
    torch.testing.assert_close(p.weights_TK.sum(1), torch.ones(37), rtol=1e-5, atol=1e-6)


def test_end_to_end_moe_with_grouped_mm():
    """offsets feed torch._grouped_mm directly; the permutation gathers tokens and brings results back."""
    t, e, k, d, h = 29, 8, 2, 16, 12
    x = torch.randn(t, d)
    w_EDH = torch.randn(e, d, h)
    r = moe_route(torch.randn(t, e), k, return_permutation=True)
    x_sorted = x[r.sorted_slots_S.long() // k]
    y_sorted = torch._grouped_mm(x_sorted, w_EDH, offs=r.offsets_E)
    out = (y_sorted[r.slot_pos_TK.long()] * r.weights_TK[..., None]).sum(1)
    ref = torch.zeros(t, h)
    for j in range(k):
        ref += r.weights_TK[:, j, None] * torch.einsum("td,tdh->th", x, w_EDH[r.ids_TK[:, j].long()])
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_ties_rank_lower_index_first_unlike_aten(dtype, score):
    logits = torch.randint(-2, 3, (64, 16)).to(dtype)  # many exact ties
    r = moe_route(logits, 4, score=score)
    order = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :4]
    assert torch.equal(r.ids_TK.long(), order)
    # ATen's topk leaves the order of equal values unspecified: on these rows it differs from index order somewhere
    aten = torch.topk(logits.float(), 4, -1).indices
    assert not torch.equal(aten, order), "ATen happened to order every tie by index; the test lost its point"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nan_ranks_highest_like_aten(dtype):
    logits = torch.randn(8, 12).to(dtype)
    logits[0, 5] = float("nan")
    logits[1, 3] = logits[1, 7] = float("nan")
    logits[2, 4] = -float("nan")  # the sign bit does not matter
    logits[3, :] = float("nan")
    for score in ("softmax", "sigmoid"):
        r = moe_route(logits, 3, score=score, renormalize=score == "softmax")
        aten = torch.topk(logits.float(), 3, -1).indices
        for row in range(3):  # ATen ranks NaN highest too: same expert sets (row 3: ATen picks any three NaN)
            assert set(r.ids_TK[row].tolist()) == set(aten[row].tolist())
        assert r.ids_TK[0, 0] == 5 and r.ids_TK[1, :2].tolist() == [3, 7] and r.ids_TK[2, 0] == 4
        assert r.ids_TK[3].tolist() == [0, 1, 2]  # all NaN: by index
        if score == "softmax":  # a NaN logit makes its row's softmax NaN
            assert torch.isnan(r.weights_TK[:4]).all() and torch.isfinite(r.weights_TK[4:]).all()
        else:
            assert torch.isnan(r.weights_TK[0, 0]) and torch.isfinite(r.weights_TK[0, 1:]).all()
            assert torch.isfinite(r.weights_TK[4:]).all()


@pytest.mark.parametrize(
    "dtype, bits", [(torch.bfloat16, torch.int16), (torch.float16, torch.int16), (torch.float32, torch.int32)]
)
def test_nan_payload_and_sign_do_not_matter(dtype, bits):
    logits = torch.randn(4, 16).to(dtype)
    raw = logits.view(bits)
    quiet, low, high = (0x7FC0, 0x7F81, 0x7FFF) if dtype == torch.bfloat16 else (0x7E00, 0x7C01, 0x7FFF)
    if dtype == torch.float32:
        quiet, low, high = 0x7FC00000, 0x7F800001, 0x7FFFFFFF
    raw[0, 2], raw[0, 9], raw[0, 5] = low, high, quiet
    raw[1, 11] = high
    width = 16 if bits == torch.int16 else 32
    raw[1, 1] = (low | 1 << (width - 1)) - (1 << width)  # the same NaN with the sign bit set, as a signed integer
    r = moe_route(logits, 4, score="sigmoid")
    assert r.ids_TK[0, :3].tolist() == [2, 5, 9] and r.ids_TK[1, :2].tolist() == [1, 11]


def test_signed_zeros_and_infinities():
    logits = torch.tensor([[0.0, -0.0, 0.0, 1.0], [-float("inf"), 2.0, float("inf"), -0.0]])
    r = moe_route(logits, 3, score="sigmoid", renormalize=False)
    assert r.ids_TK.tolist() == [[3, 0, 1], [2, 1, 3]]  # -0.0 == +0.0: index order
    torch.testing.assert_close(r.weights_TK[1], torch.tensor([1.0, torch.sigmoid(torch.tensor(2.0)).item(), 0.5]))


def test_deepseek_v3_router_semantics():
    """Bias changes the choice only; node-limited routing keeps the experts of the best groups."""
    t, e = 16, 64
    logits = torch.randn(t, e)
    bias = torch.zeros(e)
    bias[:8] = 10.0  # group 0 gets chosen for every token, but the weights ignore the bias
    r = moe_route(logits, 8, score="sigmoid", bias_E=bias, route_scale=2.5, n_groups=8, topk_groups=2)
    assert (r.ids_TK < 8).sum(1).eq(8).all()  # the biased experts win the first 8 slots
    w = torch.sigmoid(logits).gather(1, r.ids_TK.long())
    torch.testing.assert_close(r.weights_TK, 2.5 * w / (w.sum(1, keepdim=True) + 1e-20), rtol=1e-5, atol=1e-6)
    r2 = moe_route(logits, 6, score="sigmoid", n_groups=8, topk_groups=2)
    groups = r2.ids_TK // 8
    assert all(len(set(g.tolist())) <= 2 for g in groups)


@pytest.mark.parametrize(
    "score, renorm, bias, groups",
    [
        ("softmax", True, False, None),
        ("softmax", False, False, None),
        ("sigmoid", True, True, (4, 2)),
        ("sigmoid", False, False, None),
        ("softmax", True, True, None),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_match_autograd_through_reference(score, renorm, bias, groups, dtype):
    x0 = torch.randn(23, 32).to(dtype)
    b = torch.randn(32) * 0.1 if bias else None
    ng, tg = groups or (None, None)
    g = torch.randn(23, 3)
    x = x0.clone().requires_grad_()
    r = moe_route(x, 3, score=score, renormalize=renorm, bias_E=b, route_scale=1.7, n_groups=ng, topk_groups=tg)
    r.weights_TK.backward(g)
    xr = x0.clone().requires_grad_()
    ref = moe_route_reference(xr, 3, score, renorm, b, 1.7, ng, tg)
    assert torch.equal(r.ids_TK, ref[1])
    ref[0].backward(g)
    assert x.grad.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(x.grad, xr.grad, **tol)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renorm", [True, False])
def test_backward_formula_matches_fp64_autograd(score, renorm):
    """The hand-written backward against autograd of the same weights in fp64 (chosen ids held fixed)."""
    x = torch.randn(7, 12, dtype=torch.float64, requires_grad=True)
    ids = moe_route_reference(x.detach(), 3, score, renorm)[1]
    s = torch.softmax(x, -1) if score == "softmax" else torch.sigmoid(x)
    w = s.gather(1, ids.long())
    if renorm:
        w = w / (w.sum(1, keepdim=True) + 1e-20)
    g = torch.randn(7, 3, dtype=torch.float64)
    (want,) = torch.autograd.grad(w * 1.3, x, g)
    got = moe_route_backward(g, x.detach(), ids, score, renorm, 1.3)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_ids_counts_and_permutation_carry_no_grad():
    x = torch.randn(6, 8, requires_grad=True)
    r = moe_route(x, 2, return_permutation=True)
    assert r.weights_TK.requires_grad
    for t in (r.ids_TK, r.counts_E, r.offsets_E, r.sorted_slots_S, r.slot_pos_TK):
        assert not t.requires_grad


def test_opcheck():
    x = torch.randn(9, 16, requires_grad=True)
    torch.library.opcheck(moe_route_op, (x, 3, "softmax", True, None, 1.0, None, None, True))
    torch.library.opcheck(moe_route_op, (x, 2, "sigmoid", True, torch.randn(16), 2.0, 4, 2, False))


def test_torch_compile_fullgraph_forward_and_backward():
    torch._dynamo.reset()

    def f(x, b):
        r = moe_route(x, 4, score="sigmoid", bias_E=b, n_groups=4, topk_groups=2, return_permutation=True)
        return (r.weights_TK * 2).sum(), r.counts_E, r.offsets_E, r.sorted_slots_S

    fn = torch.compile(f, fullgraph=True, backend="aot_eager")
    x = torch.randn(20, 32, requires_grad=True)
    b = torch.randn(32) * 0.1
    loss, counts, offsets, slots = fn(x, b)
    loss.backward()
    xr = x.detach().clone().requires_grad_()
    ref = moe_route_reference(xr, 4, "sigmoid", True, b, 1.0, 4, 2, True)
    (ref[0] * 2).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-6)
    assert torch.equal(counts, ref[2]) and torch.equal(offsets, ref[3]) and torch.equal(slots, ref[4])
    assert _last()["backend"] == "triton"


def test_torch_compile_inductor_fullgraph():
    torch._dynamo.reset()
    fn = torch.compile(lambda x: moe_route(x, 2).weights_TK * 3, fullgraph=True)
    x = torch.randn(12, 8)
    torch.testing.assert_close(fn(x), 3 * moe_route_reference(x, 2)[0], rtol=1e-5, atol=1e-6)


def test_compile_validates_at_trace_time():
    torch._dynamo.reset()
    fn = torch.compile(lambda x: moe_route(x, 9).weights_TK, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="larger than the number of experts"):
        fn(torch.randn(4, 8))


@pytest.mark.parametrize("perm", [False, True])
def test_deterministic_algorithms_same_result_and_all_outputs_written(perm, poisoned_outputs):
    logits = torch.randn(70, 60, dtype=torch.bfloat16)
    args = (logits, 6, "softmax", True, None, 1.0, None, None, perm)
    out0 = moe_route_op(*args)
    torch.use_deterministic_algorithms(True)  # outputs are NaN / INT_MAX poisoned (conftest.py): unwritten ones show
    try:
        DISPATCH_LOG.reset()
        out1 = moe_route_op(*args)
    finally:
        torch.use_deterministic_algorithms(False)
    assert _last()["backend"] == "triton"
    assert torch.isfinite(out1[0]).all()
    for a, b in zip(out0, out1, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda: (torch.randn(4, 8, dtype=torch.float64), 2, {}), "dtype torch.float64"),
        (lambda: (torch.randn(4, 32), 17, {}), "k=17 > 16"),
        (lambda: (torch.randn(2, 1100), 2, {}), "1100 experts > 1024"),
        (lambda: (torch.randn(16, 4).t(), 2, {}), "last dim not contiguous"),
        (lambda: (torch.randn(4, 128), 2, dict(n_groups=64, topk_groups=4)), "64 groups > 32"),
        (lambda: (torch.randn(4, 8), 2, dict(bias_E=torch.randn(8, dtype=torch.float64))), "bias dtype"),
    ],
)
def test_unsupported_inputs_fall_back_with_reason(make, reason):
    x, k, kw = make()
    r = moe_route(x, k, **kw)
    rec = _last()
    assert rec["backend"] == "aten" and rec["fallback"] and reason in rec["reason"]
    ref = moe_route_reference(x, k, "softmax", True, kw.get("bias_E"), 1.0, kw.get("n_groups"), kw.get("topk_groups"))
    assert torch.equal(r.ids_TK, ref[1]) and torch.equal(r.counts_E, ref[2])


def test_disabled_op_runs_aten_with_reason():
    with dispatch_config(disabled_ops={"moe_route"}):
        moe_route(torch.randn(3, 8), 2)
    rec = _last()
    assert rec["backend"] == "aten" and "op disabled by policy" in rec["reason"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(k=9), "larger than the number of experts"),
        (dict(k=0), "k must be >= 1"),
        (dict(k=2.0), "k must be an int"),
        (dict(k=2, score="relu"), "score must be one of"),
        (dict(k=2, bias_E=torch.randn(7)), r"bias must have shape \[8\]"),
        (dict(k=2, bias_E=torch.randn(8, 1)), r"bias must have shape \[8\]"),
        (dict(k=2, bias_E=torch.ones(8, dtype=torch.int32)), "bias must be floating"),
        (dict(k=2, n_groups=3, topk_groups=1), "must be >= 1 and divide"),
        (dict(k=2, n_groups=4), "given together"),
        (dict(k=2, n_groups=8, topk_groups=1), "groups need >= 2 experts"),
        (dict(k=2, n_groups=2, topk_groups=3), r"topk_groups must be in \[1, n_groups=2\]"),
        (dict(k=5, n_groups=4, topk_groups=2), "larger than the 4 experts of 2 groups"),
        (dict(k=2, route_scale=float("nan")), "route_scale must be finite"),
        (dict(k=2, route_scale=1e300), "route_scale must be finite in fp32"),
        (dict(k=2, n_groups=4, topk_groups=2.0), "topk_groups must be an int"),
        (dict(k=2, n_groups=True, topk_groups=1), "n_groups must be an int"),
    ],
)
def test_invalid_arguments_raise_before_dispatch(kwargs, match):
    with pytest.raises(ValueError, match=match):
        moe_route(torch.randn(4, 8), **kwargs)
    assert DISPATCH_LOG.records() == []


def test_a_valid_call_does_not_let_a_later_invalid_one_through():
    """Validation runs once per signature, so the signature holds every argument it checks."""
    x = torch.randn(4, 8)
    moe_route(x, 2, route_scale=1.0)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="route_scale must be finite"):
            moe_route(x, 2, route_scale=bad)


def test_each_new_bias_shape_is_validated():
    x = torch.randn(4, 8)
    moe_route(x, 2, bias_E=torch.zeros(8))
    with pytest.raises(ValueError, match="bias must have shape"):
        moe_route(x, 2, bias_E=torch.zeros(7))


def test_eager_fast_path_matches_the_custom_op():
    x = torch.randn(30, 24)
    fast = moe_route(x, 3, return_permutation=True)  # plain tensors, no grad: dispatched without the op wrapper
    op = moe_route_op(x, 3, "softmax", True, None, 1.0, None, None, True)
    assert all(torch.equal(a, b) for a, b in zip(fast, op, strict=True))
    assert _last()["backend"] == "triton" and _last()["calls"] == 2


def test_invalid_logits_raise():
    with pytest.raises(ValueError, match="must be 2-D"):
        moe_route(torch.randn(2, 3, 8), 2)
    with pytest.raises(ValueError, match="must be floating"):
        moe_route(torch.ones(4, 8, dtype=torch.int64), 2)
