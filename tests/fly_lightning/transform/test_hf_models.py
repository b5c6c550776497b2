"""fly_lightning.transform on small real transformers models: what is swapped, and that nothing else changes.

Every model of the conftest (built from a config, no download) is transformed in place and compared with an untouched
deep copy: same function (logits and every parameter gradient), same state_dict, interchangeable checkpoints.
"""

from collections import Counter

import pytest
import torch
from torch import nn

import fly_lightning
from fly_lightning import DISPATCH_LOG, FlyMoE, FlyRMSNorm, TransformSummary


def _kinds(swapped):
    return dict(Counter(f"{cls} -> {matcher}" for _, cls, matcher in swapped))


def _pair(hf, name, **overrides):
    """(reference, model to transform): two identical copies."""
    ref = hf.build(name, **overrides)
    return ref, hf.deepcopy(ref)


def _check_dispatch_log(n_norms, n_moe):
    """Every swapped module dispatched; each decision names the backend that ran, and ATen only with a reason."""
    records = DISPATCH_LOG.records()
    for r in records:
        assert r["backend"] in ("triton", "aten"), r  # CPU: Triton through the interpreter, or ATen
        if r["backend"] == "aten":
            assert r["reason"], r  # a fallback always says why
    by_op = Counter()
    for r in records:
        by_op[r["op"]] += r["calls"]
    # one forward: each swapped norm called once, each MoE block routes once
    assert by_op["rms_norm"] == n_norms
    assert by_op["moe_route"] == n_moe
    assert by_op["grouped_mm"] + by_op["moe_grouped_mm"] == 2 * n_moe  # gate/up and down GEMMs
    # the interpreter makes Triton available on CPU: the norms must not all have fallen back
    assert any(r["op"] == "rms_norm" and r["backend"] == "triton" for r in records)
    if n_moe:
        assert any(r["op"] == "moe_route" and r["backend"] == "triton" for r in records)


def test_summary_lists_swaps_and_counts_match(hf, model_name):
    model = hf.build(model_name)
    summary = fly_lightning.transform(model)
    assert isinstance(summary, TransformSummary)
    assert _kinds(summary.swapped) == hf.expected_swaps(model_name)
    assert summary.left == []  # default configs: everything recognised is swappable
    assert summary.unrecognised == Counter()  # no norm/MoE-looking module of these models goes unnoticed
    for path, _, matcher in summary.swapped:
        # each listed path now holds our module
        expected = FlyMoE if matcher.startswith("moe:") else FlyRMSNorm
        assert isinstance(model.get_submodule(path), expected), path
    leftover = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm") and not isinstance(m, FlyRMSNorm)]
    assert leftover == []
    text = str(summary)
    assert f"swapped {len(summary.swapped)} module(s)" in text
    for kind, n in hf.expected_swaps(model_name).items():
        assert f"{n} x {kind}" in text


def test_same_function_fp32_logits_and_gradients(hf, model_name):
    ref, model = _pair(hf, model_name)
    summary = fly_lightning.transform(model)
    counts = Counter(m.split(":")[0] for _, _, m in summary.swapped)
    ids = hf.tokens()
    DISPATCH_LOG.reset()
    out = model(ids, labels=ids)
    _check_dispatch_log(counts["rms_norm"], counts["moe"])  # before backward (which dispatches nothing new)
    out_ref = ref(ids, labels=ids)
    torch.testing.assert_close(out.logits, out_ref.logits, rtol=1e-5, atol=1e-5)
    out.loss.backward()
    out_ref.loss.backward()
    params, params_ref = dict(model.named_parameters()), dict(ref.named_parameters())
    assert list(params) == list(params_ref)  # same names in the same order (optimizer state is saved by position)
    for name, p_ref in params_ref.items():
        p = params[name]
        assert (p.grad is None) == (p_ref.grad is None), name
        if p_ref.grad is not None:
            torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_state_dict_unchanged_and_interchangeable(hf, model_name):
    ref, model = _pair(hf, model_name)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fly_lightning.transform(model)
    after = model.state_dict()
    assert list(after) == list(before)
    for k, v in before.items():
        assert after[k].shape == v.shape and after[k].dtype == v.dtype, k
        assert torch.equal(after[k], v), k

    # original checkpoint -> swapped model: loads strictly, and the loaded values are the ones used
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.load_state_dict(ref.state_dict(), strict=True)
    ids = hf.tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)

    # swapped model's checkpoint -> original model
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.9)
    fresh = hf.build(model_name, seed=7)
    fresh.load_state_dict(model.state_dict(), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_second_transform_is_idempotent(hf, model_name):
    model = hf.build(model_name)
    fly_lightning.transform(model)
    modules = dict(model.named_modules())
    again = fly_lightning.transform(model)
    assert again.swapped == [] and again.left == []
    after = dict(model.named_modules())
    assert list(after) == list(modules)
    assert all(after[k] is m for k, m in modules.items())  # nothing re-wrapped


def test_ops_filter_leaves_the_other_family(hf, model_name):
    model = hf.build(model_name)
    expected = hf.expected_swaps(model_name)
    norms_only = fly_lightning.transform(model, ops=["rms_norm"])
    assert _kinds(norms_only.swapped) == {k: n for k, n in expected.items() if "-> rms_norm:" in k}
    n_moe = sum(n for k, n in expected.items() if "-> moe:" in k)
    assert len(norms_only.left) == n_moe
    for path, _, reason in norms_only.left:
        assert reason == "family 'moe' not selected"
        assert not isinstance(model.get_submodule(path), FlyMoE)
    # then the MoE family alone: swaps exactly the blocks left before
    moe_only = fly_lightning.transform(model, ops=["moe"])
    assert _kinds(moe_only.swapped) == {k: n for k, n in expected.items() if "-> moe:" in k}
    assert moe_only.left == []


def test_moe_only_leaves_norms_with_reason(hf, moe_model_name):
    model = hf.build(moe_model_name)
    summary = fly_lightning.transform(model, ops=["moe"])
    n_norms = sum(n for k, n in hf.expected_swaps(moe_model_name).items() if "-> rms_norm:" in k)
    assert [r for _, _, r in summary.left] == ["family 'rms_norm' not selected"] * n_norms
    assert all(m.startswith("moe:") for _, _, m in summary.swapped) and summary.swapped


def test_unknown_family_is_an_error(hf):
    with pytest.raises(ValueError, match="unknown op families"):
        fly_lightning.transform(hf.build("llama"), ops=["rms_norm", "layer_norm"])


@pytest.mark.parametrize("per_call", [False, True], ids=["config", "per_call"])
def test_router_logits_and_aux_loss_from_swapped_blocks(hf, moe_model_name, per_call):
    # transformers records router logits (for the auxiliary load-balancing loss) with hooks on its router class: the
    # swapped blocks keep that router module and run it while it is observed, so the aux loss and its gradients stay
    ref, model = _pair(hf, moe_model_name, output_router_logits=not per_call)
    summary = fly_lightning.transform(nn.ModuleDict({"model": model}))  # wrapped, as in a LightningModule
    assert _kinds(summary.swapped) == hf.expected_swaps(moe_model_name) and summary.left == []
    ids = hf.tokens()
    kw = dict(output_router_logits=True) if per_call else {}
    out, out_ref = model(ids, labels=ids, **kw), ref(ids, labels=ids, **kw)
    torch.testing.assert_close(out.logits, out_ref.logits, rtol=1e-5, atol=1e-5)
    assert len(out.router_logits) == len(out_ref.router_logits) > 0
    for got, expected in zip(out.router_logits, out_ref.router_logits, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    if out_ref.aux_loss is not None:  # models without the loss still return the logits
        torch.testing.assert_close(out.aux_loss, out_ref.aux_loss, rtol=1e-5, atol=1e-6)
    out.loss.backward()
    out_ref.loss.backward()
    grads = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_router_module_runs_only_while_observed(hf):
    model = hf.build("qwen3_moe")
    fly_lightning.transform(model)
    blocks = [m for m in model.modules() if isinstance(m, FlyMoE)]
    calls = []
    for b in blocks:
        original = b.gate.forward
        b.gate.forward = lambda x, original=original: calls.append(1) or original(x)
    ids = hf.tokens()
    with torch.no_grad():
        model(ids)
        assert calls == []  # nobody observes the routers: FlyMoE computes the logits itself
        model(ids, output_router_logits=True)
    assert len(calls) == len(blocks) > 0  # transformers' recording hooks are now on them


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3"])
def test_bf16_moe_forward_within_bf16_tolerance(hf, name):
    ref, model = _pair(hf, name)
    ref.to(torch.bfloat16).eval()
    model.to(torch.bfloat16).eval()
    summary = fly_lightning.transform(model)
    assert _kinds(summary.swapped) == hf.expected_swaps(name)
    ids = hf.tokens()
    DISPATCH_LOG.reset()
    with torch.no_grad():
        got = model(ids).logits.float()
        expected = ref(ids).logits.float()
    assert got.dtype == expected.dtype
    rel = ((got - expected).norm() / expected.norm()).item()
    assert rel < 2e-2, rel  # a few bf16 roundings; a wrong expert or weight gives O(1)
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
    # in bf16 the grouped GEMMs run on Triton too (fp32 fell back to ATen, with the reason)
    gemms = [r for r in DISPATCH_LOG.records() if r["op"] in ("grouped_mm", "moe_grouped_mm")]
    assert gemms and all(r["backend"] == "triton" and r["dtype"] == "bfloat16" for r in gemms)


def test_hf_gradient_checkpointing_gives_equal_gradients(hf):
    ref, model = _pair(hf, "qwen3_moe")
    fly_lightning.transform(model)
    if hasattr(model, "activation_checkpointing_enable"):  # newer transformers 5.x
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = hf.tokens()
    DISPATCH_LOG.reset()
    model(ids, labels=ids).loss.backward()
    ref(ids, labels=ids).loss.backward()
    # the decoder layer ran twice (forward, then recomputed in backward): its norms and routing dispatched again
    calls = Counter()
    for r in DISPATCH_LOG.records():
        calls[r["op"]] += r["calls"]
    assert calls["moe_route"] == 2 and calls["rms_norm"] == 4 * 2 + 1  # 4 norms in the layer + the final norm
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("name, fp32", [("deepseek_v3", True), ("qwen3_moe", False), ("mixtral", False)])
def test_router_logits_in_the_dtype_the_original_router_uses(hf, name, fp32):
    # DeepSeek-style routers make fp32 logits even from bf16 weights; in bf16 a bf16 product would change choices
    model = hf.build(name).to(torch.bfloat16)
    fly_lightning.transform(model)
    moes = [m for m in model.modules() if isinstance(m, fly_lightning.FlyMoE)]
    assert moes and all(m.router_fp32 is fp32 for m in moes)


def test_router_with_state_we_do_not_model_is_left_with_reason():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Ernie4_5_MoeConfig"):
        pytest.skip("this transformers has no Ernie 4.5 MoE")
    cfg = transformers.Ernie4_5_MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, moe_num_experts=4, moe_k=2,
    )  # fmt: skip
    model = transformers.Ernie4_5_MoeForCausalLM(cfg)
    for layer in model.model.layers:  # state the block does not model, beside the statics bias (which it does)
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.register_buffer("expert_usage", torch.zeros(4))
    summary = fly_lightning.transform(model)
    left = [why for _, cls, why in summary.left if cls == "Ernie4_5_MoeSparseMoeBlock"]
    assert left and left[0] == "router has state this block does not model: expert_usage", left
    plain = transformers.Ernie4_5_MoeForCausalLM(cfg)  # Ernie 4.5's moe_statics bias alone: modelled, swapped
    swapped = [p for p, cls, _ in fly_lightning.transform(plain).swapped if cls == "Ernie4_5_MoeSparseMoeBlock"]
    assert swapped and "gate.moe_statics.e_score_correction_bias" in plain.get_submodule(swapped[0]).state_dict()


def test_swapped_blocks_and_norms_keep_hooks_and_mode(hf, moe_model_name):
    """A forward hook on an MoE block or a norm keeps firing after the swap (activation statistics, load monitors),
    and an eval-mode model stays in eval mode throughout."""
    model = hf.build(moe_model_name).eval()
    layer = model.model.layers[0]
    calls = {"mlp": 0, "norm": 0}
    layer.mlp.register_forward_hook(lambda m, args, out: calls.__setitem__("mlp", calls["mlp"] + 1))
    handle = layer.input_layernorm.register_forward_pre_hook(
        lambda m, args: calls.__setitem__("norm", calls["norm"] + 1)
    )
    fly_lightning.transform(model)
    assert getattr(model.model.layers[0].mlp, "_fly_swapped", False)
    model(hf.tokens())
    assert calls == {"mlp": 1, "norm": 1}
    assert not any(m.training for m in model.modules())
    handle.remove()  # the handle still reaches the swapped norm's hooks
    model(hf.tokens())
    assert calls == {"mlp": 2, "norm": 1}


def test_a_block_under_accelerate_hooks_is_left_with_reason(hf):
    """accelerate's device-map and offload hooks (``_hf_hook``) wrap ``forward`` on the instance: a swap would drop
    them (as ``add_hook_to_module`` leaves a module)."""
    model = hf.build("mixtral")
    mlp = model.model.layers[0].mlp
    original = mlp.forward
    mlp._hf_hook, mlp.forward = object(), lambda *args, **kw: original(*args, **kw)
    summary = fly_lightning.transform(model, ops=["moe"])
    left = {path: why for path, _, why in summary.left}
    assert "accelerate hooks" in left["model.layers.0.mlp"]
    assert model.model.layers[0].mlp is mlp
