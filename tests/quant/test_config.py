"""``FlyMXConfig`` through torchao's ``quantize_``: which Linears are swapped, the parameters shared (state dict
unchanged), an MX forward through the dispatched ops in either GEMM form, the straight-through backward in the
weights' precision."""

import copy
import dataclasses
import logging
import sys

import pytest
import torch
from torch import nn

import fly_lightning
from fly_lightning import FlyMXConfig
from fly_lightning.quant import formats
from fly_lightning.quant.linear import FlyMXLinear, MXSpec

logging.getLogger("torchao").setLevel(logging.ERROR)
quantize_ = pytest.importorskip("torchao.quantization").quantize_


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 40), nn.Linear(40, 8, bias=False))


def test_swaps_linears_with_whole_blocks_and_warns_about_the_rest():
    model = _model()
    keys = {k: v for k, v in model.state_dict().items()}
    with pytest.warns(UserWarning, match=r"Linear\(40, 8\) left in high precision"):
        quantize_(model, FlyMXConfig())
    assert [type(m).__name__ for m in model] == ["FlyMXLinear", "ReLU", "FlyMXLinear", "Linear"]
    state = model.state_dict()
    assert state.keys() == keys.keys() and all(state[k] is keys[k] or torch.equal(state[k], keys[k]) for k in keys)
    quantize_(model, FlyMXConfig())  # again: nothing changes
    assert type(model[0]) is FlyMXLinear and model[0].weight.data_ptr() == keys["0.weight"].data_ptr()


@pytest.mark.parametrize(
    "config, tol",
    # two stacked layers: each cast rounds to 3 (e4m3) or 1 (e2m1) mantissa bits
    [(FlyMXConfig(), 0.1), (FlyMXConfig(activation=None), 0.08), (FlyMXConfig("mxfp4_e2m1", "mxfp4_e2m1"), 0.35),
     (FlyMXConfig(mode="floor"), 0.1)],
)  # fmt: skip
@pytest.mark.parametrize("preference", ["emulated", "mx_gemm"])
def test_forward_in_mx_backward_straight_through(config, tol, preference):
    config = dataclasses.replace(config, kernel_preference=preference)
    ref = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 32))
    model = copy.deepcopy(ref)
    quantize_(model, config)
    x = torch.randn(2, 7, 64)
    y, y_ref = model(x), ref(x)
    rel = ((y - y_ref).norm() / y_ref.norm()).item()
    assert y.shape == y_ref.shape and 0 < rel < tol, rel
    # backward: the high-precision formulas at the forward's inputs (straight through the casts)
    g = torch.randn_like(y)
    xl = x.clone().requires_grad_()
    model(xl).backward(g)
    h = model[0](x).detach()
    assert torch.allclose(model[1].weight.grad, g.reshape(-1, 32).t() @ h.reshape(-1, 96), rtol=1e-5, atol=1e-5)
    assert torch.allclose(model[1].bias.grad, g.reshape(-1, 32).sum(0), rtol=1e-5, atol=1e-5)
    grad_h = g @ model[1].weight
    assert torch.allclose(xl.grad, grad_h @ model[0].weight, rtol=1e-4, atol=1e-5)
    ops = {r["op"] for r in fly_lightning.DISPATCH_LOG.records()}
    assert {"mx_cast", "mx_scaled_mm"} <= ops if preference == "mx_gemm" else "mx_fake_quantize" in ops


@pytest.mark.parametrize(
    "config", [FlyMXConfig(), FlyMXConfig(activation=None), FlyMXConfig("mxfp4_e2m1", "mxfp4_e2m1")]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_emulated_and_mx_gemm_forms_multiply_the_same_values(config, dtype):
    """Both GEMM forms against the fp64 product of the dequantised operands (the cast's values): each within its
    GEMM's rounding of it (the ATen ``mx_scaled_mm`` on the CPU multiplies in fp32 and rounds once)."""
    torch.manual_seed(0)
    x = torch.randn(48, 64, dtype=dtype)
    lin = nn.Linear(64, 40, bias=False, dtype=dtype)
    spec = config.spec
    xq = formats.from_mx(*formats.to_mx(x, spec.activation, spec.mode), spec.activation, torch.float64) if (
        spec.activation) else x.double()  # fmt: skip
    wq = formats.from_mx(*formats.to_mx(lin.weight.detach(), spec.weight, spec.mode), spec.weight, torch.float64)
    want = xq @ wq.t()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=2e-2)
    for preference in ("emulated", "mx_gemm"):
        layer = FlyMXLinear.from_linear(lin, dataclasses.replace(spec, kernel_preference=preference))
        torch.testing.assert_close(layer(x).double(), want, **tol)


def test_auto_form_by_backend_dtype_and_shape(monkeypatch):
    """``kernel_preference="auto"``: a native backend (FlyDSL on gfx950, faked here) takes MX x MX within its
    boundaries (K % 128, N % 4); without one bf16 runs emulated (measured faster at every row count) and fp32 the MX
    GEMM where Triton (faked available) takes it (K % 128, MX activations); everything else emulated."""
    op = sys.modules["fly_lightning.ops.mx_scaled_mm"]  # the module (the package exports the function by that name)
    cases = [  # native, triton, activation, rows, in_features, dtype -> the MX GEMM form
        (None, False, "mxfp8_e4m3", 16, 128, torch.float32, False),  # the CPU: nothing multiplies MX bytes here
        (None, True, "mxfp8_e4m3", 16, 128, torch.bfloat16, False),
        (None, True, "mxfp8_e4m3", 256, 128, torch.bfloat16, False),
        (None, True, "mxfp8_e4m3", 256, 128, torch.float32, True),
        (None, True, "mxfp8_e4m3", 16, 96, torch.float32, False),  # off the kernel's K % 128
        (None, True, None, 16, 128, torch.float32, False),  # weight-only fp32 activations: Triton refuses them
        ("flydsl", False, "mxfp8_e4m3", 128, 128, torch.bfloat16, True),
        ("flydsl", False, "mxfp8_e4m3", 16, 128, torch.float32, True),
        ("flydsl", False, None, 16, 128, torch.bfloat16, False),
        ("flydsl", False, "mxfp8_e4m3", 128, 96, torch.bfloat16, False),
    ]
    for native, triton, activation, rows, k, dtype, mx_gemm in cases:
        monkeypatch.setattr(op, "native_backend", lambda name, device, n=native: n)
        monkeypatch.setattr(op, "dequant_backend", lambda name, device, b=triton: b)
        layer = FlyMXLinear.from_linear(nn.Linear(k, 32, dtype=dtype), MXSpec(activation=activation))
        fly_lightning.DISPATCH_LOG.reset()
        layer(torch.randn(rows, k, dtype=dtype))
        ops = {r["op"] for r in fly_lightning.DISPATCH_LOG.records()}
        want = {"mx_cast", "mx_scaled_mm"} if mx_gemm else {"mx_fake_quantize"}
        assert ops == want, (native, triton, activation, rows, k, dtype, ops)
    x, w = torch.randn(1, 128), torch.randn(32, 128)
    assert MXSpec(kernel_preference="emulated").emulated(x, w)  # explicit: no question asked
    assert not MXSpec(kernel_preference="mx_gemm").emulated(x, w)


def test_default_scale_mode_is_rceil_for_mxfp8_and_floor_with_mxfp4():
    mode = lambda *args, **kw: FlyMXConfig(*args, **kw).spec.mode  # noqa: E731
    assert mode() == "rceil" and mode("mxfp8_e5m2", None) == "rceil"
    assert mode("mxfp4_e2m1") == "floor" and mode("mxfp4_e2m1", None) == "floor"
    assert mode("mxfp8_e4m3", "mxfp4_e2m1") == "floor"  # one mode for both casts: fp4's
    assert mode(mode="floor") == "floor" and mode("mxfp4_e2m1", mode="rceil") == "rceil"
    assert MXSpec().mode == "rceil" and MXSpec("mxfp4_e2m1", "mxfp4_e2m1").mode == "floor"  # the same rule
    # the default is the formats', resolved when used: a config derived with other formats takes theirs
    derived = dataclasses.replace(FlyMXConfig(), weight="mxfp4_e2m1", activation="mxfp4_e2m1")
    assert derived.mode is None and derived.spec.mode == "floor"
    assert dataclasses.replace(FlyMXConfig(mode="rceil"), weight="mxfp4_e2m1").spec.mode == "rceil"  # as asked


def test_moe_experts_torchao_already_wrapped_are_left():
    # torchao's MoE training config wraps the expert weights in its tensor subclass; casting them again would
    # quantize twice. A stand-in subclass under ``torchao.`` (its moe_training module needs a newer torch here)
    from fly_lightning import FlyMoE

    class Wrapped(torch.Tensor):
        pass

    Wrapped.__module__ = "torchao.prototype.moe_training.tensor"
    moe = FlyMoE(64, 32, 4, 2)
    for name in ("gate_up_proj", "down_proj"):
        setattr(moe.experts, name, nn.Parameter(getattr(moe.experts, name).data.as_subclass(Wrapped)))
    with pytest.warns(UserWarning, match=r"MoE experts left as they are: already quantized by torchao \(Wrapped\)"):
        quantize_(moe, FlyMXConfig(), filter_fn=fly_lightning.mx_filter)
    assert moe.mx is None


def test_invalid_config_is_named():
    with pytest.raises(ValueError, match="unknown MX format"):
        FlyMXConfig(weight="mxfp6")
    with pytest.raises(ValueError, match="unsupported MX scale mode"):
        FlyMXConfig(mode="even")
    with pytest.raises(ValueError, match="multiple of 32"):
        FlyMXLinear(40, 8)
    with pytest.raises(ValueError, match="kernel_preference must be one of"):
        FlyMXConfig(kernel_preference="cutlass")


def test_kernel_preference_takes_torchao_enum_members():
    kp = pytest.importorskip("torchao.quantization.quantize_.common").KernelPreference
    assert FlyMXConfig(kernel_preference=kp.EMULATED).kernel_preference == "emulated"
    assert FlyMXConfig(kernel_preference=kp.AUTO).spec.kernel_preference == "auto"
    with pytest.raises(ValueError, match="kernel_preference"):
        FlyMXConfig(kernel_preference=kp.TORCH)


def test_layers_torchao_already_quantized_are_recognised_and_left():
    mx = pytest.importorskip("torchao.prototype.mx_formats")
    model = nn.Sequential(nn.Linear(64, 64, dtype=torch.bfloat16), nn.Linear(64, 32, dtype=torch.bfloat16))
    quantize_(model, mx.MXDynamicActivationMXWeightConfig(), filter_fn=lambda m, fqn: fqn == "0")
    converted = model[0].weight
    with pytest.warns(UserWarning, match=r"Linear\(64, 64\) left as it is: already quantized by torchao \(MXTensor\)"):
        quantize_(model, FlyMXConfig())
    assert type(model[0]) is nn.Linear and model[0].weight is converted  # untouched: no second quantization
    assert type(model[1]) is FlyMXLinear
    assert fly_lightning.quant.config.torchao_quantized(model[1]) is None


@pytest.mark.parametrize(
    "preference, backend",
    [("auto", "aot_eager"), ("emulated", "aot_eager"), ("mx_gemm", "aot_eager"), ("emulated", "inductor")],
)
def test_training_linears_under_torch_compile_whole_graph(preference, backend):
    """One graph either form (``native_backend`` is read once, as a constant), the same forward and gradients as
    eager, through AOTAutograd and through Inductor's generated code."""
    torch._dynamo.reset()
    model = _model()[:3]
    quantize_(model, FlyMXConfig(kernel_preference=preference))
    x = torch.randn(8, 64, requires_grad=True)
    y = model(x)
    g = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, model[0].weight), g)
    yc = torch.compile(model, backend=backend, fullgraph=True)(x)
    gxc, gwc = torch.autograd.grad(yc, (x, model[0].weight), g)
    if backend == "aot_eager":
        assert torch.equal(yc, y) and torch.equal(gxc, gx) and torch.equal(gwc, gw)
    else:  # Inductor generates the glue (bias add, its own matmul calls): sums in other orders
        for got, want in ((yc, y), (gxc, gx), (gwc, gw)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_layers_a_swap_would_break_are_left_with_a_warning():
    """A parametrized Linear (its weight is computed from trainable tensors) and ``nn.MultiheadAttention.out_proj``
    (attention reads its weight without calling it) stay as they are, in either mode."""
    for frozen in (False, True):
        lin = nn.Linear(64, 64)
        torch.nn.utils.parametrizations.weight_norm(lin)
        mha = nn.MultiheadAttention(64, 4, batch_first=True)
        model = nn.ModuleDict({"lin": lin, "mha": mha})
        with pytest.warns(UserWarning, match="parametrized"):
            quantize_(model, FlyMXConfig(frozen=frozen), filter_fn=lambda m, fqn: isinstance(m, nn.Linear))
        assert model["lin"] is lin and len(list(lin.parameters())) == 3  # bias, original0, original1
        assert type(mha.out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear
        x = torch.randn(2, 5, 64)
        mha(x, x, x)  # runs (a frozen out_proj would have no weight to read)
    assert not fly_lightning.mx_filter(mha.out_proj, "mha.out_proj")


@pytest.mark.parametrize(
    "fqn, selected",
    [
        ("model.layers.0.mlp.gate_proj", True),
        ("model.layers.0.self_attn.o_proj", True),
        ("lm_head", False),
        ("gpt_neox.embed_out", False),  # GPT-NeoX / Pythia's head
        ("score", False),  # sequence classification
        ("model.layers.0.block_sparse_moe.gate", False),
        ("transformer.blocks.0.ffn.router.layer", False),  # DBRX, Granite-MoE: a Linear under the router
        ("encoder.block.1.layer.1.mlp.router.classifier", False),  # Switch
        ("model.layers.0.mlp.shared_expert_gate", False),
    ],
)
def test_mx_filter_keeps_heads_and_routers(fqn, selected):
    assert fly_lightning.mx_filter(nn.Linear(32, 32), fqn) is selected


def test_strategy_keeps_the_output_embeddings_whatever_their_name():
    import lightning.pytorch as L

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.body, self.proj_out = nn.Linear(32, 32), nn.Linear(32, 64)

        def get_output_embeddings(self):
            return self.proj_out

        def training_step(self, batch, _):
            return self.proj_out(self.body(batch[0])).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    net = Net()
    trainer = L.Trainer(
        strategy=fly_lightning.FlySingleDeviceStrategy(quantization=FlyMXConfig(), report=False),
        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    data = torch.utils.data.TensorDataset(torch.randn(4, 32))
    trainer.fit(net, torch.utils.data.DataLoader(data, batch_size=4))
    assert isinstance(net.body, FlyMXLinear) and type(net.proj_out) is nn.Linear


@pytest.mark.parametrize("frozen", [False, True])
def test_swapped_layers_keep_mode_hooks_and_check_their_input_width(frozen):
    from fly_lightning.quant import FlyMXFrozenLinear

    lin = nn.Linear(64, 32).eval()
    seen = []
    lin.register_forward_pre_hook(lambda m, args, kwargs: seen.append("pre") or None, with_kwargs=True)
    lin.register_forward_hook(lambda m, args, out: seen.append("post"), always_call=True)
    model = nn.Sequential(lin)
    quantize_(model, FlyMXConfig(frozen=frozen))
    new = model[0]
    assert type(new) is (FlyMXFrozenLinear if frozen else FlyMXLinear) and not new.training
    new(torch.randn(3, 64))
    assert seen == ["pre", "post"]
    with pytest.raises(ValueError, match=r"input of shape \[4, 48\] has 48 features, the layer takes 64"):
        new(torch.randn(4, 48))


def test_a_second_config_retunes_training_layers_and_reports_frozen_ones():
    from fly_lightning.modules.moe import FlyMoE

    net = nn.Sequential(nn.Linear(64, 64), FlyMoE(64, 32, 4, 2))
    quantize_(net, FlyMXConfig(), filter_fn=fly_lightning.mx_filter)
    fp4 = FlyMXConfig("mxfp4_e2m1", "mxfp4_e2m1")
    quantize_(net, fp4, filter_fn=fly_lightning.mx_filter)
    assert net[0].spec == fp4.spec and net[1].mx.weight_fmt == "mxfp4_e2m1"  # one model, one set of numerics
    frozen = nn.Sequential(nn.Linear(64, 64))
    quantize_(frozen, FlyMXConfig(frozen=True), filter_fn=fly_lightning.mx_filter)
    with pytest.warns(UserWarning, match="frozen in MX as .*mxfp8_e4m3.* a new config cannot re-cast it"):
        quantize_(frozen, FlyMXConfig("mxfp4_e2m1", frozen=True), filter_fn=fly_lightning.mx_filter)
    assert frozen[0].spec.weight == "mxfp8_e4m3"


@pytest.mark.parametrize("frozen", [False, True])
def test_fp16_models_and_fp16_autocast_compute_through_fp32(frozen):
    """fp16 (Lightning's 16-true / 16-mixed): the MX casts take bf16 / fp32, so fp16 operands are widened (exactly)
    and the result comes back in fp16, as ``F.linear`` gives it."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(64, 32))
    fp32 = copy.deepcopy(ref)
    quantize_(fp32, FlyMXConfig(frozen=frozen))
    half = copy.deepcopy(ref).half()
    quantize_(half, FlyMXConfig(frozen=frozen))
    x = torch.randn(4, 64)
    y = half(x.half())
    assert y.dtype == torch.float16
    torch.testing.assert_close(y.float(), fp32(x), rtol=2e-2, atol=2e-2)  # fp16 weights and output rounding
    with torch.autocast("cpu", dtype=torch.float16):
        z = fp32(x)
    assert z.dtype == torch.float16
