"""The MoE matcher's checks beyond structure (fly_lightning/transform/moe.py): a block is swapped only if the
replacement keeps exactly its state and, with real weights, reproduces its output; otherwise it is left with the
reason. Per-expert requires_grad survives restacking."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fly_lightning
from fly_lightning.modules.moe import FlyMoE, moe_reference
from tests.fly_lightning.conftest import E, H, ListMoE


def _model(block: nn.Module) -> nn.Sequential:
    return nn.Sequential(nn.Linear(H, H), block, nn.Linear(H, 1))


def _left(model) -> list[str]:
    summary = fly_lightning.transform(model)
    assert summary.swapped == []
    return [reason for _, _, reason in summary.left]


class SigmoidRouterMoE(ListMoE):
    """Same structure and state as ListMoE, but sigmoid scores: nothing but the math tells them apart."""

    def forward(self, x):
        w, ids = torch.topk(torch.sigmoid(self.gate(x).float()), self.top_k, -1)
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(ids == e)
            y = y.index_add(0, tok, expert(x[tok]) * w[tok, slot, None])
        return y


class ClampedExpertsMoE(ListMoE):
    """Experts that clamp the gate before SiLU (as some recent blocks do): equal on small inputs only."""

    def __init__(self):
        super().__init__()
        for ex in self.experts:
            ex.forward = lambda x, ex=ex: ex.w2(F.silu(ex.w1(x).clamp(max=1.0)) * ex.w3(x))


class NormedMoE(ListMoE):
    """Extra state (a norm on the output) the replacement would drop."""

    def __init__(self):
        super().__init__()
        self.post_norm = nn.RMSNorm(H)

    def forward(self, x):
        return self.post_norm(super().forward(x))


@pytest.mark.parametrize(
    "block,reason",
    [
        (SigmoidRouterMoE, "probe: the swapped block computes something else"),
        (ClampedExpertsMoE, "probe: the swapped block computes something else"),
        (NormedMoE, "state the swapped block does not model: post_norm.weight"),
    ],
)
def test_block_with_other_math_or_state_is_left_with_reason(block, reason):
    torch.manual_seed(0)
    model = _model(block())
    before = copy.deepcopy(model.state_dict())
    (got,) = _left(model)
    assert got.startswith(reason), got
    assert not any(isinstance(m, FlyMoE) for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_probe_leaves_no_trace():
    # the original block runs in the probe: its hooks stay silent, its buffers keep their values, the RNG its state
    torch.manual_seed(0)
    block = ListMoE()
    block.register_buffer("calls", torch.zeros(()), persistent=False)  # not state: the block converts
    seen = []
    block.register_forward_hook(lambda *a: seen.append(1))
    original = block.forward
    block.forward = lambda x: (block.calls.add_(1), torch.rand(1), original(x))[2]
    model = _model(block)
    rng = torch.get_rng_state()
    summary = fly_lightning.transform(model)
    assert [m for _, _, m in summary.swapped] == ["moe:expert_list"]
    assert seen == [] and block.calls.item() == 0 and torch.equal(torch.get_rng_state(), rng)


def test_probe_keeps_a_shared_router_silent():
    # transformers v5 blocks keep their router module; an unlisted subclass is probed, and neither half of the probe
    # may fire the router's hooks (transformers records router logits with them)
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    class MyBlock(Qwen3MoeSparseMoeBlock):  # not a class the transform knows: probed
        pass

    cfg = transformers.Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    block = MyBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    calls = []
    block.gate.register_forward_hook(lambda m, i, o: calls.append(i[0].shape))
    summary = fly_lightning.transform(nn.ModuleDict({"mlp": block}))
    assert [m for _, _, m in summary.swapped] == ["moe:hf_v5"]
    assert [c for c in calls if c[0] > 1] == []  # (a one-token meta call checks the router's output dtype)


def test_restacked_experts_keep_requires_grad(list_moe_model):
    model = list_moe_model()
    for p in model[1].experts.parameters():
        p.requires_grad_(False)
    fly_lightning.transform(model)
    moe = model[1]
    assert isinstance(moe, FlyMoE)
    assert not moe.experts.gate_up_proj.requires_grad and not moe.experts.down_proj.requires_grad
    assert moe.gate.weight.requires_grad


def test_experts_mixing_frozen_and_trainable_weights_are_left(list_moe_model):
    model = list_moe_model()
    model[1].experts[0].w1.weight.requires_grad_(False)
    (reason,) = _left(model)
    assert "mix frozen and trainable w1/w3 weights" in reason


def test_unknown_class_on_meta_is_left_until_it_can_be_probed():
    with torch.device("meta"):
        model = _model(ListMoE())
    (reason,) = _left(model)
    assert "needs a probe on real weights" in reason


def test_moe_reference_is_the_modules_math(list_moe_model):
    model = list_moe_model()
    x = torch.randn(2, 5, H)
    with torch.no_grad():
        want = model[1](x.reshape(-1, H)).reshape(x.shape)
    fly_lightning.transform(model)
    with torch.no_grad():
        torch.testing.assert_close(moe_reference(model[1], x), want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(model[1](x), want, rtol=1e-5, atol=1e-6)
    assert E == model[1].num_experts


def test_transformers_blocks_with_state_or_math_not_modelled_are_left():
    transformers = pytest.importorskip("transformers")
    cases = {
        "MiniMaxM2Config": ("minimax_m2", "MiniMaxM2SparseMoeBlock", dict(num_local_experts=4),
                            "state the swapped block does not model: e_score_correction_bias"),
        "Lfm2MoeConfig": ("lfm2_moe", "Lfm2MoeSparseMoeBlock", dict(num_experts=4, moe_intermediate_size=24),
                          "state the swapped block does not model: expert_bias"),
        "AXK1Config": ("axk1", "AXK1MoE", dict(n_routed_experts=4, num_local_experts=4, moe_intermediate_size=24,
                                               n_group=1, topk_group=1),
                       "state the swapped block does not model: post_mlp_layernorm.weight"),
        "HYV4Config": ("hy_v4", "HYV4MoE", dict(moe_intermediate_size=24, num_local_experts=4, num_attention_heads=2,
                                                num_key_value_heads=1, head_dim=16),
                       "probe: the swapped block computes something else"),
    }  # fmt: skip
    present = {name: case for name, case in cases.items() if hasattr(transformers, name)}
    assert present, "neither block in this transformers version"
    import importlib

    for cfg_name, (module_name, cls_name, kw, reason) in present.items():
        cfg = getattr(transformers, cfg_name)(hidden_size=32, intermediate_size=48, num_experts_per_tok=2, **kw)
        mod = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
        torch.manual_seed(0)
        block = getattr(mod, cls_name)(cfg)
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0, 0.3)
        (got,) = [r for _, _, r in fly_lightning.transform(nn.ModuleDict({"mlp": block})).left]
        assert got.startswith(reason), (cls_name, got)


def test_block_that_outputs_zeros_cannot_be_probed():
    torch.manual_seed(0)
    block = ListMoE()
    with torch.no_grad():
        for ex in block.experts:
            ex.w2.weight.zero_()  # zero-initialised down projections (as some adapter inits do)
    (reason,) = _left(_model(block))
    assert "outputs zeros on random tokens, so it cannot tell" in reason
