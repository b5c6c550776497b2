"""Optimizer state_dicts in the model's original parameter layout.

A swapped MoE block whose experts were per-expert ``nn.Linear`` lists holds them as two stacked parameters
(``ExpertList``): the model's state_dict still shows the original per-expert keys, but a ``torch.optim`` state_dict
lists parameters by position, so the stacked ones would not line up with a state_dict from the original model.

``to_original_layout`` rewrites the swapped model's optimizer state_dict as the original model's optimizer would have
written it (each stacked parameter replaced, in place, by its per-expert pieces in the original parameter order, and
its per-parameter state tensors sliced accordingly); ``from_original_layout`` is the inverse. Checkpoints then carry
the original layout whichever strategy wrote them, and load under either.

Assumption (true for optimizers built from ``model.parameters()`` or name-filtered groups of it): each block's stacked
parameters sit in one param group, where the original model's per-expert parameters sat together.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from torch import nn

from fly_lightning.modules.moe_layout import ExpertList

Piece = tuple[ExpertList, str, int, str]  # (module, its FQN prefix, expert, original Linear name)


def _stacked(model: nn.Module) -> dict[int, tuple[ExpertList, str]]:
    """id(stacked parameter) -> (its ExpertList, the module's FQN prefix)."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, ExpertList):
            prefix = f"{name}." if name else ""
            out[id(m.gate_up_proj)] = out[id(m.down_proj)] = (m, prefix)
    return out


def _pieces(m: ExpertList, prefix: str) -> list[Piece]:
    return [(m, prefix, i, n) for i in range(m.gate_up_proj.shape[0]) for n in m.stock_order]


def _piece_slice(m: ExpertList, i: int, name: str, t: torch.Tensor) -> torch.Tensor:
    """The part of a stacked-shaped tensor ``t`` (``gate_up_proj``'s or ``down_proj``'s shape) for one piece."""
    gate, up, _ = m.names
    inter = m.gate_up_proj.shape[1] // 2
    if name == gate:
        return t[i, :inter]
    if name == up:
        return t[i, inter:]
    return t[i]


def _expanded(group: list[nn.Parameter], stacked: dict) -> list[nn.Parameter | Piece] | None:
    """A param group as the original model's optimizer saw it; None when a block's stacked pair is split."""
    out: list[Any] = []
    done: set[int] = set()
    ids = {id(p) for p in group}
    for p in group:
        if id(p) not in stacked:
            out.append(p)
            continue
        m, prefix = stacked[id(p)]
        if id(m) in done:
            continue
        if id(m.gate_up_proj) not in ids or id(m.down_proj) not in ids:
            return None
        done.add(id(m))
        out += _pieces(m, prefix)
    return out


def _plan(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[Any]] | None:
    stacked = _stacked(model)
    if not stacked or not any(id(p) in stacked for g in optimizer.param_groups for p in g["params"]):
        return None
    groups = [_expanded(g["params"], stacked) for g in optimizer.param_groups]
    if any(g is None for g in groups):
        warnings.warn(
            "fly_lightning: a swapped MoE block's stacked expert parameters are in different param groups; its "
            "optimizer state stays in the stacked layout",
            stacklevel=3,
        )
        return None
    return groups


def _is_piece(item: Any) -> bool:
    return isinstance(item, tuple)


def to_original_layout(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> dict:
    """``optimizer.state_dict()`` (``state``) of the swapped model, as the original model's optimizer writes it."""
    plan = _plan(model, optimizer)
    if plan is None:
        return state
    own_index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    new_state, new_groups, k = {}, [], 0
    for items, group in zip(plan, state["param_groups"], strict=True):
        indices = []
        for item in items:
            if _is_piece(item):
                m, _, i, n = item
                src = state["state"].get(own_index[id(m.gate_up_proj if n != m.names[2] else m.down_proj)])
                if src is not None:
                    stacked_shape = (m.gate_up_proj if n != m.names[2] else m.down_proj).shape
                    new_state[k] = {
                        key: (_piece_slice(m, i, n, v).clone() if torch.is_tensor(v) and v.shape == stacked_shape
                              else copy.deepcopy(v))
                        for key, v in src.items()
                    }  # fmt: skip
            elif (src := state["state"].get(own_index[id(item)])) is not None:
                new_state[k] = src
            indices.append(k)
            k += 1
        g = {key: v for key, v in group.items() if key not in ("params", "param_names")}
        g["params"] = indices
        if "param_names" in group:
            names = dict(zip(group["params"], group["param_names"], strict=True))
            own = iter(names[own_index[id(it)]] for it in items if not _is_piece(it))
            g["param_names"] = [f"{it[1]}{it[2]}.{it[3]}.weight" if _is_piece(it) else next(own) for it in items]
        new_groups.append(g)
    return {"state": new_state, "param_groups": new_groups}


def from_original_layout(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> dict:
    """An optimizer state_dict in the original model's layout (e.g. from a stock checkpoint), as this swapped model's
    optimizer loads it. A state_dict already in the swapped layout (or one that matches neither) is returned as is."""
    plan = _plan(model, optimizer)
    if plan is None or [len(g["params"]) for g in state["param_groups"]] != [len(items) for items in plan]:
        return state
    new_state, new_groups, k = {}, [], 0
    for items, group, own in zip(plan, state["param_groups"], optimizer.param_groups, strict=True):
        saved = dict(zip(map(id, items), group["params"], strict=True))
        by_piece = {(id(it[0]), it[2], it[3]): idx for it, idx in zip(items, group["params"], strict=True)
                    if _is_piece(it)}  # fmt: skip
        indices = []
        for p in own["params"]:
            if id(p) in saved:  # a parameter the original model had as is
                if (src := state["state"].get(saved[id(p)])) is not None:
                    new_state[k] = src
            else:
                new_state_k = _assemble(model, p, by_piece, state["state"])
                if new_state_k is not None:
                    new_state[k] = new_state_k
            indices.append(k)
            k += 1
        g = {key: v for key, v in group.items() if key not in ("params", "param_names")}
        g["params"] = indices
        if "param_names" in own:
            g["param_names"] = list(own["param_names"])
        new_groups.append(g)
    return {"state": new_state, "param_groups": new_groups}


def _assemble(model: nn.Module, p: nn.Parameter, by_piece: dict, saved_state: dict) -> dict | None:
    """A stacked parameter's state from its pieces' states: per-parameter tensors (the pieces' shape) concatenated
    and stacked back; anything else (e.g. Adam's ``step``) taken from the first piece."""
    m, _ = _stacked(model)[id(p)]
    gate, up, down = m.names
    names = [gate, up] if p is m.gate_up_proj else [down]
    rows = [[saved_state.get(by_piece[(id(m), i, n)]) for n in names] for i in range(p.shape[0])]
    flat = [s for row in rows for s in row]
    if all(s is None for s in flat):
        return None
    if any(s is None for s in flat):
        raise ValueError(f"optimizer state: some of {names} have state and others do not")
    piece_shape = _piece_slice(m, 0, names[0], p).shape
    out = {}
    for key, v in flat[0].items():
        if torch.is_tensor(v) and v.shape == piece_shape:
            out[key] = torch.stack([torch.cat([s[key] for s in row]) for row in rows])
        else:
            out[key] = v
    return out
