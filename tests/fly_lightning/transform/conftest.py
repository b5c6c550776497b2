"""Small transformers models built from configs (no download), for the transform tests."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

VOCAB = 64
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=64,
    intermediate_size=48,
)
# name -> (config class, model class, config overrides, expected swaps {original class -> matcher:variant: count})
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, {"LlamaRMSNorm -> rms_norm:llama": 3}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}, {"MistralRMSNorm -> rms_norm:llama": 3}),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2),
        {"MixtralRMSNorm -> rms_norm:llama": 3, "MixtralSparseMoeBlock -> moe:hf_v5": 1},
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40),
        {"Qwen2MoeRMSNorm -> rms_norm:llama": 3, "Qwen2MoeSparseMoeBlock -> moe:hf_v5": 1},
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}, {"Qwen3RMSNorm -> rms_norm:llama": 5}),  # + q_norm, k_norm
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True),
        {"Qwen3MoeRMSNorm -> rms_norm:llama": 5, "Qwen3MoeSparseMoeBlock -> moe:hf_v5": 1},
    ),
    "olmoe": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        dict(num_experts=4, num_experts_per_tok=2, intermediate_size=24, eos_token_id=None, pad_token_id=None),
        {"OlmoeRMSNorm -> rms_norm:llama": 5, "OlmoeSparseMoeBlock -> moe:hf_v5": 1},
    ),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}, {"GemmaRMSNorm -> rms_norm:gemma": 3}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {}, {"Gemma2RMSNorm -> rms_norm:gemma": 5}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {}, {"Gemma3RMSNorm -> rms_norm:gemma": 7}),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            moe_intermediate_size=24,
            first_k_dense_replace=0,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            head_dim=8,
            num_key_value_heads=2,  # MLA: one key/value head per query head
        ),
        {"DeepseekV3RMSNorm -> rms_norm:llama": 5, "DeepseekV3MoE -> moe:hf_v5": 1},
    ),
}


def build(name: str, seed: int = 0, **overrides) -> nn.Module:
    """A randomly initialised model whose norm weights, routers and routing biases make every option matter."""
    import transformers

    cfg_name, model_name, extra, _ = MODELS[name]
    cfg = getattr(transformers, cfg_name)(**{**_COMMON, **extra, **overrides})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1:  # norm weights: away from their 1 (or Gemma's 0) init, so `1 + w` vs `w` shows
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
            elif pname.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5, generator=g)  # routers: well separated scores (no near-ties in the top-k)
        for mname, buf in model.named_buffers():
            if mname.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=g) * 0.5)  # changes which experts are chosen
    return model


def tokens(batch: int = 2, seq: int = 6, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def expected_swaps(name: str) -> dict[str, int]:
    return MODELS[name][3]


MOE_MODELS = [name for name, spec in MODELS.items() if any("-> moe:" in kind for kind in spec[3])]


def pytest_generate_tests(metafunc):
    # test modules cannot import this conftest (--import-mode=importlib): parametrize the model names from here
    if "model_name" in metafunc.fixturenames:
        metafunc.parametrize("model_name", list(MODELS))
    if "moe_model_name" in metafunc.fixturenames:
        metafunc.parametrize("moe_model_name", MOE_MODELS)


@pytest.fixture
def hf() -> SimpleNamespace:
    """``build(name)``, ``tokens()``, ``expected_swaps(name)``, ``names``, ``moe_names``, ``deepcopy``."""
    pytest.importorskip("transformers")
    return SimpleNamespace(
        build=build,
        tokens=tokens,
        expected_swaps=expected_swaps,
        names=list(MODELS),
        moe_names=MOE_MODELS,
        deepcopy=copy.deepcopy,
    )
