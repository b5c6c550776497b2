"""A transformers-4 style MoE block (Linear router, per-expert Linear MLPs), shared by the transform, optimizer-state
and strategy tests: the layout ``FlyMoE`` restacks."""

import pytest
import torch
from torch import nn

H, INTER, E = 12, 8, 4


class Expert(nn.Module):  # transformers 4's Mixtral expert: w1, w2, w3 in that order
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(H, INTER, bias=False)
        self.w2 = nn.Linear(INTER, H, bias=False)
        self.w3 = nn.Linear(H, INTER, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.w2(self.act_fn(self.w1(x)) * self.w3(x))


class ListMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.top_k, self.gate = 2, nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(E))

    def forward(self, x):
        w, ids = torch.topk(torch.softmax(self.gate(x).float(), -1), self.top_k, -1)
        w = w / w.sum(-1, keepdim=True)
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(ids == e)
            if tok.numel() == 0:  # as transformers 4 does: an expert without tokens gets no gradient
                continue
            y = y.index_add(0, tok, expert(x[tok]) * w[tok, slot, None])
        return y


@pytest.fixture
def list_moe_model():
    """``list_moe_model()``: ``Linear -> ListMoE -> Linear(H, 1)`` on seeded weights; ``.H`` is the width."""

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(H, H), ListMoE(), nn.Linear(H, 1))

    make.H, make.E = H, E
    return make
