"""FlyExperts: routed experts for given routing (the module transformers' experts containers are swapped for)."""

import torch

from fly_lightning.modules import FlyExperts

E, H, INTER = 4, 16, 24


def _experts() -> FlyExperts:
    g = torch.Generator().manual_seed(0)
    gate_up = torch.nn.Parameter(torch.randn(E, 2 * INTER, H, generator=g) * 0.1)
    down = torch.nn.Parameter(torch.randn(E, H, INTER, generator=g) * 0.1)
    return FlyExperts(gate_up, down)


def test_no_tokens_give_an_empty_result():
    # transformers' experts return [0, H] for an empty batch (a micro-batch or a rank with no tokens)
    out = _experts()(torch.randn(0, H), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    assert out.shape == (0, H)


def test_compiles_with_dynamic_shapes():
    # k = top_k_index.shape[1] is a SymInt there: the ops' checks take it
    experts = _experts()
    x, ids, w = torch.randn(5, H), torch.randint(0, E, (5, 2)), torch.rand(5, 2)
    compiled = torch.compile(experts, backend="aot_eager", dynamic=True)
    torch.testing.assert_close(compiled(x, ids, w), experts(x, ids, w))
