"""What a replacement module takes over from the module it replaces, beyond its parameters."""

from __future__ import annotations

from torch import nn


def carry_module_state(new: nn.Module, old: nn.Module) -> nn.Module:
    """``new`` (in ``old``'s place) takes ``old``'s train/eval flag and its forward and backward hooks: the hook dicts
    themselves where ``new`` has none of its own (so that handles still remove them), else merged into ``new``'s.
    State-dict hooks stay behind: they belong to how each module stores its parameters."""
    new.training = old.training
    for name, value in vars(old).items():
        if not name.startswith(("_forward_", "_backward_")) or not isinstance(value, dict) or not value:
            continue
        mine = getattr(new, name, None)
        if mine:
            mine.update(value)
        else:
            setattr(new, name, value)
    if getattr(new, "_is_full_backward_hook", None) is None:
        new._is_full_backward_hook = getattr(old, "_is_full_backward_hook", None)
    return new
