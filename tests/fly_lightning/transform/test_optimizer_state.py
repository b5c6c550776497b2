"""Optimizer state_dicts of models whose per-expert Linear lists were restacked: written and read in the original
model's layout, equal to what the original model's optimizer holds after the same steps."""

import copy

import pytest
import torch

import fly_lightning
from fly_lightning.transform.optimizer_state import from_original_layout, to_original_layout


def _steps(m, opt, n=3):
    torch.manual_seed(1)
    for _ in range(n):
        x = torch.randn(32, m[0].in_features)
        opt.zero_grad()
        m(x).square().mean().backward()
        opt.step()


def _assert_state_close(a, b):
    assert [{k: v for k, v in g.items() if k != "params"} for g in a["param_groups"]] == [
        {k: v for k, v in g.items() if k != "params"} for g in b["param_groups"]
    ]
    assert [g["params"] for g in a["param_groups"]] == [g["params"] for g in b["param_groups"]]
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        assert a["state"][i].keys() == b["state"][i].keys()
        for k in a["state"][i]:
            torch.testing.assert_close(a["state"][i][k], b["state"][i][k], rtol=1e-4, atol=1e-6, msg=f"{i} {k}")


@pytest.mark.parametrize("grouped", [False, True], ids=["one_group", "by_name"])
def test_state_in_the_original_layout_both_ways(grouped, list_moe_model):
    stock = list_moe_model()
    ours = copy.deepcopy(stock)
    assert [m for _, _, m in fly_lightning.transform(ours).swapped] == ["moe:expert_list"]

    def make(m):
        if not grouped:
            return torch.optim.AdamW(m.parameters(), lr=1e-2)
        decay = [p for n, p in m.named_parameters() if "experts" in n or n.startswith("0.")]
        rest = [p for n, p in m.named_parameters() if not ("experts" in n or n.startswith("0."))]
        return torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)

    opt_stock, opt_ours = make(stock), make(ours)
    n_params = lambda o: len(o.state_dict()["param_groups"][0]["params"])  # noqa: E731
    assert n_params(opt_ours) < n_params(opt_stock)
    _steps(stock, opt_stock)
    _steps(ours, opt_ours)
    ours_sd = opt_ours.state_dict()
    as_stock = to_original_layout(ours, opt_ours, ours_sd)
    _assert_state_close(as_stock, opt_stock.state_dict())  # what the original model's optimizer holds
    # the stock state loads into a fresh optimizer of the swapped model, and both continue alike
    fresh = make(ours)
    fresh.load_state_dict(from_original_layout(ours, fresh, opt_stock.state_dict()))
    _assert_state_close(fresh.state_dict(), ours_sd)
    # round trip is exact; a state already in the swapped layout passes through
    back = from_original_layout(ours, opt_ours, as_stock)
    for i, st in ours_sd["state"].items():
        assert all(torch.equal(st[k], back["state"][i][k]) for k in st)
    assert from_original_layout(ours, opt_ours, ours_sd) is ours_sd


def test_named_parameters_keep_their_names(list_moe_model):
    stock, ours = list_moe_model(), list_moe_model()
    fly_lightning.transform(ours)
    opt_stock = torch.optim.AdamW(stock.named_parameters(), lr=1e-2)  # state_dict groups carry param_names
    opt_ours = torch.optim.AdamW(ours.named_parameters(), lr=1e-2)
    _steps(stock, opt_stock)
    _steps(ours, opt_ours)
    # the names are the optimizer's (relative to what it was given), not the FQNs in the module handed in
    as_stock = to_original_layout(torch.nn.ModuleDict({"net": ours}), opt_ours, opt_ours.state_dict())
    assert as_stock["param_groups"][0]["param_names"] == opt_stock.state_dict()["param_groups"][0]["param_names"]
    fresh = torch.optim.AdamW(ours.named_parameters(), lr=1e-2)
    fresh.load_state_dict(from_original_layout(ours, fresh, opt_stock.state_dict()))
    _assert_state_close(fresh.state_dict(), opt_ours.state_dict())


def test_stock_state_of_experts_that_missed_tokens_loads_with_warnings(list_moe_model):
    # the original model skips experts without tokens: their state is missing or their step count lags
    stock, ours = list_moe_model(), list_moe_model()
    fly_lightning.transform(ours)
    opt_stock = torch.optim.AdamW(stock.parameters(), lr=1e-2)
    torch.manual_seed(14)
    for _ in range(4):  # one token per step, two experts per step: w2 steps [none, 4, 1, 3]
        opt_stock.zero_grad()
        stock(torch.randn(1, stock[0].in_features)).square().sum().backward()
        opt_stock.step()
    sd = opt_stock.state_dict()
    fresh = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    with pytest.warns(UserWarning) as record:
        fresh.load_state_dict(from_original_layout(ours, fresh, sd))
    messages = " ".join(str(w.message) for w in record)
    assert "takes the largest" in messages and "no saved optimizer state" in messages
    experts = ours[1].experts
    st = fresh.state[experts.down_proj]
    w2 = [p for n, p in stock.named_parameters() if n.endswith(".w2.weight")]
    for i, p in enumerate(w2):  # each expert's moments where it had any, zeros where it had none
        expected = opt_stock.state[p]["exp_avg"] if p in opt_stock.state else torch.zeros_like(p)
        torch.testing.assert_close(st["exp_avg"][i], expected)
    assert float(st["step"]) == 4 == max(float(opt_stock.state[p]["step"]) for p in w2 if p in opt_stock.state)


def _assert_left_with_a_warning(model, opt):
    sd = opt.state_dict()
    with pytest.warns(UserWarning, match="has shape"):
        assert to_original_layout(model, opt, sd) is sd


def test_factored_state_is_left_with_a_warning(list_moe_model):
    ours = list_moe_model()
    fly_lightning.transform(ours)
    opt = torch.optim.Adafactor(ours.parameters(), lr=1e-2)  # row/column factors: not sliceable per expert
    _steps(ours, opt, n=1)
    _assert_left_with_a_warning(ours, opt)


def test_flattened_state_is_left_with_a_warning(list_moe_model):
    ours = list_moe_model()
    fly_lightning.transform(ours)
    opt = torch.optim.LBFGS(ours.parameters(), max_iter=2)  # one search direction over all parameters, flattened
    x = torch.randn(8, ours[0].in_features)

    def closure():
        opt.zero_grad()
        loss = ours(x).square().mean()
        loss.backward()
        return loss

    opt.step(closure)
    _assert_left_with_a_warning(ours, opt)


def test_state_before_any_step_and_split_groups(list_moe_model):
    ours = list_moe_model()
    fly_lightning.transform(ours)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    sd = to_original_layout(ours, opt, opt.state_dict())
    n_expected = 2 + 1 + 3 * list_moe_model.E + 2  # first Linear, router, per-expert pieces, last Linear
    assert sd["state"] == {} and len(sd["param_groups"][0]["params"]) == n_expected
    experts = ours[1].experts
    split = torch.optim.SGD([{"params": [experts.gate_up_proj]}, {"params": [experts.down_proj]}], lr=0.1)
    with pytest.warns(UserWarning, match="different param groups"):
        same = to_original_layout(ours, split, split.state_dict())
    assert [len(g["params"]) for g in same["param_groups"]] == [1, 1]
