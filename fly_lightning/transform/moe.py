"""MoE block matchers: transformers v5 fused experts, per-expert Linear lists, torchtitan ``MoE``.

Recognition is structural (an ``experts`` container plus a ``gate`` or ``router.gate``); ``FlyMoE.from_module``
decides whether it computes the same function and says why not (DeepSeek-V3's group-limited router, non-SiLU experts,
biases, router jitter).
"""

from __future__ import annotations

import torch
from torch import nn

from fly_lightning.modules.moe import FlyMoE
from fly_lightning.transform.core import Matcher, Unsupported, register_matcher


def _match(module: nn.Module) -> str | None:
    if isinstance(module, FlyMoE):
        return None
    experts = getattr(module, "experts", None)
    if experts is None:
        return None
    router = getattr(module, "router", None)
    if router is not None and hasattr(router, "gate") and hasattr(experts, "w1"):
        return "torchtitan"
    if not hasattr(module, "gate"):
        return None
    if isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor):
        return "hf_v5"
    if isinstance(experts, nn.ModuleList) and len(experts) > 0:
        return "expert_list"
    return None


def _records_router_logits(root: nn.Module) -> bool:
    """Whether a model config under ``root`` asks for router logits: ``root`` may hold the Hugging Face model as an
    attribute (a LightningModule's ``self.model``), so every submodule's ``config`` counts, not only the root's."""
    return any(getattr(getattr(m, "config", None), "output_router_logits", False) for m in root.modules())


def _build(module: nn.Module, variant: str, root: nn.Module) -> nn.Module:
    if variant != "hf_v5":  # only transformers v5 blocks keep their router module, so only their router's hooks fire
        router = module.router.gate if variant == "torchtitan" else module.gate
        if router._forward_hooks or router._forward_pre_hooks:
            raise Unsupported("router has forward hooks, which the swapped block (router not kept) would not fire")
        if _records_router_logits(root):
            raise Unsupported("model records router logits (output_router_logits=True); this router is not kept")
    try:
        new = FlyMoE.from_module(module)
    except ValueError as exc:
        raise Unsupported(str(exc).removeprefix("FlyMoE.from_module: ")) from None
    new.train(module.training)
    return new


register_matcher(Matcher("moe", "moe", _match, _build))
