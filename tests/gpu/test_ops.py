"""The operators on a real GPU, through the public API: numerics against fp64 references over edge-case shapes, the
backend that served each call (from the dispatch log), gradients against ATen, CUDA-graph capture with new inputs,
``torch.compile(fullgraph=True)``, forward-mode AD and ``torch.func``, double backward, and the MoE transform's probe
on CUDA. What the CPU tests (Triton interpreter) cannot show: the compiled kernels on the device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fly_lightning
from fly_lightning import DISPATCH_LOG
from fly_lightning.ops.moe_combine import moe_combine_reference
from fly_lightning.ops.rms_norm import rms_norm_reference
from fly_lightning.ops.swiglu import swiglu_reference
from fly_lightning.policy import dispatch_config

pytestmark = pytest.mark.gpu


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _backend(op: str) -> str:
    """The backend of the op's latest decision (the dispatch log starts empty in every test)."""
    return DISPATCH_LOG.records(op)[-1]["backend"]


RMS_CASES = [
    ((0, 4096), torch.bfloat16),
    ((1, 1), torch.float32),
    ((7, 4097), torch.bfloat16),
    ((3, 5, 8192), torch.float16),
    ((2, 40000), torch.float32),
    ((33, 100), torch.bfloat16),
    ((4096, 5120), torch.bfloat16),
    ((17, 2051), torch.float16),
]


@pytest.mark.parametrize("shape, dtype", RMS_CASES, ids=[f"{'x'.join(map(str, s))}-{str(d)[6:]}" for s, d in RMS_CASES])
@pytest.mark.parametrize("offset, cast", [(0.0, False), (1.0, False), (0.0, True)], ids=["plain", "gemma", "llama"])
def test_rms_norm_numerics_and_backend(shape, dtype, offset, cast):
    x = torch.randn(shape, device="cuda", dtype=dtype) * 3
    w = torch.randn(shape[-1], device="cuda", dtype=dtype)
    y = fly_lightning.rms_norm(x, w, 1e-6, offset=offset, cast_before_scale=cast)
    assert y.shape == x.shape
    if x.numel() == 0:
        return
    # the first call per tuning key runs the autotuner, later ones the picked configuration directly
    assert torch.equal(fly_lightning.rms_norm(x, w, 1e-6, offset=offset, cast_before_scale=cast), y)
    if cast:
        ref = rms_norm_reference(x.double(), None, 1e-6)[0].to(dtype).double() * (w.double() + offset)
    else:
        ref = rms_norm_reference(x.double(), w.double() + offset, 1e-6)[0]
    assert _rel(y, ref) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert _backend("rms_norm") == "triton"


def test_rms_norm_strided_rows():
    x = torch.randn(64, 6000, device="cuda", dtype=torch.bfloat16)[:, :4097]
    w = torch.randn(4097, device="cuda", dtype=torch.bfloat16)
    y = fly_lightning.rms_norm(x, w, 1e-6)
    assert _rel(y, rms_norm_reference(x.double(), w.double(), 1e-6)[0]) < 1e-2
    assert _backend("rms_norm") == "triton"


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_rms_norm_gradients_equal_aten(dtype, tol):
    x0 = torch.randn(64, 4097, device="cuda", dtype=dtype)
    w0 = torch.randn(4097, device="cuda", dtype=dtype)
    g = torch.randn_like(x0)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    fly_lightning.rms_norm(x, w, 1e-6).backward(g)
    xr, wr = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    F.rms_norm(xr, (4097,), wr, 1e-6).backward(g)
    assert _rel(x.grad, xr.grad) < tol and _rel(w.grad, wr.grad) < tol


# The Llama cast takes the fused ATen backward when x and w share a dtype (bf16 weights, or fp32 x where the cast is a
# no-op); bf16 x with an fp32 weight keeps the composite formula
@pytest.mark.parametrize(
    "dtype, wdtype, offset, cast",
    [
        (torch.float32, torch.float32, 0.0, True),
        (torch.float32, torch.float32, 1.0, False),
        (torch.bfloat16, torch.float32, 0.0, True),
        (torch.bfloat16, torch.bfloat16, 0.0, True),
    ],
)
def test_rms_norm_variant_gradients_equal_the_composite_formula(dtype, wdtype, offset, cast):
    x0 = torch.randn(8, 33, 1024, device="cuda", dtype=dtype)
    w0 = torch.randn(1024, device="cuda", dtype=wdtype)
    g = torch.randn(8, 33, 1024, device="cuda", dtype=torch.promote_types(dtype, wdtype) if cast else dtype)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    fly_lightning.rms_norm(x, w, 1e-6, offset=offset, cast_before_scale=cast).backward(g)
    xd, wd = x0.double().requires_grad_(), w0.double().requires_grad_()
    rms_norm_reference(xd, wd, 1e-6, offset=offset, cast_before_scale=cast)[0].backward(g.double())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert _rel(x.grad, xd.grad) < tol and _rel(w.grad, wd.grad) < tol


def test_rms_norm_cuda_graph_replay_with_new_input():
    x = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    fly_lightning.rms_norm(x, w, 1e-6)  # decide and compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fly_lightning.rms_norm(x, w, 1e-6)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(y, rms_norm_reference(x.double(), w.double(), 1e-6)[0]) < 1e-2


@pytest.mark.parametrize("left_to_inductor", [False, True])
def test_rms_norm_compiled_fullgraph_forward_backward(left_to_inductor):
    torch._dynamo.reset()
    fn = torch.compile(lambda x, w: (fly_lightning.rms_norm(x, w, 1e-6) * 2).sum(), fullgraph=True)
    x = torch.randn(256, 2048, device="cuda", requires_grad=True)
    w = torch.randn(2048, device="cuda", requires_grad=True)
    with dispatch_config(inductor_ops={"rms_norm"} if left_to_inductor else ()):
        fn(x, w).backward()
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    (F.rms_norm(xr, (2048,), wr, 1e-6) * 2).sum().backward()
    assert _rel(x.grad, xr.grad) < 1e-4 and _rel(w.grad, wr.grad) < 1e-4
    assert _backend("rms_norm") == ("inductor" if left_to_inductor else "triton")


COMBINE_CASES = [(8192, 8, 2048, True), (4096, 2, 4096, True), (300, 1, 4097, False), (1000, 6, 1408, True),
                 (1, 8, 8, False)]  # fmt: skip
COMBINE_DTYPES = [(torch.bfloat16, None), (torch.bfloat16, torch.float32), (torch.float16, None),
                  (torch.float32, None)]  # fmt: skip


@pytest.mark.parametrize("t, k, h, index", COMBINE_CASES)
@pytest.mark.parametrize("dtype, out", COMBINE_DTYPES, ids=["bf16", "bf16-to-fp32", "fp16", "fp32"])
def test_moe_combine_numerics_and_backend(t, k, h, index, dtype, out):
    """Index or slot order, k 1..8, aligned and odd H, output dtypes."""
    rows = torch.randn(t * k, h, device="cuda", dtype=dtype)
    w = torch.rand(t, k, device="cuda")
    idx = torch.randperm(t * k, device="cuda").int() if index else None
    y = fly_lightning.moe_combine(rows, w, idx, out_dtype=out)
    assert _backend("moe_combine") == "triton"
    assert y.dtype == (out or dtype)
    err = _rel(y, moe_combine_reference(rows.double(), w.double(), idx))
    assert err < (1e-6 if (out or dtype) == torch.float32 else 4e-3)


@pytest.mark.parametrize("out", [None, torch.float32], ids=["bf16-out", "fp32-out"])
def test_moe_combine_backward_against_fp64_autograd(out):
    """The ATen backward (bmm with fp32 output on CUDA) against fp64 autograd of the reference."""
    rows = torch.randn(8192 * 8, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(8192, 8, device="cuda", requires_grad=True)
    idx = torch.randperm(8192 * 8, device="cuda").int()
    g = torch.randn(8192, 2048, device="cuda", dtype=out or torch.bfloat16)
    fly_lightning.moe_combine(rows, w, idx, out_dtype=out).backward(g)
    r64, w64 = rows.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    moe_combine_reference(r64, w64, idx).backward(g.double())
    assert _rel(rows.grad, r64.grad) < 4e-3
    assert _rel(w.grad, w64.grad) < 1e-5 and w.grad.dtype == w.dtype


@pytest.mark.parametrize("s, i", [(65536, 768), (4096, 14336), (77, 1000), (5, 3)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_swiglu_numerics_and_backend_one_rounding(s, i, dtype):
    """Fused [S, 2I] and two tensors give the same bits; 16-bit outputs are the fp32 math rounded once."""
    hid = torch.randn(s, 2 * i, device="cuda", dtype=dtype) * 3
    y = fly_lightning.swiglu(hid)
    y2 = fly_lightning.swiglu(hid[:, :i].contiguous(), hid[:, i:].contiguous())
    assert _backend("swiglu") == "triton"
    assert torch.equal(y, y2)
    ref = swiglu_reference(hid, None)  # 16-bit: fp32 math rounded once, equal but for exp's last bit
    if dtype != torch.float32:
        assert (y != ref).float().mean().item() <= 0.01
    assert _rel(y, swiglu_reference(hid.double(), None)) <= (1e-6 if dtype == torch.float32 else 4e-3)


def test_swiglu_and_moe_combine_graph_compile_and_gradients():
    t, k, h, i = 512, 4, 1024, 256
    hid = torch.randn(t * k, 2 * i, device="cuda", dtype=torch.bfloat16)
    down = torch.randn(i, h, device="cuda", dtype=torch.bfloat16) / 16
    w = torch.rand(t, k, device="cuda")
    idx = torch.randperm(t * k, device="cuda").int()
    f = lambda a, b, c, d: fly_lightning.moe_combine(fly_lightning.swiglu(a) @ b, c, d, out_dtype=torch.float32)
    f(hid, down, w, idx)  # decide and compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = f(hid, down, w, idx)
    hid.copy_(torch.randn_like(hid))
    idx.copy_(torch.randperm(t * k, device="cuda").int())
    graph.replay()
    torch.cuda.synchronize()
    ref = moe_combine_reference((swiglu_reference(hid, None) @ down).double(), w.double(), idx)
    assert _rel(y, ref) <= 1e-5, "graph replay with new inputs"
    torch._dynamo.reset()
    grads = {}
    for name, backends, compiled, inductor in (
        ("compiled", ("triton",), True, ()),
        ("inductor", ("triton",), True, ("swiglu", "moe_combine")),
        ("eager", ("triton",), False, ()),
        ("aten", ("aten",), False, ()),
    ):
        torch._dynamo.reset()
        a, c = hid.clone().requires_grad_(), w.clone().requires_grad_()
        with fly_lightning.dispatch_config(backends=backends, inductor_ops=inductor):
            fn = torch.compile(f, fullgraph=True) if compiled else f
            fn(a, down, c, idx).square().sum().backward()
        grads[name] = (a.grad, c.grad)
    same = [_rel(x, y) for x, y in zip(grads["compiled"], grads["eager"], strict=True)]
    near = [_rel(x, y) for name in ("aten", "inductor") for x, y in zip(grads["compiled"], grads[name], strict=True)]
    # the kernels round swiglu once, ATen twice: bf16-level differences against ATen, none against eager kernels;
    # Inductor's code for the plain forms rounds once too, in its own order
    assert max(same) <= 1e-5, f"compiled vs eager gradients {same}"
    assert max(near) <= 2e-2, f"compiled vs ATen / Inductor gradients {near}"


def _aten_gates(z: torch.Tensor) -> torch.Tensor:
    top, _ = torch.topk(z.softmax(-1), 2, dim=-1)
    return top / top.sum(-1, keepdim=True)


FORWARD_AD_CASES = {  # op: (ours, ATen's formula, input shape)
    "rms_norm": (lambda a, w: fly_lightning.rms_norm(a, w, 1e-6), lambda a, w: F.rms_norm(a, (256,), w, 1e-6)),
    "swiglu": (lambda a, w: fly_lightning.swiglu(a), lambda a, w: F.silu(a[:, :128]) * a[:, 128:]),
    "topk": (lambda a, w: fly_lightning.topk(a, 4).values, lambda a, w: torch.topk(a, 4).values),
    "moe_route": (lambda a, w: fly_lightning.moe_route(a, 2).weights_TK, lambda a, w: _aten_gates(a)),
}


@pytest.mark.parametrize("op", list(FORWARD_AD_CASES))
def test_forward_mode_ad_and_torch_func_run_the_aten_formulas(op):
    """The Triton outputs carry no tangent: forward_ad, torch.func.jvp and torch.func.grad must run the reference,
    with the fallback recorded; a plain call afterwards still runs the kernel."""
    import torch.autograd.forward_ad as fwAD

    ours_w, aten_w = FORWARD_AD_CASES[op]
    w = torch.randn(256, device="cuda")
    ours, aten = (lambda a: ours_w(a, w)), (lambda a: aten_w(a, w))
    inp = torch.randn(512, 8, device="cuda") if op == "moe_route" else torch.randn(64, 256, device="cuda")
    tangent = torch.randn_like(inp)
    _, want = torch.func.jvp(aten, (inp,), (tangent,))
    with fwAD.dual_level():
        got = fwAD.unpack_dual(ours(fwAD.make_dual(inp, tangent))).tangent
    assert got is not None, "no tangent under forward_ad"
    _, got_func = torch.func.jvp(ours, (inp,), (tangent,))
    grad = torch.func.grad(lambda a: ours(a).square().sum())(inp)
    grad_want = torch.func.grad(lambda a: aten(a).square().sum())(inp)
    errs = [_rel(got, want), _rel(got_func, want), _rel(grad, grad_want)]
    assert max(errs) <= 1e-5, f"rel errs (forward_ad, jvp, grad) {errs}"
    reasons = [r["reason"] for r in DISPATCH_LOG.records(op) if "the reference runs" in r["reason"]]
    assert len(reasons) == 3, reasons
    DISPATCH_LOG.reset()
    ours(inp)
    assert _backend(op) == "triton", "a plain call after forward AD"


def _double_backward_cases():
    x = torch.randn(64, 256, device="cuda")
    w = torch.randn(256, device="cuda")
    idx = torch.randperm(128, device="cuda").int()
    return {  # op: (ours, ATen's formula, inputs)
        "rms_norm": (
            lambda a, b: fly_lightning.rms_norm(a, b, 1e-6),
            lambda a, b: F.rms_norm(a, (256,), b, 1e-6),
            (x, w),
        ),
        "swiglu": (lambda a: fly_lightning.swiglu(a), lambda a: F.silu(a[:, :128]) * a[:, 128:], (x,)),
        "moe_combine": (
            lambda r, c: fly_lightning.moe_combine(r, c, idx, out_dtype=torch.float32),
            lambda r, c: (r[idx.long()].view(64, 2, 256) * c.unsqueeze(-1)).sum(1),
            (torch.randn(128, 256, device="cuda"), torch.rand(64, 2, device="cuda")),
        ),
    }


@pytest.mark.parametrize("op", ["rms_norm", "swiglu", "moe_combine"])
def test_double_backward_gives_the_second_derivatives_of_the_aten_formulas(op):
    """The forward runs the Triton kernel; the differentiable first gradient comes from the reference."""
    ours, aten, inputs = _double_backward_cases()[op]
    got, want = [], []
    for f, out in ((ours, got), (aten, want)):
        leaves = [t.clone().requires_grad_() for t in inputs]
        (g,) = torch.autograd.grad(f(*leaves).square().sum(), leaves[0], create_graph=True)
        out += torch.autograd.grad(g.square().sum(), leaves, allow_unused=True)
    errs = [_rel(a, b) for a, b in zip(got, want, strict=True) if b is not None]
    assert _backend(op) == "triton"
    assert max(errs) <= 1e-5, errs


def test_moe_transform_probe_swaps_real_blocks_and_leaves_a_look_alike():
    """The transform's probe runs the original block and the replacement's reference on the GPU: correct blocks must
    pass it whatever the fp32 matmul precision (Lightning users set "high": TF32) and in bf16; a block with other math
    (a sigmoid router in Qwen3's block) must not."""
    transformers = pytest.importorskip("transformers")
    from torch import nn
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = transformers.Qwen3MoeConfig(hidden_size=256, moe_intermediate_size=128, num_experts=16,
                                      num_experts_per_tok=4, norm_topk_prob=True)  # fmt: skip

    class Probed(Qwen3MoeSparseMoeBlock):  # a class the transform does not list: it is probed before the swap
        pass

    def block(dtype: torch.dtype) -> nn.Module:
        torch.manual_seed(0)
        b = Probed(cfg).to("cuda", dtype)
        with torch.no_grad():
            for p in b.parameters():
                p.normal_(0, 0.05)
        return b

    def sigmoid_router(gate, x):  # Qwen3's router with sigmoid scores instead of softmax: same state, other math
        logits = F.linear(x.reshape(-1, x.shape[-1]), gate.weight)
        w, ids = torch.topk(torch.sigmoid(logits.float()), gate.top_k, dim=-1)
        return logits, (w / w.sum(-1, keepdim=True)).to(logits.dtype), ids

    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        for dtype in (torch.float32, torch.bfloat16):
            summary = fly_lightning.transform(nn.ModuleDict({"mlp": block(dtype)}))
            assert [m for _, _, m in summary.swapped] == ["moe:hf_v5"], f"{dtype}: {summary.left}"
        look_alike = block(torch.float32)
        look_alike.gate.forward = lambda x, g=look_alike.gate: sigmoid_router(g, x)
        summary = fly_lightning.transform(nn.ModuleDict({"mlp": look_alike}))
        assert not summary.swapped
        assert summary.left[0][2].startswith("probe: the swapped block computes something else"), summary
    finally:
        torch.set_float32_matmul_precision(previous)


def test_routing_and_split_k_gemm_share_the_zeroed_workspace():
    """Routing's counting tails and the split-K MX GEMM's arrival counters use one zeroed workspace per stream, which
    each launch leaves zero: interleaved eager calls, and both captured in one graph replayed with new inputs, give
    the eager results (routing exactly), and the workspace is zero after."""
    from fly_lightning.kernels.triton import _workspace
    from fly_lightning.ops.moe_route import moe_route_reference

    logits = torch.randn(4096, 64, device="cuda")
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    b, bs = fly_lightning.mx_cast(torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16), "mxfp4_e2m1")

    def step():
        r = fly_lightning.moe_route(logits, 4, return_permutation=True)
        with torch.no_grad():
            y = fly_lightning.mx_scaled_mm(x, b, bs, "mxfp4_e2m1")  # 16 rows: the split-K plan
        return r, y, fly_lightning.moe_route(logits, 2, score="sigmoid")

    def same(got, want):
        eq = lambda g, w: (g is None and w is None) or torch.equal(g, w)  # noqa: E731
        (r, y, r2), (wr, wy, wr2) = got, want
        assert all(eq(g, w) for g, w in zip((*r, *r2), (*wr, *wr2), strict=True)) and torch.equal(y, wy)

    first = step()
    assert _backend("moe_route") == "triton" and _backend("mx_scaled_mm") == "triton"
    ref = moe_route_reference(logits, 4, return_permutation=True)  # a plain tuple, in MoERouting's order
    assert torch.equal(first[0].ids_TK, ref[1]) and torch.equal(first[0].counts_E, ref[2])
    for _ in range(3):
        same(step(), first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    logits.copy_(torch.randn_like(logits))
    x.copy_(torch.randn_like(x))
    want = step()  # eager, between capture and replay, on the same stream
    graph.replay()
    torch.cuda.synchronize()
    same(captured, want)
    assert not any(ws.any() for ws in _workspace._WORKSPACES.values())
