"""Optimizer state_dicts in the model's original parameter layout.

A swapped MoE block whose experts were per-expert ``nn.Linear`` lists holds them as two stacked parameters
(``ExpertList``): the model's state_dict still shows the original per-expert keys, but a ``torch.optim`` state_dict
lists parameters by position, so the stacked ones would not line up with a state_dict from the original model.

``to_original_layout`` rewrites the swapped model's optimizer state_dict as the original model's optimizer would have
written it (each stacked parameter replaced, in place, by its per-expert pieces in the original parameter order, and
its per-parameter state tensors sliced accordingly); ``from_original_layout`` is the inverse. Checkpoints then carry
the original layout whichever strategy wrote them, and load under either.

Supported: optimizers whose per-parameter state is tensors of the parameter's shape plus scalars (SGD, Adam(W),
Adagrad, RMSprop, ...), with each block's stacked parameters in one param group where the original model's
per-expert parameters sat together (groups built from ``model.parameters()`` or filtered from it in order). Anything
else (factored or flattened state such as Adafactor's or LBFGS's, a block split over groups, saved states whose shapes
or names do not match) is left in the layout it has, with a warning: loading then fails loudly, never silently.

A restacked block keeps one optimizer step count for all its experts; the original model counts per expert (experts
that got no token in a step had no gradient). Loading such a state takes the largest count and warns.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from torch import nn

from fly_lightning.modules.moe_layout import ExpertList

Piece = tuple[ExpertList, int, str]  # (module, expert, original Linear name)


class _Unsupported(Exception):
    pass


def _warn(why: str) -> None:
    warnings.warn(f"fly_lightning: optimizer state left in the layout it has: {why}", stacklevel=4)


def _stacked(model: nn.Module) -> dict[int, ExpertList]:
    out = {}
    for m in model.modules():
        if isinstance(m, ExpertList):
            out[id(m.gate_up_proj)] = out[id(m.down_proj)] = m
    return out


def _source(m: ExpertList, name: str) -> nn.Parameter:
    return m.down_proj if name == m.names[2] else m.gate_up_proj


def _piece_slice(m: ExpertList, i: int, name: str, t: torch.Tensor) -> torch.Tensor:
    """The part of a stacked-shaped tensor ``t`` for one piece: gate rows, up rows, or the down matrix of expert i."""
    gate, up, _ = m.names
    inter = m.gate_up_proj.shape[1] // 2
    return t[i, :inter] if name == gate else t[i, inter:] if name == up else t[i]


def _items(group: list[nn.Parameter], stacked: dict) -> list[nn.Parameter | Piece]:
    """A param group as the original model's optimizer listed it."""
    out: list[Any] = []
    done: set[int] = set()
    ids = {id(p) for p in group}
    for p in group:
        if id(p) not in stacked:
            out.append(p)
            continue
        m = stacked[id(p)]
        if id(m) in done:
            continue
        if id(m.gate_up_proj) not in ids or id(m.down_proj) not in ids:
            raise _Unsupported("a block's stacked expert parameters are in different param groups")
        done.add(id(m))
        out += [(m, i, n) for i in range(m.gate_up_proj.shape[0]) for n in m.stock_order]
    return out


def _plan(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[Any]] | None:
    stacked = _stacked(model)
    if not any(id(p) in stacked for g in optimizer.param_groups for p in g["params"]):
        return None
    return [_items(g["params"], stacked) for g in optimizer.param_groups]


def _shape(item: Any) -> torch.Size:
    if isinstance(item, tuple):
        m, i, n = item
        return _piece_slice(m, i, n, _source(m, n)).shape
    return item.shape


def _check_state(entry: dict, shape: torch.Size, what: str) -> None:
    """Per-parameter state: tensors of the parameter's shape, or scalars (e.g. ``step``)."""
    for key, v in entry.items():
        if torch.is_tensor(v) and v.dim() > 0 and v.shape != shape:
            raise _Unsupported(f"{what}: state {key!r} has shape {tuple(v.shape)}, the parameter {tuple(shape)}")


def _names(group: dict) -> dict[int, str] | None:
    return dict(zip(group["params"], group["param_names"], strict=True)) if "param_names" in group else None


def to_original_layout(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> dict:
    """``optimizer.state_dict()`` (``state``) of the swapped model, as the original model's optimizer writes it.

    The pieces' state tensors are views of the stacked ones (``torch.save`` writes each storage once)."""
    try:
        plan = _plan(model, optimizer)
        if plan is None:
            return state
        own = [p for g in optimizer.param_groups for p in g["params"]]
        for idx, entry in state["state"].items():
            _check_state(entry, own[idx].shape, "a parameter")
    except _Unsupported as exc:
        _warn(str(exc))
        return state
    own_index = {id(p): i for i, p in enumerate(own)}
    new_state, new_groups, k = {}, [], 0
    for items, group in zip(plan, state["param_groups"], strict=True):
        names = _names(group)
        out_names = []
        for item in items:
            if isinstance(item, tuple):
                m, i, n = item
                src_param = _source(m, n)
                src = state["state"].get(own_index[id(src_param)])
                if src is not None:
                    # per-parameter tensors: views; scalars copied (a shared ``step`` tensor would be stepped by
                    # every piece once loaded)
                    new_state[k] = {key: (_piece_slice(m, i, n, v) if torch.is_tensor(v) and v.dim() > 0
                                          else v.clone() if torch.is_tensor(v) else copy.copy(v))
                                    for key, v in src.items()}  # fmt: skip
                if names is not None:  # the piece's name next to the stacked parameter's own name in this group
                    stacked_name = names[own_index[id(m.gate_up_proj)]]
                    out_names.append(f"{stacked_name.removesuffix('gate_up_proj')}{i}.{n}.weight")
            else:
                if (src := state["state"].get(own_index[id(item)])) is not None:
                    new_state[k] = src
                if names is not None:
                    out_names.append(names[own_index[id(item)]])
            k += 1
        g = {key: v for key, v in group.items() if key not in ("params", "param_names")}
        g["params"] = list(range(k - len(items), k))
        if names is not None:
            g["param_names"] = out_names
        new_groups.append(g)
    return {"state": new_state, "param_groups": new_groups}


def from_original_layout(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> dict:
    """An optimizer state_dict in the original model's layout (e.g. from a stock checkpoint), as this swapped model's
    optimizer loads it. A state_dict already in the swapped layout is returned as is; one that matches neither is
    returned as is with a warning (``load_state_dict`` then reports the mismatch)."""
    try:
        plan = _plan(model, optimizer)
        if plan is None:
            return state
        lengths = [len(g["params"]) for g in state["param_groups"]]
        if lengths == [len(g["params"]) for g in optimizer.param_groups]:
            return state  # already the swapped layout
        if lengths != [len(items) for items in plan]:
            raise _Unsupported(f"param group sizes {lengths} match neither layout")
        return _assemble_all(plan, state, optimizer)
    except _Unsupported as exc:
        _warn(str(exc))
        return state


def _assemble_all(plan: list[list[Any]], state: dict, optimizer: torch.optim.Optimizer) -> dict:
    new_state, new_groups, k = {}, [], 0
    for items, group, own in zip(plan, state["param_groups"], optimizer.param_groups, strict=True):
        names = _names(group)
        saved: dict[Any, dict | None] = {}
        for item, idx in zip(items, group["params"], strict=True):
            entry = state["state"].get(idx)
            if entry is not None:
                _check_state(entry, _shape(item), f"saved parameter {idx}")
            if isinstance(item, tuple):
                m, i, n = item
                if names is not None and not names[idx].endswith(f"{i}.{n}.weight"):
                    raise _Unsupported(f"saved parameter {names[idx]!r} where expert {i}'s {n} was expected")
                saved[(id(m), i, n)] = entry
            else:
                saved[id(item)] = entry
        owner = {id(_source(it[0], it[2])): it[0] for it in items if isinstance(it, tuple)}
        for p in own["params"]:
            entry = saved[id(p)] if id(p) in saved else _assemble(p, owner[id(p)], saved)
            if entry is not None:
                new_state[k] = entry
            k += 1
        g = {key: v for key, v in group.items() if key not in ("params", "param_names")}
        g["params"] = list(range(k - len(own["params"]), k))
        if "param_names" in own:
            g["param_names"] = list(own["param_names"])
        new_groups.append(g)
    return {"state": new_state, "param_groups": new_groups}


def _assemble(p: nn.Parameter, m: ExpertList, saved: dict) -> dict | None:
    """A stacked parameter's state from its pieces'. Pieces without state (experts that never got a token) get zero
    moments; scalars that differ between pieces (per-expert step counts) take the largest. Both warn."""
    gate, up, down = m.names
    parts = [gate, up] if p is m.gate_up_proj else [down]
    rows = [[saved[(id(m), i, n)] for n in parts] for i in range(p.shape[0])]
    present = [s for row in rows for s in row if s is not None]
    if not present:
        return None
    keys = present[0].keys()
    if any(s.keys() != keys for s in present):
        raise _Unsupported("the experts' saved states have different entries")
    if len(present) < len(rows) * len(parts):
        warnings.warn("fly_lightning: some experts of a restacked block have no saved optimizer state (no token "
                      "yet): their moments start at zero", stacklevel=4)  # fmt: skip
    out = {}
    for key in keys:
        first = present[0][key]
        if torch.is_tensor(first) and first.dim() > 0:
            like = dict(dtype=first.dtype, device=first.device)
            out[key] = torch.stack([
                torch.cat([torch.zeros(_shape((m, i, n)), **like) if s is None else s[key]
                           for n, s in zip(parts, row, strict=True)])
                for i, row in enumerate(rows)
            ])  # fmt: skip
            continue
        values = [float(s[key]) if torch.is_tensor(s[key]) or isinstance(s[key], (int, float)) else s[key]
                  for s in present]  # fmt: skip
        out[key] = first
        if len({repr(v) for v in values}) > 1:
            if not all(isinstance(v, float) for v in values):
                raise _Unsupported(f"state {key!r} differs between the experts of a restacked block")
            out[key] = present[values.index(max(values))][key]
            warnings.warn(
                f"fly_lightning: optimizer state {key!r} differs between the experts of a restacked block "
                f"({min(values):g}..{max(values):g}: the original model skips experts without tokens); the stacked "
                "parameter takes the largest",
                stacklevel=4,
            )
    return out
