"""Every MoE family of the installed transformers, found in the library (not listed by hand), built tiny from its own
config class with the sizes shrunk generically, then transformed: each MoE block is swapped or left with a reason,
and the transformed model computes the same logits, loss and gradients as an untouched copy (fp32, 1e-5). Never a
crash, never a difference. Routers get well-separated weights and selection biases random values, so that the
comparison sees which experts a block picks and how it uses the bias.

Discovery: a ``models/<name>/modeling_<name>.py`` that defines an ``nn.Module`` class named like an MoE block or an
expert container (``...Experts``, ``...MoE``, ``...SparseMoeBlock``, ...). The model built is the family's causal LM
(its text model type first), else its base model. Families whose tiny model cannot be built by the generic shrink
are in ``NOT_BUILT`` with the reason; families whose tiny model has no MoE block are in ``NO_MOE_BLOCK``. Both are
reported as skips with their reason, never silently; a family that builds although listed fails the test (so the
lists stay true).
"""

from __future__ import annotations

import copy
import os
import re

import pytest
import torch

import fly_lightning
from fly_lightning.modules import FlyExperts

transformers = pytest.importorskip("transformers")

_MOE_CLASS = re.compile(
    r"^class (\w*(?:Experts|MoE|Moe|MoEBlock|MoeBlock|MoELayer|MoeLayer|SparseMLP))\((?:nn\.Module|\w+)\)", re.M
)
H, E, K, VOCAB, LAYERS = 32, 4, 2, 64, 2
# generic small sizes: applied to every config (and sub-config) that has the field; 2 layers so that a family whose
# first layer is dense or linear-attention still has an MoE layer
_SIZES = dict(
    hidden_size=H, intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=24,
    num_attention_heads=2, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=64,
    num_experts=E, num_local_experts=E, n_routed_experts=E, moe_num_experts=E,
    num_experts_per_tok=K, moe_k=K, top_k=K, moe_topk=K,
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
    first_k_dense_replace=0, mlp_only_layers=[], decoder_sparse_step=1, n_group=1, topk_group=1, moe_layer_freq=1,
    interleave_moe_layer_step=1, expert_layer_period=1, expert_layer_offset=0,
    pad_token_id=0, bos_token_id=0, eos_token_id=0, decoder_start_token_id=0,
    num_layers=LAYERS, d_model=H, d_ff=48, d_kv=16, num_heads=2, num_decoder_layers=1, encoder_layers=1,
    decoder_layers=1, encoder_ffn_dim=48, decoder_ffn_dim=48, encoder_attention_heads=2, decoder_attention_heads=2,
    expert_capacity=64,
)  # fmt: skip
# per-family values the generic sizes break (the family's own config validation says so)
_OVERRIDES = {
    "zaya": dict(num_experts_per_tok=1),  # ZAYA supports top-1 routing only
    # LFM2-MoE's config leaves its layer pattern None (a checkpoint's sets it): a conv and an attention layer, both MoE
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=0),
    # Gemma 4's (and DiffusionGemma's) text config has its MoE off / unsized and per-layer entries keyed by the full
    # depth's layer indices
    "diffusion_gemma": dict(num_experts=E, top_k_experts=K, moe_intermediate_size=24, per_layer_config={}),
    "gemma4": dict(enable_moe_block=True, num_experts=E, top_k_experts=K, moe_intermediate_size=24, per_layer_config={},
                   vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8),
}  # fmt: skip
# per-family fields set (also where absent) in the config and its nested sub-config dicts: DBRX names its sizes
# differently (n_layers, n_heads, ffn_config.ffn_hidden_size / moe_top_k), and transformers 5.24-5.25's DBRX reads
# attn_config.rope_theta, which DbrxAttentionConfig does not define, and clamps by clip_qkv even when it is None
_NESTED = {
    "dbrx": dict(
        n_layers=LAYERS, n_heads=2, max_seq_len=64, attn_config=dict(rope_theta=10000.0, clip_qkv=8.0, kv_n_heads=2),
        ffn_config=dict(ffn_hidden_size=48, moe_top_k=K),
    ),
}  # fmt: skip

# families whose tiny model the generic shrink cannot build or run (transformers 5.24-5.25; the error the build gives)
NOT_BUILT = {
    "deepseek_ocr2": "OCR model: the base model needs image inputs (fails on input_ids only)",
    "deepseek_v2": "routing needs topk_method/group fields the generic shrink leaves inconsistent (top-k None)",
    "dots1": "config/weight init fails on the shrunk sizes (empty() called with a shape tuple)",
    "dots3_note": "per_layer_config keyed by layer indices beyond the shrunk depth",
    "ernie4_5_vl_moe": "moe_intermediate_size is a per-modality list (text, vision)",
    "glm4v_moe": "mrope sections sized for the full head dim",
    "kolibri1_1": "index_layers (indexed-attention layer indices) beyond the shrunk depth (transformers 5.25)",
    "glm5_next": "DSA attention layers require NoPE (qk_rope_head_dim 0), which the generic MLA sizes set",
    "granitemoehybrid": "mamba_n_heads must divide mamba_expand * hidden_size",
    "hunyuan_v1_moe": "rope scaling field left None by the shrunk config (None ** float)",
    "hy_v4_vl": "mrope_section must sum to the shrunk head dim",
    "kimi_linear": "linear-attention head/rope sizes inconsistent with the shrunk sizes (top-k index out of range)",
    "longcat_flash": "MLA split sizes fixed independently of the shrunk head dims",
    "mimo_v2_flash": "per-layer attention head counts inconsistent with the shrunk sizes",
    "mistral4": "MLA rope head dim inconsistent with head_dim after the shrink",
    "step3p7": "no causal LM / base model class registered for its text model type",
    "vitpose_backbone": "vision backbone (MoE MLP over pixel features), not a language model",
}
# families whose tiny model has no MoE block at all (the class the scan found is not instantiated)
NO_MOE_BLOCK = {
    "bailing_hybrid": "its MoE layers start after the shrunk depth",
    "beam": "its MoE layers start after the shrunk depth",
    "deepseek_v32": "its MoE layers start after the shrunk depth",
    "doge": "its MoE layers start after the shrunk depth",
    "glm_moe_dsa": "its MoE layers start after the shrunk depth",
}

# families whose blocks the transform must swap (at least one block of the tiny model; the rest left with a reason):
# a regression that leaves one of these fails here rather than passing as "left"
MUST_SWAP = {
    "afmoe", "aria", "axk2", "cohere2_moe", "dbrx", "deepseek_v3", "diffusion_gemma", "ernie4_5_moe", "exaone_moe",
    "flex_olmo", "gemma4", "glm4_moe", "glm4_moe_lite", "glm4v_moe", "granitemoe", "granitemoe_swa", "granitemoeshared",
    "jamba", "laguna", "lfm2_moe", "llama4", "mellum", "mimo_v2_flash", "minicpm5_moe", "minimax", "minimax_m2",
    "mixtral", "olmoe", "qwen2_moe", "qwen3_5_moe", "qwen3_moe", "qwen3_next", "qwen3_omni_moe", "qwen3_vl_moe",
    "qwen4_exp", "solar_open",
}  # fmt: skip
# of those, families whose experts are swapped alone (FlyExperts; the router stays stock): Gemma 4 and DiffusionGemma
# inline the MoE in the decoder layer, with a router that normalises and scales its own input and each expert's weight
EXPERTS_ONLY = {"diffusion_gemma", "gemma4"}


def discover() -> dict[str, list[str]]:
    """``{family directory: [MoE-like class names]}`` for the installed transformers (source scan, no imports)."""
    root = os.path.dirname(transformers.models.__file__)
    found = {}
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name, f"modeling_{name}.py")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                classes = _MOE_CLASS.findall(f.read())
            if classes:
                found[name] = classes
    return found


FAMILIES = discover()


def _set_nested(d: dict, values: dict) -> None:
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(d.get(key), dict):
            _set_nested(d[key], value)
        else:
            d[key] = value


def _shrink(d: dict, family: str) -> dict:
    old = d.get("num_hidden_layers")
    for key, value in list(d.items()):
        if isinstance(value, dict):
            _shrink(value, family)
        elif key in _SIZES and value is not None:
            d[key] = copy.copy(_SIZES[key])
    d.update({k: v for k, v in _OVERRIDES.get(family, {}).items() if k in d})
    if old is not None:
        d["num_hidden_layers"] = LAYERS
        for key, value in list(d.items()):  # per-layer lists (layer_types, ...) follow the depth
            if isinstance(value, list) and len(value) == old and old != LAYERS:
                d[key] = value[:LAYERS]
    return d


def _model_class(family: str) -> tuple[str, str]:
    """(model type, model class name): the text model type's causal LM first, else the base model."""
    from transformers.models.auto import configuration_auto, modeling_auto

    types = [
        t for t in configuration_auto.CONFIG_MAPPING_NAMES if configuration_auto.model_type_to_module_name(t) == family
    ]
    types = [t for t in types if t.endswith("_text")] + [t for t in types if not t.endswith("_text")]
    for mapping in (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, modeling_auto.MODEL_MAPPING_NAMES):
        for t in types:
            if t in mapping:
                return t, mapping[t]
    raise LookupError(f"{family}: no causal LM or base model class for model types {types}")


def build(family: str, seed: int = 0, fields_set: dict | None = None) -> torch.nn.Module:
    """The family's tiny model; ``fields_set``: config fields set after the shrink (nested dicts merged)."""
    from transformers.models.auto import configuration_auto

    model_type, model_cls = _model_class(family)
    config_cls = getattr(transformers, configuration_auto.CONFIG_MAPPING_NAMES[model_type])
    fields = _shrink(config_cls().to_dict(), family)
    _set_nested(fields, _NESTED.get(family, {}))
    _set_nested(fields, fields_set or {})
    config = config_cls(**fields)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # routers well separated (no near-ties in the top k); selection biases that matter
        for p in model.parameters():
            if p.dim() == 2 and p.shape == (E, H):
                p.normal_(0, 0.5, generator=g)
        for name, b in [*model.named_buffers(), *model.named_parameters()]:
            if b.shape == (E,) and "bias" in name:
                b.copy_(torch.randn(E, generator=g) * 0.5)
    return model


def _run(model: torch.nn.Module, ids: torch.Tensor):
    kw = dict(input_ids=ids, use_cache=False)
    if getattr(model.config, "is_encoder_decoder", False):
        kw["decoder_input_ids"] = ids
    torch.manual_seed(5)  # same dropout masks in both models (the swapped blocks draw no random numbers)
    out = model(**kw)
    first = out.logits if getattr(out, "logits", None) is not None else out[0]
    loss = torch.nn.functional.cross_entropy(first.flatten(0, -2), ids.flatten()) if first.shape[-1] == VOCAB else None
    loss = loss if loss is not None else first.float().square().mean()
    return first, loss


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_swapped_with_equal_numerics_or_left_with_reason(family):
    if family in NOT_BUILT:
        try:
            _run(build(family), torch.zeros(1, 2, dtype=torch.long))
        except Exception:  # noqa: BLE001 - expected: the listed reason
            pytest.skip(f"not built: {NOT_BUILT[family]}")
        pytest.fail(f"{family} builds and runs now: remove it from NOT_BUILT")
    model = build(family)
    moe_classes = set(FAMILIES[family])
    blocks = [n for n, m in model.named_modules() if type(m).__name__ in moe_classes]
    if family in NO_MOE_BLOCK:
        assert not blocks, f"{family} has MoE blocks now: remove it from NO_MOE_BLOCK"
        pytest.skip(f"no MoE block: {NO_MOE_BLOCK[family]}")
    assert blocks, f"{family}: tiny model has no {sorted(moe_classes)} module"
    _check_transformed(family, model)


# families whose experts take the config's activation (``ACT2FN[hidden_act]``), one per conversion path (a known
# block, DeepSeek-V3's groups, a router module with the experts probe, a routing read off the router): built with GELU
# experts instead, they swap with GeGLU experts and equal numerics too
GELU_FAMILIES = ("mixtral", "deepseek_v3", "granitemoe", "minimax_m2")


@pytest.mark.parametrize("hidden_act, activation", [("gelu", "gelu"), ("gelu_pytorch_tanh", "gelu_tanh")])
@pytest.mark.parametrize("family", GELU_FAMILIES)
def test_gelu_experts_swapped_with_equal_numerics(family, hidden_act, activation):
    model = build(family, fields_set=dict(hidden_act=hidden_act))
    summary = _check_transformed(family, model)
    assert summary.swapped and not [r for _, c, r in summary.left if "RMSNorm" not in c], summary
    assert {model.get_submodule(p).activation for p, _, _ in summary.swapped} == {activation}


def _check_transformed(family: str, model: torch.nn.Module):
    """Transform ``model`` (MoE only) and compare it with an untouched copy: logits, loss and every gradient."""
    ref = copy.deepcopy(model)
    summary = fly_lightning.transform(model, ops=["moe"])
    for path, _, reason in summary.left:
        assert reason, path
    blocks = [p for p, _, m in summary.swapped if m != "moe:hf_experts"]
    alone = [p for p, _, m in summary.swapped if m == "moe:hf_experts"]
    for path in blocks:
        assert isinstance(model.get_submodule(path), fly_lightning.FlyMoE), path
    for path in alone:
        assert isinstance(model.get_submodule(path), FlyExperts), path
    assert bool(alone) == (family in EXPERTS_ONLY), summary.swapped
    if family in MUST_SWAP:
        assert summary.swapped, f"{family}: no block swapped ({summary.left})"
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    fly_lightning.DISPATCH_LOG.reset()
    got, loss = _run(model, ids)
    calls = {op: sum(r["calls"] for r in fly_lightning.DISPATCH_LOG.records() if r["op"] == op)
             for op in ("moe_route", "swiglu")}  # fmt: skip
    assert calls["moe_route"] == len(blocks)  # every swapped block ran, through the dispatcher
    assert calls["swiglu"] == len(summary.swapped)  # and every swapped experts container
    want, loss_ref = _run(ref, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-5)
    loss.backward()
    loss_ref.backward()
    params, params_ref = dict(model.named_parameters()), dict(ref.named_parameters())
    assert list(params) == list(params_ref)
    for name, p_ref in params_ref.items():
        p = params[name]
        assert (p.grad is None) == (p_ref.grad is None), name
        if p_ref.grad is not None:
            torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    return summary
