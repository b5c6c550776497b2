"""The transform engine on plain torch modules: nn.RMSNorm swaps, look-alikes left by the probe, the unrecognised list,
torch.compile, activation checkpointing, and use without Lightning."""

import copy
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import fly_lightning
from fly_lightning import DISPATCH_LOG, FlyRMSNorm

H = 32


def _randomise(model):
    # norm weights away from their init, so a wrong scale (w vs 1 + w) shows
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model


def _grads(model):
    return {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()}  # compiled: a wrapper


def _assert_same_step(model, ref, x):
    """Same output and same gradients (parameters and input) for a loss on the output."""
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, y_ref = model(xa), ref(xb)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    target = torch.randn_like(y_ref)
    ((y - target) ** 2).sum().backward()
    ((y_ref - target) ** 2).sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-4, atol=1e-5)
    g, g_ref = _grads(model), _grads(ref)
    assert list(g) == list(g_ref)
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


# --- nn.RMSNorm -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("eps", [None, 1e-6, 1e-2])
def test_nn_rmsnorm_is_swapped_and_matches(affine, eps):
    ref = _randomise(nn.Sequential(nn.Linear(H, H), nn.RMSNorm(H, eps=eps, elementwise_affine=affine), nn.Linear(H, 8)))
    model = copy.deepcopy(ref)
    summary = fly_lightning.transform(model)
    assert summary.swapped == [("1", "RMSNorm", "rms_norm:torch")]
    assert summary.left == [] and not summary.unrecognised
    norm = model[1]
    assert isinstance(norm, FlyRMSNorm) and norm.eps == eps and norm.elementwise_affine == affine
    assert norm.offset == 0.0 and not norm.cast_before_scale
    assert list(model.state_dict()) == list(ref.state_dict())
    # eps=1e-2 is large enough to change the output: a dropped or default eps would show
    _assert_same_step(model, ref, torch.randn(3, 5, H))
    rec = DISPATCH_LOG.records("rms_norm")
    assert len(rec) == 1 and rec[0]["backend"] == "triton" and rec[0]["calls"] == 1


def test_swapped_nn_rmsnorm_shares_the_parameter():
    norm = nn.RMSNorm(H)
    model = nn.Sequential(norm)
    fly_lightning.transform(model)
    assert model[0].weight is norm.weight  # optimizers built before the transform keep working


def test_nn_rmsnorm_over_several_dims_is_left_with_reason():
    model = nn.Sequential(nn.RMSNorm([4, 8]))
    summary = fly_lightning.transform(model)
    assert summary.swapped == []
    assert summary.left == [("0", "RMSNorm", "normalized_shape (4, 8) spans more than the last dim")]
    assert type(model[0]) is nn.RMSNorm


# --- look-alikes: recognised by structure, confirmed (or not) by the probe --------------------------------------------


class LlamaStyleRMSNorm(nn.Module):
    """A user's RMSNorm with the Hugging Face Llama attributes and math (unknown class name)."""

    def __init__(self, h, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))
        self.variance_epsilon = eps

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * xf.to(x.dtype)


class CenteredRMSNorm(LlamaStyleRMSNorm):
    """Named and built like an RMSNorm, but subtracts the mean (a LayerNorm without bias)."""

    def forward(self, x):
        x = x - x.mean(-1, keepdim=True)
        return super().forward(x)


class ScaledRMSNorm(nn.Module):
    """Gemma-looking attributes (``eps``, no ``variance_epsilon``) but scales by ``w``, not ``1 + w``."""

    def __init__(self, h, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class TensorEpsRMSNorm(LlamaStyleRMSNorm):
    def __init__(self, h):
        super().__init__(h)
        self.variance_epsilon = torch.tensor(1e-6)


def test_liger_rmsnorm_is_left_with_reason():
    # Liger-Kernel's RMSNorm has a fused backward: composing Liger then fly must not take it away. A stand-in class
    # from Liger's module (the real one needs a GPU to run), with the Llama math the probe would otherwise accept.
    liger_cls = type("LigerRMSNorm", (LlamaStyleRMSNorm,), {"__module__": "liger_kernel.transformers.rms_norm"})
    model = nn.Sequential(liger_cls(8))
    summary = fly_lightning.transform(model)
    assert summary.swapped == []
    assert summary.left == [("0", "LigerRMSNorm", "Liger-Kernel's RMSNorm (fused forward and backward) kept: ours not "
                             "measured faster")]  # fmt: skip
    assert type(model[0]) is liger_cls


def test_lookalike_with_the_same_math_is_swapped():
    ref = _randomise(nn.Sequential(nn.Linear(H, H), LlamaStyleRMSNorm(H, eps=1e-3)))
    model = copy.deepcopy(ref)
    summary = fly_lightning.transform(model)
    assert summary.swapped == [("1", "LlamaStyleRMSNorm", "rms_norm:llama")]
    assert model[1].eps == 1e-3 and model[1].cast_before_scale
    _assert_same_step(model, ref, torch.randn(4, H))


@pytest.mark.parametrize(
    "cls, reason",
    [
        (CenteredRMSNorm, "probe: no variant reproduces the original"),
        (ScaledRMSNorm, "probe: no variant reproduces the original"),
        (TensorEpsRMSNorm, "eps attribute is Tensor, expected float"),
    ],
)
def test_lookalike_with_different_math_is_left_with_reason(cls, reason):
    original = cls(H)
    model = nn.Sequential(nn.Linear(H, H), original)
    summary = fly_lightning.transform(model)
    assert summary.swapped == []
    assert len(summary.left) == 1
    path, name, why = summary.left[0]
    assert (path, name) == ("1", cls.__name__) and why.startswith(reason), why
    assert model[1] is original  # untouched
    assert DISPATCH_LOG.records() == []  # the probe compares with the reference, it dispatches nothing


class EpsOnlyLlamaStyleRMSNorm(nn.Module):
    """Llama-4's layout: ``eps`` (no ``variance_epsilon``), yet Llama's math (cast, then scale by ``w``)."""

    def __init__(self, h, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class ScaleThenCastRMSNorm(LlamaStyleRMSNorm):
    """Olmo2's math, ``(w * x̂).to(dtype)``, under an unlisted name."""

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight * xf).to(x.dtype)


@pytest.mark.parametrize("cls, variant", [(EpsOnlyLlamaStyleRMSNorm, "llama"), (ScaleThenCastRMSNorm, "plain")])
def test_the_probe_picks_the_variant_that_reproduces_the_class(cls, variant):
    ref = _randomise(nn.Sequential(nn.Linear(H, H), cls(H)))
    model = copy.deepcopy(ref)
    summary = fly_lightning.transform(model)
    assert summary.swapped == [("1", cls.__name__, f"rms_norm:{variant}")]
    _assert_same_step(model, ref, torch.randn(4, H))
    x = torch.randn(4, H).bfloat16()  # fp32 weights, bf16 input: output dtype and values as the original's
    with torch.no_grad():
        want, got = ref[1](x), model[1](x)
    assert got.dtype == want.dtype
    # within a bf16 rounding: the Triton interpreter truncates fp32 -> bf16 where torch and the GPU round to nearest
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3)


def test_unlisted_class_on_meta_is_left_until_it_can_be_probed():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(H, H), EpsOnlyLlamaStyleRMSNorm(H), LlamaStyleRMSNorm(H))
    summary = fly_lightning.transform(model)
    assert summary.swapped == []  # LlamaStyleRMSNorm is not a transformers class either
    assert [(p, why.split(":")[0]) for p, _, why in summary.left] == [
        ("1", "weight on meta / sharded"),
        ("2", "weight on meta / sharded"),
    ]


class BrokenRMSNorm(LlamaStyleRMSNorm):
    """Recognised by structure, but its forward fails (as a module whose layout a converter misreads would)."""

    def forward(self, x):
        raise AttributeError("no attribute 'weight_scale'")


def test_a_module_whose_conversion_fails_is_left_with_the_error():
    model = nn.Sequential(nn.Linear(H, H), BrokenRMSNorm(H), nn.RMSNorm(H))
    summary = fly_lightning.transform(model)  # does not raise: the rest of the model is still transformed
    assert summary.swapped == [("2", "RMSNorm", "rms_norm:torch")]
    assert summary.left == [("1", "BrokenRMSNorm", "conversion failed (AttributeError: no attribute 'weight_scale')")]


def test_list_moe_whose_router_is_observed_is_left_with_reason(list_moe_model):
    from types import SimpleNamespace

    # per-expert lists are restacked (no router module kept): an observed router must keep its block
    assert [m for _, _, m in fly_lightning.transform(list_moe_model()).swapped] == ["moe:expert_list"]
    hooked = list_moe_model()
    hooked[1].gate.register_forward_hook(lambda *a: None)
    assert "forward hooks" in fly_lightning.transform(hooked).left[0][2]
    recording = list_moe_model()
    recording.config = SimpleNamespace(output_router_logits=True)  # as a transformers model's config
    assert "output_router_logits=True" in fly_lightning.transform(recording).left[0][2]
    assert not any(isinstance(m, fly_lightning.FlyMoE) for m in (*hooked.modules(), *recording.modules()))


def test_our_own_module_is_not_matched():
    model = nn.Sequential(nn.Linear(H, H), FlyRMSNorm(H))
    summary = fly_lightning.transform(model)
    assert summary.swapped == [] and summary.left == []


# --- not recognised ---------------------------------------------------------------------------------------------------


class FancyNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(H))
        self.shift = nn.Parameter(torch.zeros(H))

    def forward(self, x):
        return x * self.scale + self.shift


class TopKRouter(nn.Linear):
    pass


class Block(nn.Module):
    """An unrecognised container: the walk still looks inside it."""

    def __init__(self):
        super().__init__()
        self.norm = FancyNorm()
        self.ln = nn.LayerNorm(H)
        self.router = TopKRouter(H, 4)
        self.inner_norm = nn.RMSNorm(H)
        self.proj = nn.Linear(H, H)


def test_unknown_modules_are_listed_as_not_recognised():
    model = nn.ModuleList([Block(), Block()])
    summary = fly_lightning.transform(model)
    assert summary.unrecognised == Counter({"FancyNorm": 2, "LayerNorm": 2, "TopKRouter": 2})
    # the nn.RMSNorm inside each unrecognised block is still found
    assert [p for p, _, _ in summary.swapped] == ["0.inner_norm", "1.inner_norm"]
    assert summary.left == []
    text = str(summary)
    assert "not recognised: FancyNorm x2, LayerNorm x2, TopKRouter x2" in text


def test_ops_as_a_string_is_a_clear_type_error():
    # the strategies' check: a bare string would otherwise be iterated into letters ("unknown op families ['_', ...]")
    model = nn.Sequential(nn.RMSNorm(8))
    with pytest.raises(TypeError, match=r"ops must be a collection of op family names, e.g. ops=\['rms_norm'\]"):
        fly_lightning.transform(model, ops="rms_norm")
    assert isinstance(model[0], nn.RMSNorm)  # nothing swapped
    assert fly_lightning.transform(model, ops=["rms_norm"]).swapped


def test_verbose_prints_the_table(capsys):
    fly_lightning.transform(nn.Sequential(nn.RMSNorm(H), FancyNorm()), verbose=True)
    out = capsys.readouterr().out
    assert "fly-lightning transform" in out and "RMSNorm" in out and "FancyNorm" in out


# --- torch.compile, activation checkpointing --------------------------------------------------------------------------


@pytest.mark.parametrize("left_to_inductor", [False, True])
def test_torch_compile_fullgraph(left_to_inductor):
    ref = _randomise(nn.Sequential(nn.RMSNorm(H, eps=1e-5), nn.Linear(H, H), nn.RMSNorm(H), nn.Linear(H, 8)))
    model = copy.deepcopy(ref)
    assert len(fly_lightning.transform(model).swapped) == 2
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)  # a graph break would raise
    with fly_lightning.dispatch_config(inductor_ops={"rms_norm"} if left_to_inductor else ()):
        _assert_same_step(compiled, ref, torch.randn(2, 6, H))
    rec = DISPATCH_LOG.records("rms_norm")
    if left_to_inductor:  # traced as plain torch, recorded once per trace with its reason
        assert rec and all(r["backend"] == "inductor" and "left to Inductor" in r["reason"] for r in rec)
    else:  # the compiled graph calls the custom op, which dispatched at run time
        assert rec and sum(r["calls"] for r in rec) == 2 and all(r["backend"] == "triton" for r in rec)


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(H, eps=1e-5)
        self.fc = nn.Linear(H, H)

    def forward(self, x):
        return x + self.fc(self.norm(x))


class Checkpointed(nn.Module):
    def __init__(self, use_checkpoint):
        super().__init__()
        self.blocks = nn.ModuleList([Residual(), Residual()])
        self.use_checkpoint = use_checkpoint

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.use_checkpoint else block(x)
        return x


def test_activation_checkpointing_gives_equal_gradients():
    ref = _randomise(Checkpointed(use_checkpoint=False))
    model = copy.deepcopy(ref)
    model.use_checkpoint = True
    assert len(fly_lightning.transform(model).swapped) == 2
    _assert_same_step(model, ref, torch.randn(3, 4, H))
    # each norm ran in the forward and again in the recomputation during backward
    assert sum(r["calls"] for r in DISPATCH_LOG.records("rms_norm")) == 4


# --- without Lightning ------------------------------------------------------------------------------------------------


def test_training_step_without_lightning():
    # a plain nn.Module and a torch optimizer: no LightningModule, no Trainer
    torch.manual_seed(1)
    ref = _randomise(nn.Sequential(nn.Linear(H, H), nn.RMSNorm(H), nn.Linear(H, 4)))
    model = copy.deepcopy(ref)
    fly_lightning.transform(model)
    x, y = torch.randn(8, H), torch.randint(0, 4, (8,))
    for m in (model, ref):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, p_ref, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


_NO_LIGHTNING = """
import importlib.abc, sys, types

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("lightning", "pytorch_lightning", "lightning_fabric"):
            raise ImportError(f"blocked: {name}")

sys.meta_path.insert(0, Block())
# the Lightning strategies are the only part of the package that needs Lightning: stand them in
stub = types.ModuleType("fly_lightning.strategies")
for name in ("FlyDDPStrategy", "FlyFSDP2Strategy", "FlyModelParallelStrategy", "FlySingleDeviceStrategy"):
    setattr(stub, name, None)
sys.modules["fly_lightning.strategies"] = stub

import torch
from torch import nn
import fly_lightning

model = nn.Sequential(nn.Linear(16, 16), nn.RMSNorm(16))
summary = fly_lightning.transform(model)
assert [m for _, _, m in summary.swapped] == ["rms_norm:torch"], summary
model(torch.randn(2, 16)).sum().backward()
assert not any(n.split(".")[0] in ("lightning", "pytorch_lightning") for n in sys.modules)
print("ok", fly_lightning.DISPATCH_LOG.records()[0]["backend"])
"""


def test_transform_imports_nothing_from_lightning():
    # transform, modules, ops and dispatch must not need Lightning (only the strategies do)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", _NO_LIGHTNING], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "ok triton"


def test_transform_package_is_installed_by_a_wheel():
    # pyproject lists packages explicitly: an editable install finds any subfolder, a wheel only the listed ones
    tomllib = pytest.importorskip("tomllib")
    root = Path(fly_lightning.__file__).resolve().parents[1]
    packages = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert "fly_lightning.transform" in packages


def test_a_meta_model_materialised_as_lightning_does_is_initialised():
    """Lightning's FSDP2 / model-parallel setup builds on the meta device, then ``to_empty`` and ``reset_parameters``
    on every module holding parameters: the swapped norm must start at ones (zeros with an offset), as nn.RMSNorm."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(H, H), nn.RMSNorm(H))
    fly_lightning.transform(model)
    assert isinstance(model[1], FlyRMSNorm)
    model.to_empty(device="cpu")
    for m in model.modules():
        if any(True for _ in m.parameters(recurse=False)):
            m.reset_parameters()
    assert torch.equal(model[1].weight, torch.ones(H))
    gemma = FlyRMSNorm(H, offset=1.0)
    gemma.weight.data.fill_(3.0)
    gemma.reset_parameters()
    assert torch.equal(gemma.weight, torch.zeros(H))


def test_moe_weight_containers_initialise_their_own_parameters():
    from fly_lightning.modules import moe_layout

    containers = [moe_layout.RouterWeight(4, 8), moe_layout.FusedExperts(4, 8, 16),
                  moe_layout.ExpertList(4, 8, 16, ("w1", "w3", "w2"))]  # fmt: skip
    for c in containers:
        with torch.no_grad():
            for p in c.parameters():
                p.fill_(float("nan"))
        c.reset_parameters()
        assert all(torch.isfinite(p).all() and 0 < p.std() < 0.1 for p in c.parameters()), type(c).__name__
