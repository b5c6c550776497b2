"""FlyRMSNorm: drop-in for nn.RMSNorm (state_dict keys, numerics, gradients)."""

import torch
from torch import nn

from fly_lightning import DISPATCH_LOG, FlyRMSNorm


def test_state_dict_keys_and_shapes_match_nn_rmsnorm():
    ref = nn.RMSNorm(48, eps=1e-6)
    fly = FlyRMSNorm(48, eps=1e-6)
    assert {k: v.shape for k, v in fly.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}
    ref.weight.data.normal_()
    fly.load_state_dict(ref.state_dict())
    x = torch.randn(2, 5, 48)
    torch.testing.assert_close(fly(x), ref(x), rtol=1e-5, atol=1e-5)
    assert DISPATCH_LOG.records("rms_norm")[-1]["backend"] == "triton"


def test_no_affine_and_default_eps():
    ref, fly = nn.RMSNorm(16, elementwise_affine=False), FlyRMSNorm(16, elementwise_affine=False)
    assert list(fly.state_dict()) == list(ref.state_dict()) == []
    x = torch.randn(3, 16)
    torch.testing.assert_close(fly(x), ref(x), rtol=1e-5, atol=1e-5)


def test_from_module_shares_the_parameter():
    ref = nn.RMSNorm(32, eps=1e-5)
    fly = FlyRMSNorm.from_module(ref)
    assert fly.weight is ref.weight and fly.eps == 1e-5
    x = torch.randn(4, 32, requires_grad=True)
    fly(x).sum().backward()
    assert ref.weight.grad is not None


def test_gemma_offset_initialises_weight_to_zero():
    fly = FlyRMSNorm(8, offset=1.0)
    assert torch.equal(fly.weight, torch.zeros(8))
    x = torch.randn(2, 8)
    torch.testing.assert_close(fly(x), nn.RMSNorm(8)(x), rtol=1e-5, atol=1e-5)


def test_from_module_reads_transformers_variance_epsilon_and_refuses_several_dims():
    import pytest
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    stock = LlamaRMSNorm(64, eps=1e-6)
    assert FlyRMSNorm.from_module(stock, cast_before_scale=True).eps == 1e-6  # not torch's finfo(dtype).eps
    with pytest.raises(ValueError, match="last dimension only"):
        FlyRMSNorm.from_module(nn.RMSNorm((8, 8), elementwise_affine=False))
