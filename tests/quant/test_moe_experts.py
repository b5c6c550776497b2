"""``FlyMXConfig`` on a swapped MoE block: the experts take MX forward numerics (``FlyMoE.mx``) through ``quantize_``,
equal to a pure-torch oracle built on ``formats`` (torchao-exact casts) with straight-through gradients, in every
expert layout with SwiGLU and GeGLU; the output head and routers stay in high precision under ``mx_filter``; blocks
with dims that do not hold whole MX blocks are left with a warning."""

import dataclasses
import logging

import pytest
import torch
from torch import nn

import fly_lightning
from fly_lightning import FlyMXConfig, mx_filter
from fly_lightning.modules.moe import FlyMoE
from fly_lightning.modules.moe_layout import LAYOUTS
from fly_lightning.ops.moe_route import moe_route_reference
from fly_lightning.ops.swiglu import split_gate_up, swiglu_reference
from fly_lightning.quant import formats

logging.getLogger("torchao").setLevel(logging.ERROR)
quantize_ = pytest.importorskip("torchao.quantization").quantize_
H, INTER, E, K, T = 64, 32, 4, 2, 24


def _moe(layout: str = "hf", activation: str = "silu") -> FlyMoE:
    torch.manual_seed(0)
    moe = FlyMoE(H, INTER, E, K, layout=layout, activation=activation)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe


def _rounded(t: torch.Tensor, fmt: str | None, mode: str) -> torch.Tensor:
    """The MX round trip along the last dim on the reference casts (``formats``), outside the graph."""
    if fmt is None:
        return t.detach()
    return formats.from_mx(*formats.to_mx(t.detach(), fmt, mode), fmt, dtype=t.dtype)


def _mx_product(a: torch.Tensor, w_KN: torch.Tensor, a_fmt: str | None, w_fmt: str, mode: str) -> torch.Tensor:
    """``a @ w`` on the MX grid (both operands cast along K) whose gradients are the bf16 product's on ``a`` and the
    master ``w``: straight through the casts, as ``FlyMXLinear``'s backward."""
    exact = a @ w_KN
    mx = _rounded(a, a_fmt, mode) @ _rounded(w_KN.t(), w_fmt, mode).t()
    return exact + (mx - exact).detach()


def _oracle(moe: FlyMoE, x: torch.Tensor, w_fmt: str, a_fmt: str | None, mode: str) -> torch.Tensor:
    """The block's math with every expert GEMM operand cast along its contraction dim, an expert loop in fp32."""
    weights, ids, *_ = moe_route_reference(moe.router_logits(x), K, moe.score_func, moe.norm_topk_prob, None, 1.0)
    gate_up, up, down = moe.experts.projections()
    y = torch.zeros_like(x)
    for e in range(E):
        tok, slot = torch.where(ids == e)
        xe = x[tok]
        u = None if up is None else _mx_product(xe, up[e], a_fmt, w_fmt, mode)  # separate gate and up weights
        gate, u = split_gate_up(_mx_product(xe, gate_up[e], a_fmt, w_fmt, mode), u)
        h = swiglu_reference(gate, u, moe.activation)
        y = y.index_add(0, tok, _mx_product(h, down[e], a_fmt, w_fmt, mode) * weights[tok, slot].unsqueeze(1))
    return y


@pytest.mark.parametrize(
    "config", [FlyMXConfig(), FlyMXConfig(activation=None), FlyMXConfig("mxfp4_e2m1", "mxfp4_e2m1", "rceil")]
)
@pytest.mark.parametrize("preference", ["auto", "mx_gemm"])
def test_experts_match_the_oracle_forward_and_backward(config, preference):
    """Both forms (``auto`` is the emulated one here: no native MX backend on the CPU; ``mx_gemm`` casts and runs
    ``mx_grouped_mm``) against the oracle, forward and gradients."""
    config = dataclasses.replace(config, kernel_preference=preference)
    moe = _moe()
    quantize_(moe, config, filter_fn=mx_filter)
    assert moe.mx is not None and "mx=MXExperts" in repr(moe)
    fly_lightning.DISPATCH_LOG.reset()
    ref = _moe()
    x = torch.randn(T, H, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    y, y_ref = moe(x), _oracle(ref, xr, config.weight, config.activation, config.spec.mode)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    ops = {r["op"] for r in fly_lightning.DISPATCH_LOG.records()}
    assert ("mx_grouped_mm" in ops) == (preference == "mx_gemm") and ("mx_fake_quantize" in ops) != (
        preference == "mx_gemm"
    )
    unquantized = _moe()(x.detach())
    assert (y - unquantized).abs().max() > 1e-3  # the casts changed the numbers (the test would see no cast)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-5)
    for (name, p), p_ref in zip(moe.named_parameters(), ref.parameters(), strict=True):  # sums over tokens: 1e-4
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("preference", ["auto", "mx_gemm"])
@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_expert_layout_and_activation_matches_the_oracle(layout, activation, preference):
    """Each family's expert storage (Hugging Face, Mixtral / Qwen per-expert lists, torchtitan K-major and legacy,
    transposed, DBRX) with SwiGLU and GeGLU experts, through ``quantize_``: forward and input gradient as the oracle
    on the block's own projections."""
    moe, ref = _moe(layout, activation), _moe(layout, activation)
    quantize_(moe, FlyMXConfig(kernel_preference=preference), filter_fn=mx_filter)
    assert moe.mx is not None
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2), requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    y, y_ref = moe(x), _oracle(ref, xr, "mxfp8_e4m3", "mxfp8_e4m3", "rceil")
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=3e-5)  # fp32 sums in other orders
    assert (y - ref(x.detach())).abs().max() > 1e-3  # the casts changed the numbers
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-4)  # sums over experts and H


@pytest.mark.parametrize("layout", ["torchtitan", "mixtral"])  # K-major [E, K, N] masters; separate gate and up
def test_the_mx_gemm_form_equals_the_emulated_one_in_other_expert_layouts(layout):
    """The two forms multiply the same MX values: equal up to summation order, forward and gradients."""
    moe = {p: _moe(layout) for p in ("emulated", "mx_gemm")}
    x = {p: torch.randn(T, H, generator=torch.Generator().manual_seed(1)).requires_grad_() for p in moe}
    y = {}
    for p, m in moe.items():
        quantize_(m, FlyMXConfig(kernel_preference=p), filter_fn=mx_filter)
        y[p] = m(x[p])
        y[p].backward(torch.ones_like(y[p]))
    torch.testing.assert_close(y["mx_gemm"], y["emulated"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x["mx_gemm"].grad, x["emulated"].grad, rtol=1e-5, atol=1e-5)
    for a, b in zip(moe["mx_gemm"].parameters(), moe["emulated"].parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "preference, backend", [("emulated", "aot_eager"), ("mx_gemm", "aot_eager"), ("emulated", "inductor")]
)
def test_both_forms_under_torch_compile(preference, backend):
    """Forward and input gradient as eager, through AOTAutograd and through Inductor's code (the custom ops opaque
    to it, the glue around them generated)."""
    torch._dynamo.reset()
    moe = _moe()
    quantize_(moe, FlyMXConfig(kernel_preference=preference), filter_fn=mx_filter)
    x = torch.randn(T, H, requires_grad=True)
    y = moe(x)
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, g)
    yc = torch.compile(moe, backend=backend)(x)
    (gxc,) = torch.autograd.grad(yc, x, g)
    # Inductor's generated CPU code sums fp32 in its own order (by the host's vector width): a few ulps apart
    tol = 1e-5 if backend == "inductor" else 1e-6
    torch.testing.assert_close(yc, y, rtol=tol, atol=tol)
    torch.testing.assert_close(gxc, gx, rtol=tol, atol=tol)


def test_both_forms_quantise_autocast_values_under_autocast(monkeypatch):
    """bf16-mixed with fp32 masters: both forms cast tokens and masters to bf16 before the MX casts (as
    ``FlyMXLinear``), so they quantise the same values (quantising the fp32 values in one form and their bf16
    roundings in the other had differed by 5%); the block's output keeps the input's dtype."""
    from fly_lightning.modules import moe_mx

    seen = []
    for fn in ("act", "weight"):
        original = getattr(moe_mx.MXExperts, fn)
        monkeypatch.setattr(moe_mx.MXExperts, fn, lambda self, t, f=original: seen.append(t.dtype) or f(self, t))
    cast = moe_mx.mx_cast
    monkeypatch.setattr(moe_mx, "mx_cast", lambda t, *a, **k: seen.append(t.dtype) or cast(t, *a, **k))
    x = torch.randn(T, H)
    y = {}
    for p in ("emulated", "mx_gemm"):
        moe = _moe()
        quantize_(moe, FlyMXConfig(kernel_preference=p), filter_fn=mx_filter)
        seen.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y[p] = moe(x)
        assert y[p].dtype == torch.float32 and len(seen) >= 4 and set(seen) == {torch.bfloat16}, (p, seen)
    rel = ((y["mx_gemm"] - y["emulated"]).norm() / y["emulated"].norm()).item()
    assert rel < 0.04, rel  # the same MX values; bf16 GEMM outputs rounded apart in each form, through SwiGLU


def test_the_filter_keeps_the_head_and_routers_in_high_precision():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.moe, self.lm_head = nn.Linear(H, H), _moe(), nn.Linear(H, 64)

    net = Net()
    quantize_(net, FlyMXConfig(), filter_fn=mx_filter)
    assert type(net.proj).__name__ == "FlyMXLinear" and type(net.lm_head) is nn.Linear
    assert net.moe.mx is not None and type(net.moe.gate) is not type(net.proj)


def test_blocks_without_whole_mx_blocks_are_left_with_a_warning():
    torch.manual_seed(0)
    moe = FlyMoE(H, 24, E, K)  # intermediate 24: not a multiple of 32
    with pytest.warns(UserWarning, match="intermediate 24 not a multiple of 32"):
        quantize_(moe, FlyMXConfig(), filter_fn=mx_filter)
    assert moe.mx is None


@pytest.mark.parametrize("preference", ["emulated", "mx_gemm"])
def test_training_keeps_no_rounded_weight_copy_for_the_backward(preference):
    """The backward reads the masters (parameters) and the projections' inputs: the tensors a quantized block saves
    beside its parameters are the unquantized block's (the MX GEMM form: plus its expert-ordered rows, which the
    fused gather of the other paths never materialises), not a rounded copy of every expert weight."""

    def saved_bytes(moe: FlyMoE, x: torch.Tensor) -> int:
        storages = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            moe(x)
        params = {p.untyped_storage().data_ptr() for p in moe.parameters()}
        return sum(n for ptr, n in storages.items() if ptr not in params)

    def block() -> FlyMoE:  # experts far larger than the activations: a copy of their weights would show
        torch.manual_seed(0)
        return FlyMoE(H, 128, 16, K)

    x = torch.randn(T, H, requires_grad=True)
    plain = saved_bytes(block(), x)
    moe = block()
    quantize_(moe, FlyMXConfig(kernel_preference=preference), filter_fn=mx_filter)
    rows = T * K * H * x.element_size() if preference == "mx_gemm" else 0
    weights = sum(p.numel() * p.element_size() for p in moe.experts.parameters())
    assert plain + rows < weights / 8
    assert saved_bytes(moe, x) <= plain + rows
