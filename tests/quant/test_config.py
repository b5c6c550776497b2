"""``FlyMXConfig`` through torchao's ``quantize_``: which Linears are swapped, the parameters shared (state dict
unchanged), an MX forward through the dispatched ops, the straight-through backward in the weights' precision."""

import copy
import logging

import pytest
import torch
from torch import nn

import fly_lightning
from fly_lightning import FlyMXConfig
from fly_lightning.quant.linear import FlyMXLinear

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
def test_forward_in_mx_backward_straight_through(config, tol):
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
    assert {"mx_cast", "mx_scaled_mm"} <= ops


def test_default_scale_mode_is_rceil_for_mxfp8_and_floor_with_mxfp4():
    assert FlyMXConfig().mode == "rceil" and FlyMXConfig("mxfp8_e5m2", None).mode == "rceil"
    assert FlyMXConfig("mxfp4_e2m1").mode == "floor" and FlyMXConfig("mxfp4_e2m1", None).mode == "floor"
    assert FlyMXConfig("mxfp8_e4m3", "mxfp4_e2m1").mode == "floor"  # one mode for both casts: fp4's
    assert FlyMXConfig(mode="floor").mode == "floor" and FlyMXConfig("mxfp4_e2m1", mode="rceil").mode == "rceil"
    from fly_lightning.quant.linear import MXSpec

    assert MXSpec().mode == "rceil" and MXSpec("mxfp4_e2m1", "mxfp4_e2m1").mode == "floor"  # the same rule


def test_invalid_config_is_named():
    with pytest.raises(ValueError, match="unknown MX format"):
        FlyMXConfig(weight="mxfp6")
    with pytest.raises(ValueError, match="unsupported MX scale mode"):
        FlyMXConfig(mode="even")
    with pytest.raises(ValueError, match="multiple of 32"):
        FlyMXLinear(40, 8)


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
