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
        "AXK1Config": ("axk1", "AXK1MoE", dict(n_routed_experts=4, num_local_experts=4, moe_intermediate_size=24,
                                               n_group=1, topk_group=1),
                       "state the swapped block does not model: post_mlp_layernorm.weight"),
        "HYV4Config": ("hy_v4", "HYV4MoE", dict(moe_intermediate_size=24, num_local_experts=4, num_attention_heads=2,
                                                num_key_value_heads=1, head_dim=16),
                       "experts use a clamped SwiGLU variant (limit=10.0"),
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


def _deepseek_v3_test_config(transformers, **kw):
    """transformers' own DeepSeek-V3 test configuration (tests/models/deepseek_v3): top-k 8 of 8 experts in 2 groups,
    1 group kept, so only 4 experts are reachable through the groups."""
    return transformers.DeepseekV3Config(**{
        **dict(vocab_size=99, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
               routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=16, v_head_dim=32,
               qk_nope_head_dim=32, n_group=2, topk_group=1, num_experts_per_tok=8, first_k_dense_replace=1,
               norm_topk_prob=True, hidden_act="silu", max_position_embeddings=512, pad_token_id=0),
        **kw,
    })  # fmt: skip


def _deepseek_v3(transformers, **kw):
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(_deepseek_v3_test_config(transformers, **kw))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.5)
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5, generator=g)
    return model


def test_deepseek_v3_top_k_of_all_experts_beyond_the_kept_groups_is_swapped_exactly():
    # top_k == num_experts: transformers masks the dropped group with -inf and still takes all 8, so every expert is
    # chosen with its unmasked score whatever the groups; the swapped block routes to all 8 as well
    transformers = pytest.importorskip("transformers")
    ref = _deepseek_v3(transformers)
    model = copy.deepcopy(ref)
    summary = fly_lightning.transform(model)
    assert [c for _, c, m in summary.swapped if m.startswith("moe:")] == ["DeepseekV3MoE"] and summary.left == []
    ids = torch.randint(0, 99, (2, 7), generator=torch.Generator().manual_seed(3))
    out, out_ref = model(ids, labels=ids), ref(ids, labels=ids)
    torch.testing.assert_close(out.logits, out_ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.loss, out_ref.loss, rtol=1e-5, atol=1e-5)
    out.loss.backward()
    out_ref.loss.backward()
    for (name, p), (_, p_ref) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_deepseek_v3_top_k_beyond_the_kept_groups_but_not_all_experts_is_left():
    # 4 < top_k < 8: the extra slots go to masked experts in torch.topk's tie order; nothing defined to reproduce
    transformers = pytest.importorskip("transformers")
    model = _deepseek_v3(transformers, num_experts_per_tok=6)
    ids = torch.randint(0, 99, (2, 7), generator=torch.Generator().manual_seed(3))
    summary = fly_lightning.transform(model)
    (reason,) = [r for _, c, r in summary.left if c == "DeepseekV3MoE"]
    assert "top_k=6 exceeds the 4 experts of topk_group=1 of n_group=2 groups" in reason
    assert not any(isinstance(m, FlyMoE) for m in model.modules())
    model(ids, labels=ids).loss.backward()  # still the working model it was


def test_clamped_experts_are_left_at_fresh_init_too():
    # HY-V4 clamps the SwiGLU at 10; with small freshly initialised weights the block probe's tokens never get there
    # (the transformers-built tiny model of test_moe_families is such a case), so only the experts probe, which
    # scales its tokens to the weights, shows it
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "HYV4Config"):
        pytest.skip("this transformers has no HY-V4")
    from transformers.models.hy_v4.modeling_hy_v4 import HYV4MoE

    cfg = transformers.HYV4Config(
        hidden_size=32, intermediate_size=48, num_experts_per_tok=2, moe_intermediate_size=24, num_local_experts=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    )  # fmt: skip
    torch.manual_seed(0)
    block = HYV4MoE(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.005)
        block.gate.weight.normal_(0, 0.5)
    (reason,) = [r for _, _, r in fly_lightning.transform(nn.ModuleDict({"mlp": block})).left]
    # the conversion names the clamp from the experts' fields; the experts probe, behind it, sees it too
    assert reason.startswith("experts use a clamped SwiGLU variant (limit=10.0"), reason
    from fly_lightning.transform.core import Unsupported
    from fly_lightning.transform.moe import _probe_experts

    new = FlyMoE(32, 24, 4, 2)
    new.experts.gate_up_proj, new.experts.down_proj = block.experts.gate_up_proj, block.experts.down_proj
    with pytest.raises(Unsupported, match="the experts compute something else at large activations"):
        _probe_experts(block, new)


def test_summary_says_per_class_in_one_line_what_was_swapped_and_left():
    summary = fly_lightning.TransformSummary(
        swapped=[("l0.mlp", "DeepseekV3MoE", "moe:hf_v5"), ("l1.mlp", "DeepseekV3MoE", "moe:hf_v5")],
        left=[("l2.mlp", "DeepseekV3MoE", "top_k=6 exceeds ..."), ("m.mlp", "HYV4MoE", "probe: clamp")],
    )
    lines = str(summary).splitlines()
    assert lines == [
        "swapped 2 module(s)",
        "  2 x DeepseekV3MoE -> moe:hf_v5; 1 left: top_k=6 exceeds ...",
        "left 1 recognised module(s):",
        "  1 x HYV4MoE: probe: clamp",
    ]


class _BiasedRouter(nn.Module):
    """DeepSeek-V3's router fields with groups off; ``rank_logits`` ranks ``logits + bias`` instead of
    ``sigmoid(logits) + bias`` (as Kolibri-1 does): with a zero bias the two choose the same experts."""

    def __init__(self, rank_logits: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 16) * 0.5)
        self.register_buffer("e_score_correction_bias", torch.zeros(4))
        self.top_k, self.num_group, self.topk_group, self.routed_scaling_factor = 2, None, None, 1.5
        self.norm_topk_prob, self.rank_logits = True, rank_logits

    def forward(self, x):
        logits = F.linear(x.reshape(-1, x.shape[-1]).float(), self.weight.float())
        scores = logits.sigmoid()
        ids = torch.topk((logits if self.rank_logits else scores) + self.e_score_correction_bias, 2, dim=-1)[1]
        w = scores.gather(1, ids)
        return logits, w / (w.sum(-1, keepdim=True) + 1e-20) * self.routed_scaling_factor, ids


class _BiasedBlock(nn.Module):
    def __init__(self, rank_logits: bool) -> None:
        super().__init__()
        self.gate = _BiasedRouter(rank_logits)
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.randn(4, 2 * 8, 16) * 0.3)
        self.experts.down_proj = nn.Parameter(torch.randn(4, 16, 8) * 0.3)
        self.experts.act_fn = nn.SiLU()
        self.experts.forward = self._experts

    def _experts(self, x, ids, w):
        y = torch.zeros_like(x)
        for e in range(4):
            tok, slot = torch.where(ids == e)
            gate, up = F.linear(x[tok], self.experts.gate_up_proj[e]).chunk(2, dim=-1)
            rows = F.linear(F.silu(gate) * up, self.experts.down_proj[e])
            y = y.index_add(0, tok, rows * w[tok, slot, None].to(rows.dtype))
        return y

    def forward(self, x):
        _, w, ids = self.gate(x)
        return self.experts(x.reshape(-1, x.shape[-1]), ids, w).reshape(x.shape)


@pytest.mark.parametrize("rank_logits", [False, True], ids=["sigmoid_plus_bias", "logits_plus_bias"])
def test_router_bias_is_probed_at_random_values_not_at_its_zero_init(rank_logits):
    # a fresh selection bias is zero, where ranking logits + bias and sigmoid + bias agree; the probe sets it to
    # random values (restored afterwards) so that only the block whose math is the swapped one's is swapped
    torch.manual_seed(0)
    block = _BiasedBlock(rank_logits)
    ref = copy.deepcopy(block)
    model = nn.ModuleDict({"mlp": block})
    summary = fly_lightning.transform(model)
    assert torch.equal(model.mlp.gate.e_score_correction_bias, torch.zeros(4))  # restored
    if rank_logits:
        (reason,) = [r for _, _, r in summary.left]
        assert reason.startswith("probe: the swapped block computes something else"), reason
        return
    assert [m for _, _, m in summary.swapped] == ["moe:hf_v5"]
    for b in (model.mlp.gate.e_score_correction_bias, ref.gate.e_score_correction_bias):
        b.copy_(torch.tensor([0.4, -0.3, 0.1, -0.5]))  # the bias moves in training: still the same function
    x = torch.randn(2, 8, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y, y_ref = model.mlp(x), ref(x_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    y.square().sum().backward()
    y_ref.square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    for (name, p), p_ref in zip(model.mlp.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(
    "cfg_name, module_name, cls_name, kw, eps",
    [
        # LFM2-MoE: w / (sum + 1e-6); MiniMax-M2: w / sum. Read off the router on tokens with tiny selected scores
        ("Lfm2MoeConfig", "lfm2_moe", "Lfm2MoeSparseMoeBlock", dict(num_experts=4, moe_intermediate_size=24), 1e-6),
        ("MiniMaxM2Config", "minimax_m2", "MiniMaxM2SparseMoeBlock", dict(num_local_experts=4), 0.0),
    ],
)
def test_renormalisation_epsilon_is_the_familys_even_where_it_decides(cfg_name, module_name, cls_name, kw, eps):
    import importlib

    transformers = pytest.importorskip("transformers")
    cfg = getattr(transformers, cfg_name)(hidden_size=32, intermediate_size=48, num_experts_per_tok=2, **kw)
    mod = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    torch.manual_seed(0)
    block = getattr(mod, cls_name)(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
        bias = block.expert_bias if hasattr(block, "expert_bias") else block.e_score_correction_bias
        bias.copy_(torch.tensor([0.3, -0.2, 0.1, -0.4]))
    ref = copy.deepcopy(block)
    model = nn.ModuleDict({"mlp": block})
    summary = fly_lightning.transform(model)
    assert [m for _, _, m in summary.swapped] == ["moe:hf_v5"], summary.left
    assert model.mlp.renorm_eps == eps
    # random tokens, and tokens whose logits are all about -10 .. -60 (selected sigmoid scores summing to ~1e-4 ..
    # 1e-26): there the epsilon decides the weights
    v = torch.linalg.pinv(block.gate.weight.detach().double()) @ torch.ones(4, dtype=torch.float64)
    low = -torch.arange(10.0, 61.0, 50 / 7).double()[:, None] * v
    x = torch.cat([torch.randn(8, 32), low.float()]).reshape(2, 8, 32)
    x_ref = x.clone().requires_grad_()
    x.requires_grad_()
    y, y_ref = model.mlp(x), ref(x_ref)
    assert torch.isfinite(y_ref).all()
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    y.square().sum().backward()
    y_ref.square().sum().backward()
    # the low tokens' gradient goes through weights renormalised from sums down to 1e-26: ill-conditioned, so fp32
    # sums in another order (the CPU's vector width) move it by a few 1e-5 relative (3.6e-5 seen on an AVX-512 host)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-5)
    model.mlp.renorm_eps = None  # moe_route's 1e-20 instead: another function on these tokens
    assert not torch.allclose(model.mlp(x.detach()), y_ref.detach(), rtol=1e-5, atol=1e-5)


def test_router_with_an_epsilon_not_known_is_left():
    import transformers.models.lfm2_moe.modeling_lfm2_moe as lfm2

    class OtherEpsRouter(lfm2.Lfm2MoeTopKRouter):
        def forward(self, hidden_states, expert_bias=None):
            logits = F.linear(hidden_states, self.weight)
            scores = logits.sigmoid()
            _, ids = torch.topk(scores + expert_bias, k=self.top_k, dim=-1)
            w = scores.gather(1, ids)
            return logits, w / (w.sum(-1, keepdim=True) + 1e-5), ids  # within the form tolerance on unit tokens

    from transformers import Lfm2MoeConfig

    cfg = Lfm2MoeConfig(hidden_size=32, intermediate_size=48, num_experts_per_tok=2, num_experts=4,
                        moe_intermediate_size=24)  # fmt: skip
    block = lfm2.Lfm2MoeSparseMoeBlock(cfg)
    block.gate = OtherEpsRouter(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    (reason,) = _left(nn.ModuleDict({"mlp": block}))
    assert "renormalises with an epsilon none of" in reason, reason


def test_ernie_statics_bias_is_the_selection_bias():
    transformers = pytest.importorskip("transformers")
    from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeSparseMoeBlock

    cfg = transformers.Ernie4_5_MoeConfig(hidden_size=32, moe_intermediate_size=24, moe_num_experts=4,
                                          moe_k=2, moe_num_shared_experts=1)  # fmt: skip
    torch.manual_seed(0)
    block = Ernie4_5_MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    ref = copy.deepcopy(block)
    model = nn.ModuleDict({"mlp": block})
    summary = fly_lightning.transform(model)
    assert [m for _, _, m in summary.swapped] == ["moe:hf_v5"], summary.left
    statics = model.mlp.gate.moe_statics.e_score_correction_bias
    assert model.mlp.selection_bias().data_ptr() == statics.data_ptr()  # the [1, E] parameter itself
    assert set(model.mlp.state_dict()) == set(ref.state_dict())
    with torch.no_grad():  # a bias that moves the selection (softmax scores + bias), in both
        for b in (statics, ref.gate.moe_statics.e_score_correction_bias):
            b.copy_(torch.tensor([[0.3, -0.2, 0.25, -0.4]]))
    x = torch.randn(2, 8, 32)
    torch.testing.assert_close(model.mlp(x), ref(x), rtol=1e-5, atol=1e-5)
    block2 = Ernie4_5_MoeSparseMoeBlock(cfg)
    block2.gate.norm_min = 0.9  # the clamp would act on a top-2-of-4 softmax sum (at least 0.5)
    with torch.no_grad():
        for p in block2.parameters():
            p.normal_(0, 0.3)
    (reason,) = [r for _, _, r in fly_lightning.transform(nn.ModuleDict({"mlp": block2})).left]
    assert "norm_min=0.9" in reason, reason


class _GemmaLikeLayer(nn.Module):
    """A decoder layer with the MoE inlined (as Gemma 4): a router whose weights FlyMoE cannot express (a softmax over
    a normalised input, scaled per expert), the experts called with its routing."""

    def __init__(self, act: str):
        super().__init__()
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts

        cfg = MixtralConfig(hidden_size=H, intermediate_size=24, num_local_experts=E, hidden_act=act)
        self.self_attn = nn.Identity()
        self.router = nn.Linear(H, E, bias=False)
        self.scale = nn.Parameter(torch.rand(E) + 0.5)
        self.experts = MixtralExperts(cfg)

    def forward(self, x):
        flat = x.reshape(-1, H)
        w, ids = torch.softmax(self.router(F.normalize(flat, dim=-1)), -1).topk(2, -1)
        w = w * self.scale[ids]
        return x + self.experts(flat, ids, w).reshape(x.shape)


@pytest.mark.parametrize("act, activation", [("silu", "silu"), ("gelu", "gelu"), ("gelu_pytorch_tanh", "gelu_tanh")])
def test_experts_of_an_inlined_moe_are_swapped_alone(act, activation):
    from fly_lightning.modules import FlyExperts

    torch.manual_seed(0)
    layer = _GemmaLikeLayer(act)
    with torch.no_grad():
        for p in layer.experts.parameters():
            p.normal_(0, 0.3)
    ref, stock = copy.deepcopy(layer), layer.experts
    model = nn.ModuleDict({"layer": layer})
    summary = fly_lightning.transform(model)
    assert [(p, m) for p, _, m in summary.swapped] == [("layer.experts", "moe:hf_experts")], summary
    assert isinstance(layer.experts, FlyExperts) and layer.experts.activation == activation
    assert layer.experts.gate_up_proj is stock.gate_up_proj and layer.experts.down_proj is stock.down_proj  # shared
    x = torch.randn(2, 5, H, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = layer(x), ref(x_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    y.square().sum().backward()
    y_ref.square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    for (name, p), p_ref in zip(layer.named_parameters(), ref.parameters(), strict=True):  # router and scale too
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    # an index E is transformers' "no expert" slot: nothing added, no gradient to its weight
    ids = torch.tensor([[0, E], [E, 1]])
    w = torch.rand(2, 2, requires_grad=True)
    w_ref = w.detach().clone().requires_grad_()
    xs = torch.randn(2, H)
    got, want = layer.experts(xs, ids, w), ref.experts(xs, ids, w_ref)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-5, atol=1e-5)
    assert w.grad[0, 1] == 0 and w.grad[1, 0] == 0


def test_experts_alone_that_compute_something_else_are_left():
    torch.manual_seed(0)
    layer = _GemmaLikeLayer("silu")
    experts = layer.experts
    experts.forward = lambda x, ids, w: type(experts).forward(experts, x.clamp(-1, 1), ids, w)  # a clamp: other math
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.3)
    summary = fly_lightning.transform(nn.ModuleDict({"layer": layer}))
    assert not summary.swapped
    ((path, _, reason),) = summary.left
    assert path == "layer.experts" and reason.startswith("probe: the experts compute something else"), reason
    hooked = _GemmaLikeLayer("silu")
    hooked.experts.register_forward_hook(lambda *args: None)
    ((_, _, reason),) = fly_lightning.transform(nn.ModuleDict({"layer": hooked})).left
    assert reason == "experts have forward hooks, which the swapped container would not fire", reason
