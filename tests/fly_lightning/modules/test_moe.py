"""FlyMoE: equal to a straightforward per-expert loop (forward and gradients), to the transformers v5 blocks it wraps,
and to torchtitan's MoE; state_dict layouts round-trip; torch.compile fullgraph; plain and fused paths agree."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fly_lightning import DISPATCH_LOG, FlyMoE
from fly_lightning.modules.moe_layout import LIST_NAMES

H, INTER, E = 32, 48, 6


def loop_moe(
    x,
    router_w,
    gate,
    up,
    down,
    k,
    norm=True,
    score_func="softmax",
    route_scale=1.0,
    score_before=False,
    expert_bias=None,
    groups=None,
):
    """The oracle: route, then run each expert on its tokens in a Python loop. gate/up [E, I, H], down [E, H, I].

    ``groups=(n, top)``: node-limited routing as torchtitan does it (groups scored by their two best biased scores).
    """
    logits = x @ router_w.t()
    scores = torch.sigmoid(logits) if score_func == "sigmoid" else torch.softmax(logits, -1)
    if expert_bias is not None or groups is not None:
        sel = scores if expert_bias is None else scores + expert_bias.to(scores.dtype)
        if groups is not None:
            n, top = groups
            group_scores = sel.unflatten(-1, (n, -1)).topk(2, dim=-1).values.sum(-1)
            chosen = group_scores.topk(top, -1).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
            sel = sel.masked_fill(~keep.repeat_interleave(sel.shape[-1] // n, dim=-1), float("-inf"))
        ids = torch.topk(sel, k, -1).indices
        w = scores.gather(1, ids)
    else:
        w, ids = torch.topk(scores, k, -1)
    if norm:
        w = w / w.sum(-1, keepdim=True)
    w = w * route_scale
    y = torch.zeros_like(x)
    for e in range(gate.shape[0]):
        tok, slot = torch.where(ids == e)
        if not len(tok):
            continue
        s = w[tok, slot, None]
        xe = x[tok] * s if score_before else x[tok]
        out = (F.silu(xe @ gate[e].t()) * (xe @ up[e].t())) @ down[e].t()
        y = y.index_add(0, tok, out if score_before else out * s)
    return y


def _hf_split(moe):
    gu, down = moe.experts.gate_up_proj, moe.experts.down_proj
    return gu[:, : gu.shape[1] // 2], gu[:, gu.shape[1] // 2 :], down


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _fresh(dtype=torch.float32, **kw):
    torch.manual_seed(0)
    moe = FlyMoE(H, INTER, E, 2, **kw).to(dtype)
    with torch.no_grad():
        moe.router_weight.normal_(0, 0.5)  # well separated scores: no near-ties in the top-k choice
        for p in moe.experts.parameters():
            p.normal_(0, 0.2)
    return moe


@pytest.mark.parametrize("path", ["plain", "fused"])
@pytest.mark.parametrize("norm", [True, False])
def test_matches_the_per_expert_loop_forward_and_gradients_fp32(path, norm):
    moe = _fresh(path=path, norm_topk_prob=norm)
    x = torch.randn(3, 7, H, requires_grad=True)
    y = moe(x)
    assert y.shape == x.shape
    g = torch.randn_like(y)
    (y * g).sum().backward()
    params = [moe.router_weight, *_hf_split(moe)]
    ref_params = [
        p.detach().double().requires_grad_()
        for p in (moe.router_weight, moe.experts.gate_up_proj, moe.experts.down_proj)
    ]
    xd = x.detach().double().requires_grad_()
    gu = ref_params[1]
    ref = loop_moe(xd.reshape(-1, H), ref_params[0], gu[:, :INTER], gu[:, INTER:], ref_params[2], 2, norm).reshape(
        x.shape
    )
    (ref * g.double()).sum().backward()
    assert _rel(y, ref) < 1e-5
    assert _rel(x.grad, xd.grad) < 1e-5
    assert _rel(moe.router_weight.grad, ref_params[0].grad) < 1e-5
    assert _rel(moe.experts.gate_up_proj.grad, gu.grad) < 1e-5
    assert _rel(moe.experts.down_proj.grad, ref_params[2].grad) < 1e-5
    assert params[0] is moe.router_weight


def test_fp16_kernels_plain_and_fused_agree_exactly_and_match_the_loop():
    x0 = torch.randn(20, H).half()
    results = {}
    for path in ("plain", "fused"):
        moe = _fresh(torch.float16, path=path)
        x = x0.clone().requires_grad_()
        y = moe(x)
        y.float().pow(2).sum().backward()
        results[path] = (y, x.grad, moe.router_weight.grad, moe.experts.gate_up_proj.grad, moe.experts.down_proj.grad)
        op = "moe_grouped_mm" if path == "fused" else "grouped_mm"
        assert {r["backend"] for r in DISPATCH_LOG.records(op)} == {"triton"}
    for a, b in zip(results["plain"], results["fused"], strict=True):
        assert torch.equal(a, b)
    moe = _fresh(torch.float16)
    gu, dn = moe.experts.gate_up_proj.double(), moe.experts.down_proj.double()
    ref = loop_moe(x0.double(), moe.router_weight.double(), gu[:, :INTER], gu[:, INTER:], dn, 2)
    assert _rel(results["fused"][0], ref) < 5e-3


@pytest.mark.parametrize("path", ["plain", "fused"])
def test_autocast_runs_the_experts_in_the_autocast_dtype(path):
    # bf16-mixed: fp32 parameters, bf16 expert GEMMs on the kernel (not an fp32 fallback), fp32 gradients
    moe = _fresh(path=path)
    x = torch.randn(3, 7, H, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = moe(x)
    op = "moe_grouped_mm" if path == "fused" else "grouped_mm"
    recs = DISPATCH_LOG.records(op)
    assert recs and {(r["dtype"], r["backend"]) for r in recs} == {("bfloat16", "triton")}
    assert _rel(y, moe(x)) < 2e-2  # close to the fp32 forward
    y.float().sum().backward()
    assert moe.experts.down_proj.grad.dtype == torch.float32 and x.grad.dtype == torch.float32


@pytest.mark.parametrize("score_before_experts", [False, True])
def test_autocast_combine_keeps_fp32_like_the_stock_blocks(score_before_experts):
    # HF blocks weight and sum the bf16 expert outputs in fp32 and return the input's dtype: so must we (and
    # torchtitan's score-before-experts path returns its input's dtype too)
    moe = _fresh(score_before_experts=score_before_experts)
    x = torch.randn(3, 7, H, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = moe(x)
    assert y.dtype == torch.float32
    assert (y != y.bfloat16().float()).float().mean() > 0.5  # not bf16 values in an fp32 tensor
    y.sum().backward()
    assert moe.router_weight.grad.dtype == torch.float32 and moe.router_weight.grad.abs().sum() > 0


def test_deterministic_and_empty_batch():
    moe = _fresh(torch.float16, path="fused")
    x = torch.randn(16, H).half().requires_grad_()
    grads = []
    for _ in range(2):
        x.grad = None
        moe.zero_grad()
        moe(x).float().sum().backward()
        grads.append((x.grad.clone(), moe.experts.gate_up_proj.grad.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    assert moe(torch.randn(0, H).half()).shape == (0, H)


@pytest.mark.parametrize("path", ["plain", "fused"])
def test_runs_under_deterministic_algorithms_without_reading_unwritten_memory(path):
    torch.use_deterministic_algorithms(True)  # also NaN-fills torch.empty: any unwritten row read would show
    try:
        moe = _fresh(torch.float16, path=path)
        x = torch.randn(14, H).half().requires_grad_()
        y = moe(x)
        y.float().sum().backward()
        grads = [x.grad, moe.router_weight.grad, moe.experts.gate_up_proj.grad, moe.experts.down_proj.grad]
        assert torch.isfinite(y).all() and all(torch.isfinite(g).all() for g in grads)
    finally:
        torch.use_deterministic_algorithms(False)


def _hf_blocks():
    from transformers import DeepseekV3Config, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    return {
        "mixtral": lambda: MixtralSparseMoeBlock(
            MixtralConfig(hidden_size=H, intermediate_size=INTER, num_local_experts=E, num_experts_per_tok=2)
        ),
        "qwen3": lambda: Qwen3MoeSparseMoeBlock(
            Qwen3MoeConfig(
                hidden_size=H, moe_intermediate_size=INTER, num_experts=E, num_experts_per_tok=3, norm_topk_prob=True
            )
        ),
        "olmoe": lambda: OlmoeSparseMoeBlock(
            OlmoeConfig(
                hidden_size=H, intermediate_size=INTER, num_experts=E, num_experts_per_tok=3, norm_topk_prob=False
            )
        ),
        "qwen2_shared": lambda: Qwen2MoeSparseMoeBlock(
            Qwen2MoeConfig(
                hidden_size=H,
                moe_intermediate_size=INTER,
                num_experts=E,
                num_experts_per_tok=2,
                shared_expert_intermediate_size=INTER,
            )
        ),
        "deepseek_v3": lambda: DeepseekV3MoE(
            DeepseekV3Config(
                hidden_size=H,
                moe_intermediate_size=INTER,
                n_routed_experts=E,
                num_experts_per_tok=2,
                n_group=2,
                topk_group=1,
                routed_scaling_factor=2.5,
                norm_topk_prob=True,
            )
        ),
    }


@pytest.mark.parametrize("model", ["mixtral", "qwen3", "olmoe", "qwen2_shared", "deepseek_v3"])
def test_wraps_transformers_v5_blocks_sharing_their_parameters(model):
    torch.manual_seed(0)
    block = _hf_blocks()[model]()
    for p in block.parameters():
        nn.init.normal_(p, std=0.3)
    if model == "deepseek_v3":  # a bias that changes the selection, and groups that matter
        block.gate.e_score_correction_bias.copy_(torch.randn(E) * 0.5)
    moe = FlyMoE.from_module(block)
    assert moe.experts.gate_up_proj is block.experts.gate_up_proj and moe.gate.weight is block.gate.weight
    x = torch.randn(2, 5, H)
    torch.testing.assert_close(moe(x), block(x), rtol=1e-5, atol=1e-5)
    sd, theirs = moe.state_dict(), block.state_dict()
    assert {k: v.shape for k, v in sd.items()} == {k: v.shape for k, v in theirs.items()}
    fresh = _hf_blocks()[model]()
    fresh.load_state_dict(sd, strict=True)
    torch.testing.assert_close(fresh(x), block(x))
    other = FlyMoE.from_module(_hf_blocks()[model]())
    other.load_state_dict(theirs, strict=True)
    torch.testing.assert_close(other(x), block(x), rtol=1e-5, atol=1e-5)


class _ListExpert(nn.Module):
    def __init__(self, names):
        super().__init__()
        self.names = names
        for name, (o, i) in zip(names, [(INTER, H), (INTER, H), (H, INTER)], strict=True):
            setattr(self, name, nn.Linear(i, o, bias=False))
        self.act_fn = nn.SiLU()

    def forward(self, x):
        g, u, d = (getattr(self, n) for n in self.names)
        return d(self.act_fn(g(x)) * u(x))


class _ListBlock(nn.Module):
    """A transformers-4 style block: a Linear router and an nn.ModuleList of per-expert MLPs."""

    def __init__(self, names, k=2, norm=True):
        super().__init__()
        self.top_k, self.norm_topk_prob = k, norm
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(_ListExpert(names) for _ in range(E))

    def forward(self, x):
        w, ids = torch.topk(torch.softmax(self.gate(x).float(), -1), self.top_k, -1)
        if self.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(ids == e)
            y = y.index_add(0, tok, expert(x[tok]) * w[tok, slot, None])
        return y


@pytest.mark.parametrize("layout", ["mixtral", "qwen"])
def test_per_expert_list_layouts_keep_their_state_dict(layout):
    torch.manual_seed(1)
    block = _ListBlock(LIST_NAMES[layout], norm=layout == "mixtral")
    for p in block.parameters():
        nn.init.normal_(p, std=0.3)
    moe = FlyMoE.from_module(block)
    assert moe.layout == layout
    x = torch.randn(9, H)
    torch.testing.assert_close(moe(x), block(x), rtol=1e-5, atol=1e-5)
    sd = moe.state_dict()
    assert {k: v.shape for k, v in sd.items()} == {k: v.shape for k, v in block.state_dict().items()}
    fresh = _ListBlock(LIST_NAMES[layout], norm=layout == "mixtral")
    fresh.load_state_dict(sd, strict=True)
    torch.testing.assert_close(fresh(x), block(x))
    other = FlyMoE(H, INTER, E, 2, layout=layout, norm_topk_prob=layout == "mixtral")
    other.load_state_dict(block.state_dict(), strict=True)
    torch.testing.assert_close(other(x), block(x), rtol=1e-5, atol=1e-5)
    # the per-expert entries are views of the stacked storage: in-place loading writes through
    gate_name = LIST_NAMES[layout][0]
    with torch.no_grad():
        other.state_dict()[f"experts.3.{gate_name}.weight"].fill_(0.5)
    assert (other.experts.gate_up_proj[3, :INTER] == 0.5).all()
    with pytest.raises(RuntimeError, match="Missing key"):
        other.load_state_dict({k: v for k, v in sd.items() if "experts.5." not in k}, strict=True)


@pytest.mark.parametrize("layout", ["mixtral", "qwen"])
def test_per_expert_list_keys_resolve_for_distributed_checkpoint(layout):
    # get_model_state_dict (Lightning's FSDP2 / model-parallel checkpointing) resolves each state_dict key by
    # attribute lookup; the per-expert keys must resolve and give the same tensors as state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    block = _ListBlock(LIST_NAMES[layout], norm=layout == "mixtral")
    moe = FlyMoE.from_module(block)
    sd, dcp = moe.state_dict(), get_model_state_dict(moe)
    assert list(dcp) == list(sd)
    for key, value in sd.items():
        assert torch.equal(dcp[key], value), key
    with pytest.raises(AttributeError):
        getattr(moe.experts, str(E))  # past the last expert


class _TitanRouter(nn.Module):
    def __init__(self, k, score_func, route_norm, route_scale, groups=None):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.top_k, self.score_func, self.route_norm, self.route_scale = k, score_func, route_norm, route_scale
        self.num_expert_groups, self.num_limited_groups = groups or (None, None)


class _TitanExperts(nn.Module):
    def __init__(self, legacy):
        super().__init__()
        up, down = ((E, H, INTER), (E, INTER, H)) if legacy else ((E, INTER, H), (E, H, INTER))
        self.w1, self.w2, self.w3 = (nn.Parameter(torch.randn(s) * 0.2) for s in (up, down, up))


class _TitanFF(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2, self.w3 = (
            nn.Linear(H, INTER, bias=False),
            nn.Linear(INTER, H, bias=False),
            nn.Linear(H, INTER, bias=False),
        )

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _TitanMoE(nn.Module):
    """torchtitan's MoE structure (router.gate, experts.w1/w2/w3, shared_experts, expert_bias)."""

    def __init__(
        self,
        legacy=False,
        score_before=True,
        score_func="softmax",
        route_norm=False,
        shared=True,
        balance=True,
        groups=None,
    ):
        super().__init__()
        self.router = _TitanRouter(2, score_func, route_norm, 1.5, groups)
        self.experts = _TitanExperts(legacy)
        self.shared_experts = _TitanFF() if shared else None
        self.score_before_experts = score_before
        self.legacy = legacy
        if balance:
            self.register_buffer("expert_bias", torch.randn(E) * 0.1)
        else:
            self.expert_bias = None
        self.register_buffer("tokens_per_expert", torch.zeros(E), persistent=False)

    def forward(self, x):
        ex = self.experts
        gate, up, down = (
            (ex.w1, ex.w3, ex.w2)
            if not self.legacy
            else (ex.w1.transpose(1, 2), ex.w3.transpose(1, 2), ex.w2.transpose(1, 2))
        )
        r = self.router
        y = loop_moe(
            x,
            r.gate.weight,
            gate,
            up,
            down,
            r.top_k,
            r.route_norm,
            r.score_func,
            r.route_scale,
            self.score_before_experts,
            self.expert_bias,
            None if r.num_expert_groups is None else (r.num_expert_groups, r.num_limited_groups),
        )
        return y + self.shared_experts(x) if self.shared_experts is not None else y


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(legacy=True, score_before=False),
        dict(score_func="sigmoid", route_norm=True, shared=False, balance=False),
        dict(score_func="sigmoid", route_norm=True, groups=(2, 1)),  # node-limited routing (DeepSeek-V3 in titan)
    ],
)
def test_torchtitan_layouts(kw):
    torch.manual_seed(2)
    titan = _TitanMoE(**kw)
    nn.init.normal_(titan.router.gate.weight, std=0.5)
    moe = FlyMoE.from_module(titan)
    assert moe.layout == ("torchtitan_legacy" if kw.get("legacy") else "torchtitan")
    assert (moe.n_groups, moe.topk_groups) == (kw.get("groups") or (None, None))
    assert moe.experts.w1 is titan.experts.w1
    x = torch.randn(11, H)
    torch.testing.assert_close(moe(x), titan(x), rtol=1e-5, atol=1e-5)
    assert {k: v.shape for k, v in moe.state_dict().items()} == {k: v.shape for k, v in titan.state_dict().items()}
    fresh = _TitanMoE(**kw)
    fresh.load_state_dict(moe.state_dict(), strict=True)
    torch.testing.assert_close(fresh(x), titan(x))
    if titan.expert_bias is not None:
        assert moe.tokens_per_expert.sum() == 11 * 2  # usage counted for the bias update, as torchtitan does


def test_torch_compile_fullgraph_both_paths():
    for path in ("plain", "fused"):
        moe = _fresh(torch.float16, path=path)
        x = torch.randn(12, H).half().requires_grad_()
        eager = moe(x)
        (ge,) = torch.autograd.grad(eager.float().sum(), x)
        compiled = torch.compile(moe, fullgraph=True)(x)
        (gc,) = torch.autograd.grad(compiled.float().sum(), x)
        # Inductor fuses SiLU * up in fp32 (eager rounds the SiLU to fp16 first): equal up to fp16 rounding
        assert _rel(compiled, eager) < 5e-3 and _rel(gc, ge) < 5e-3


def test_from_module_rejects_what_it_does_not_compute():
    from transformers import DeepseekV3Config, MixtralConfig, Qwen2MoeConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    ds = DeepseekV3MoE(
        DeepseekV3Config(hidden_size=H, moe_intermediate_size=INTER, n_routed_experts=8, num_experts_per_tok=2)
    )
    del ds.gate.routed_scaling_factor  # a corrected router without DeepSeek-V3's fields: its routing is read off its
    with pytest.raises(ValueError, match="router could not be run on tokens"):  # outputs, and it fails without them
        FlyMoE.from_module(ds)
    qwen2 = Qwen2MoeSparseMoeBlock(
        Qwen2MoeConfig(
            hidden_size=H,
            moe_intermediate_size=INTER,
            num_experts=E,
            num_experts_per_tok=2,
            shared_expert_intermediate_size=INTER,
        )
    )
    qwen2.shared_expert_gate = None
    with pytest.raises(ValueError, match="shared expert without its gate"):
        FlyMoE.from_module(qwen2)
    relu = MixtralSparseMoeBlock(
        MixtralConfig(hidden_size=H, intermediate_size=INTER, num_local_experts=E, hidden_act="relu")
    )
    with pytest.raises(ValueError, match="ReLU is not SiLU or GELU"):
        FlyMoE.from_module(relu)
    block = _ListBlock(LIST_NAMES["mixtral"])
    block.experts[1].act_fn = nn.GELU()  # one expert's activation differs from the others'
    with pytest.raises(ValueError, match="mix activations"):
        FlyMoE.from_module(block)
    with pytest.raises(ValueError, match="no `experts`"):
        FlyMoE.from_module(nn.Linear(4, 4))


def test_constructor_checks():
    with pytest.raises(ValueError, match="unknown layout"):
        FlyMoE(H, INTER, E, 2, layout="megatron")
    with pytest.raises(ValueError, match="top_k"):
        FlyMoE(H, INTER, E, 7)
    with pytest.raises(ValueError, match="path"):
        FlyMoE(H, INTER, E, 2, path="fast")
    with pytest.raises(ValueError, match="given together"):
        FlyMoE(H, INTER, E, 2, n_groups=2)
    with pytest.raises(ValueError, match="groups of >= 2"):
        FlyMoE(H, INTER, E, 2, n_groups=E, topk_groups=1)
    with pytest.raises(ValueError, match="topk_groups must be in"):
        FlyMoE(H, INTER, E, 2, n_groups=2, topk_groups=3)
    with pytest.raises(ValueError, match="reachable"):  # k larger than the experts of the kept groups
        FlyMoE(H, INTER, E, E // 2 + 1, n_groups=2, topk_groups=1)
    with pytest.raises(ValueError, match="last dim"):
        FlyMoE(H, INTER, E, 2)(torch.randn(3, H + 1))
    with pytest.raises(ValueError, match="activation must be one of"):
        FlyMoE(H, INTER, E, 2, activation="relu")
    with pytest.raises(ValueError, match="renorm_eps"):
        FlyMoE(H, INTER, E, 2, renorm_eps=-1.0)


@pytest.mark.parametrize("hidden_act, activation", [("gelu", "gelu"), ("gelu_pytorch_tanh", "gelu_tanh"),
                                                    ("gelu_new", "gelu_tanh")])  # fmt: skip
@pytest.mark.parametrize("path", ["plain", "fused"])
def test_geglu_experts_equal_the_stock_block_forward_and_gradients(hidden_act, activation, path):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    torch.manual_seed(0)
    config = MixtralConfig(hidden_size=H, intermediate_size=INTER, num_local_experts=E, hidden_act=hidden_act)
    block = MixtralSparseMoeBlock(config)
    for p in block.parameters():
        nn.init.normal_(p, std=0.3)
    moe = FlyMoE.from_module(block, path=path)
    assert moe.activation == activation and f"activation={activation}" in repr(moe)
    ref = MixtralSparseMoeBlock(config)
    ref.load_state_dict(block.state_dict())
    x = torch.randn(2, 5, H) * 2
    x_ref = x.clone().requires_grad_()
    x = x.requires_grad_()
    y, y_ref = moe(x), ref(x_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    silu = MixtralSparseMoeBlock(MixtralConfig(hidden_size=H, intermediate_size=INTER, num_local_experts=E))
    silu.load_state_dict(block.state_dict())
    assert _rel(FlyMoE.from_module(silu)(x.detach()), y.detach()) > 1e-2  # the activation matters here
    g = torch.randn_like(y)
    (y * g).sum().backward()
    (y_ref * g).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    for (name, p), p_ref in zip(block.named_parameters(), ref.parameters(), strict=True):
        if hidden_act == "gelu_new":  # the same function by another formula (tanh of a cubic): autograd rounds apart
            assert _rel(p.grad, p_ref.grad) < 1e-6, name
        else:
            torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("act", [nn.GELU(), nn.GELU(approximate="tanh")])
def test_geglu_per_expert_list_block(act):
    torch.manual_seed(1)
    block = _ListBlock(LIST_NAMES["qwen"])
    for expert in block.experts:
        expert.act_fn = act
    for p in block.parameters():
        nn.init.normal_(p, std=0.3)
    moe = FlyMoE.from_module(block)
    assert moe.activation == {"none": "gelu", "tanh": "gelu_tanh"}[act.approximate]
    x = torch.randn(9, H)
    torch.testing.assert_close(moe(x), block(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("eps", [0.0, 1e-6])
@pytest.mark.parametrize("path", ["plain", "fused"])
def test_renorm_eps_is_the_family_formula_forward_and_gradients(eps, path):
    moe = _fresh(path=path, score_func="sigmoid", route_scale=2.5, renorm_eps=eps)
    x = (torch.randn(12, H) * torch.tensor([1.0, 40.0]).repeat(6).unsqueeze(1)).requires_grad_()  # tiny sums too
    y = moe(x)
    xd = x.detach().clone().requires_grad_()  # fp32 as the block: the sigmoid's fp32 tail is what is renormalised
    logits = F.linear(xd, moe.router_weight.detach())
    ids = logits.topk(2, -1).indices  # ranked by logit (saturated sigmoids tie in fp32)
    w = torch.sigmoid(logits).gather(1, ids)
    w = w / (w.sum(-1, keepdim=True) + eps) * 2.5
    gu, down = moe.experts.gate_up_proj.detach(), moe.experts.down_proj.detach()
    ref = torch.zeros_like(xd)
    for e in range(E):
        tok, slot = torch.where(ids == e)
        h = F.silu(xd[tok] @ gu[e, :INTER].t()) * (xd[tok] @ gu[e, INTER:].t())
        ref = ref.index_add(0, tok, (h @ down[e].t()) * w[tok, slot, None])
    assert _rel(y, ref) < 1e-5
    g = torch.randn_like(y)
    (y * g).sum().backward()
    (ref * g).sum().backward()
    assert _rel(x.grad, xd.grad) < 1e-5
    if eps == 1e-6:  # the epsilon decides the weights of tokens whose selected scores are tiny: not the op's 1e-20
        default = _fresh(path=path, score_func="sigmoid", route_scale=2.5)
        assert _rel(default(x.detach()), y.detach()) > 1e-3
