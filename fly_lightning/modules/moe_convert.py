"""``FlyMoE.from_module``: recognise an existing MoE block and wrap its weights in the same layout.

Recognised blocks:
- transformers v5 sparse MoE blocks (``gate`` top-k router with ``weight`` [E, H]; ``experts`` with
  ``gate_up_proj``/``down_proj`` and a SiLU ``act_fn``): Mixtral, Qwen2/3-MoE without shared expert, OLMoE, ...;
- per-expert ``nn.ModuleList`` blocks (transformers 4 style): ``gate`` ``nn.Linear(H, E)``, experts with
  ``w1``/``w3``/``w2`` or ``gate_proj``/``up_proj``/``down_proj`` Linear layers;
- torchtitan ``MoE`` (``router.gate``, ``experts.w1/w2/w3``, optional ``shared_experts`` and ``expert_bias``).

DeepSeek-V3-style routers (sigmoid scores, correction bias, node-limited groups) map to ``FlyMoE``'s options.
Anything else (biases, non-SiLU activations, router state it does not model, router jitter) raises ``ValueError``
naming what is not supported. transformers v5 blocks keep their router module (``gate``), so hooks on it still fire.
"""

from __future__ import annotations

import copy
from typing import Any, TypeVar

import torch
from torch import nn

from fly_lightning.modules.moe_layout import ExpertList

# the FlyMoE class, passed in by ``FlyMoE.from_module`` (which imports this module: no import back)
FlyMoEType = TypeVar("FlyMoEType", bound=nn.Module)


def _is_silu(act: Any) -> bool:
    return (
        act is None
        or isinstance(act, nn.SiLU)
        or type(act).__name__ in ("SiLUActivation", "SiLU")
        or act in (torch.nn.functional.silu,)
    )


def _reject(module: nn.Module, why: str) -> None:
    raise ValueError(f"FlyMoE.from_module: {type(module).__name__}: {why}")


def _check_block(module: nn.Module) -> None:
    if (getattr(module, "shared_expert", None) is None) != (getattr(module, "shared_expert_gate", None) is None):
        _reject(module, "has a shared expert without its gate (or a gate without the expert)")
    if getattr(module, "jitter_noise", 0) or getattr(module, "router_jitter_noise", 0):
        _reject(module, "router jitter noise is not supported")


def _check_router(module: nn.Module, router: nn.Module) -> None:
    """Plain top-k routers only; DeepSeek-V3-style routers go through ``_hf_router_options``."""
    for name in ("e_score_correction_bias", "n_group", "topk_group"):
        if getattr(router, name, None) is not None:
            _reject(module, f"router has {name} (group-limited or corrected routing); not supported")
    if getattr(router, "bias", None) is not None:
        _reject(module, "router has a bias")


def _new(
    cls: type[FlyMoEType], weight: torch.Tensor, h: int, i: int, e: int, k: int, materialize: bool, **kw: Any
) -> FlyMoEType:
    """A FlyMoE built on the meta device; ``materialize`` allocates (uninitialised) storage on ``weight``'s device.

    Without it every parameter and buffer must be replaced by the caller (shared with the wrapped block).
    """
    with torch.device("meta"):
        moe = cls(h, i, e, k, dtype=weight.dtype, **kw)
    if materialize:
        moe.to_empty(device=weight.device)
    return moe


def _hf_v5(cls: type[FlyMoEType], module: nn.Module, options: dict) -> FlyMoEType:
    experts, router = module.experts, module.gate
    _check_block(module)
    if getattr(experts, "has_bias", False) or getattr(experts, "gate_up_proj_bias", None) is not None:
        _reject(module, "experts have biases")
    if getattr(experts, "is_transposed", False) or not getattr(experts, "has_gate", True):
        _reject(module, "transposed or gate-less expert weights are not supported")
    if not _is_silu(getattr(experts, "act_fn", None)):
        _reject(module, f"expert activation {type(experts.act_fn).__name__} is not SiLU")
    e, two_i, h = experts.gate_up_proj.shape
    k = int(getattr(router, "top_k", getattr(module, "top_k", 0)))
    norm = bool(getattr(router, "norm_topk_prob", getattr(module, "norm_topk_prob", True)))  # Mixtral: always
    _check_router_state(module, router)
    kw = dict(layout="hf", norm_topk_prob=norm, router_fp32=_router_computes_fp32(router))
    kw = kw | _deepseek_router_options(module, router) | options
    moe = _new(cls, router.weight, h, two_i // 2, e, k, False, **kw)
    # the router module itself (its weight, any correction bias: same keys): transformers records router logits with
    # hooks on its router class, which FlyMoE then runs (see FlyMoE.router_logits)
    moe.gate = router
    moe.experts.gate_up_proj, moe.experts.down_proj = experts.gate_up_proj, experts.down_proj
    _attach_shared(moe, module)
    return moe


_ROUTER_STATE = {"weight", "e_score_correction_bias"}


def _check_router_state(module: nn.Module, router: nn.Module) -> None:
    """Routers whose state we do not model (e.g. Ernie 4.5's ``moe_statics`` correction bias) are left: their state
    would drop out of the state_dict and out of the routing."""
    extra = {n for n, _ in router.named_parameters()} | {n for n, _ in router.named_buffers()}
    extra -= _ROUTER_STATE
    if extra or next(router.children(), None) is not None:
        names = sorted(extra) or [n for n, _ in router.named_children()]
        _reject(module, f"router has state this block does not model: {', '.join(names)}")


def _router_computes_fp32(router: nn.Module) -> bool:
    """Whether the router makes fp32 logits from 16-bit weights and inputs (transformers' DeepSeek-style routers):
    run on a meta copy in bf16, so neither the weights' current dtype nor their device matters."""
    try:
        with torch.device("meta"):
            clone = copy.copy(router)  # its own parameter and buffer dicts below; the original is untouched
            clone._parameters = {n: torch.empty_like(p, device="meta", dtype=torch.bfloat16)
                                 for n, p in router._parameters.items() if p is not None}  # fmt: skip
            clone._buffers = {n: torch.empty_like(b, device="meta", dtype=torch.bfloat16)
                              for n, b in router._buffers.items() if b is not None}  # fmt: skip
            x = torch.empty(1, router.weight.shape[1], dtype=torch.bfloat16)
            with torch.no_grad(), torch.autocast("cpu", enabled=False):
                out = clone(x)
    except Exception:  # noqa: BLE001 - a router that cannot run on meta: keep the weight's dtype
        return False
    out = out[0] if isinstance(out, tuple) else out
    return isinstance(out, torch.Tensor) and out.dtype == torch.float32


def _deepseek_router_options(module: nn.Module, router: nn.Module) -> dict:
    """DeepSeek-V3-style routers (transformers ``*TopkRouter`` with ``e_score_correction_bias``): sigmoid scores,
    selection-only bias, node-limited groups, routed scaling factor. Empty for plain top-k routers."""
    if getattr(router, "e_score_correction_bias", None) is None:
        _check_router(module, router)
        return {}
    if not all(hasattr(router, a) for a in ("num_group", "topk_group", "routed_scaling_factor")):
        _reject(module, "router has a score-correction bias but not DeepSeek-V3's group fields")
    if getattr(router, "bias", None) is not None:
        _reject(module, "router has a bias")
    n_group, topk_group = router.num_group, router.topk_group
    if n_group is None and topk_group is None:  # DeepSeek-V3's router with groups off (AXK2's light checkpoints)
        return dict(score_func="sigmoid", route_scale=float(router.routed_scaling_factor))
    if n_group is None or topk_group is None:
        _reject(module, "router sets only one of num_group / topk_group")
    n_group, topk_group = int(n_group), int(topk_group)
    e, k = router.weight.shape[0], int(getattr(router, "top_k", getattr(module, "top_k", 0)))
    grouped = n_group > 1
    if grouped and (e % n_group or e // n_group < 2 or not 1 <= topk_group <= n_group):
        _reject(module, f"router groups do not fit: {e} experts, n_group={n_group}, topk_group={topk_group}")
    if grouped and k > topk_group * (e // n_group):
        if k != e:
            # transformers masks the other groups' experts with -inf and still takes the top k: the extra slots go
            # to masked experts in torch.topk's unspecified tie order, weighted by their (unmasked) scores
            reachable = topk_group * (e // n_group)
            why = f"top_k={k} exceeds the {reachable} experts of topk_group={topk_group} of n_group={n_group} groups"
            _reject(module, f"{why}: the extra experts are picked by tie order, not by score")
        grouped = False  # top_k == num_experts: every expert is chosen whatever the groups (transformers' test config)
    return dict(
        score_func="sigmoid",
        route_scale=float(router.routed_scaling_factor),
        n_groups=n_group if grouped else None,
        topk_groups=topk_group if grouped else None,
    )


def _attach_shared(moe: FlyMoEType, module: nn.Module) -> None:
    """Shared experts keep their modules and names: ungated (``shared_experts``, DeepSeek-V3) or gated by
    ``sigmoid(shared_expert_gate(x))`` (``shared_expert``, Qwen2-MoE)."""
    if getattr(module, "shared_experts", None) is not None:
        moe.shared_experts = module.shared_experts
    if getattr(module, "shared_expert", None) is not None:
        moe.shared_expert, moe.shared_expert_gate = module.shared_expert, module.shared_expert_gate


_LIST_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen": ("gate_proj", "up_proj", "down_proj")}


def _expert_list(cls: type[FlyMoEType], module: nn.Module, options: dict) -> FlyMoEType:
    experts, router = module.experts, module.gate
    _check_block(module)
    _check_router(module, router)
    first = experts[0]
    layout = next((name for name, attrs in _LIST_NAMES.items() if all(hasattr(first, a) for a in attrs)), None)
    if layout is None:
        _reject(module, "experts have neither w1/w3/w2 nor gate_proj/up_proj/down_proj")
    gate_n, up_n, down_n = _LIST_NAMES[layout]
    for ex in experts:
        if any(getattr(ex, n).bias is not None for n in (gate_n, up_n, down_n)):
            _reject(module, "expert Linear layers have biases")
        act = getattr(ex, "act_fn", getattr(ex, "act", None))
        if not _is_silu(act):
            _reject(module, f"expert activation {type(act).__name__} is not SiLU")
    i, h = getattr(first, gate_n).weight.shape
    k = int(getattr(module, "top_k", getattr(router, "top_k", 0)))
    norm = bool(getattr(module, "norm_topk_prob", True))
    kw = dict(layout=layout, norm_topk_prob=norm) | options
    moe = _new(cls, getattr(first, gate_n).weight, h, i, len(experts), k, True, **kw)
    moe.gate.weight = router.weight
    assert isinstance(moe.experts, ExpertList)
    moe.experts.stock_order = tuple(n for n, _ in first.named_children() if n in (gate_n, up_n, down_n))
    with torch.no_grad():
        for j, ex in enumerate(experts):
            moe.experts.gate_up_proj[j, :i].copy_(getattr(ex, gate_n).weight)
            moe.experts.gate_up_proj[j, i:].copy_(getattr(ex, up_n).weight)
            moe.experts.down_proj[j].copy_(getattr(ex, down_n).weight)
    # the stacked Parameters keep the experts' requires_grad (frozen experts stay frozen); one flag per stack
    for stacked, names in ((moe.experts.gate_up_proj, (gate_n, up_n)), (moe.experts.down_proj, (down_n,))):
        flags = {getattr(ex, n).weight.requires_grad for ex in experts for n in names}
        if len(flags) > 1:
            _reject(module, f"experts mix frozen and trainable {'/'.join(names)} weights (one stacked tensor each)")
        stacked.requires_grad_(flags.pop())
    _attach_shared(moe, module)
    return moe


def _torchtitan(cls: type[FlyMoEType], module: nn.Module, options: dict) -> FlyMoEType:
    router, experts = module.router, module.experts
    gate = router.gate
    if getattr(router, "_debug_force_load_balance", False):
        _reject(module, "debug forced load balance is not supported")
    _check_router(module, gate)
    e, h = gate.weight.shape
    w1 = experts.w1
    # [E, H, I] (older torchtitan) vs [E, I, H]; with H == I the shapes cannot tell: taken as the current layout
    # (convert an older one with FlyMoE.from_module(block, layout="torchtitan_legacy"))
    legacy = w1.shape[1] == h and w1.shape[2] != h
    i = w1.shape[2] if legacy else w1.shape[1]
    bias = getattr(module, "expert_bias", None)
    # node-limited routing: groups scored by their top-2 (biased) scores, as this op's n_groups / topk_groups
    n_groups, topk_groups = getattr(router, "num_expert_groups", None), getattr(router, "num_limited_groups", None)
    if (n_groups is None) != (topk_groups is None):
        _reject(module, "router sets only one of num_expert_groups / num_limited_groups")
    kw = (
        dict(
            layout="torchtitan_legacy" if legacy else "torchtitan",
            n_groups=None if n_groups is None else int(n_groups),
            topk_groups=None if topk_groups is None else int(topk_groups),
            score_func=router.score_func,
            norm_topk_prob=bool(router.route_norm),
            route_scale=float(router.route_scale),
            score_before_experts=bool(getattr(module, "score_before_experts", False)),
            load_balance_bias=bias is not None,
        )
        | options
    )
    moe = _new(cls, gate.weight, h, i, e, int(router.top_k), False, **kw)
    moe.router.gate.weight = gate.weight
    moe.experts.w1, moe.experts.w2, moe.experts.w3 = experts.w1, experts.w2, experts.w3
    if bias is not None:
        moe.expert_bias = bias
        moe.tokens_per_expert = module.tokens_per_expert
    moe.shared_experts = getattr(module, "shared_experts", None)
    return moe


def _keep_child_order(moe: FlyMoEType, module: nn.Module) -> FlyMoEType:
    """Children in the wrapped block's order (e.g. ``experts`` before ``gate``), so the state_dict key order and the
    parameter order (by which an optimizer's state_dict refers to parameters) are the original model's."""
    rank = {name: i for i, name in enumerate(module._modules)}
    children = sorted(moe._modules.items(), key=lambda item: rank.get(item[0], len(rank)))
    moe._modules.clear()
    moe._modules.update(children)
    return moe


def from_module(cls: type[FlyMoEType], module: nn.Module, **options: Any) -> FlyMoEType:
    experts = getattr(module, "experts", None)
    if experts is None:
        _reject(module, "no `experts` attribute")
    if hasattr(module, "router") and hasattr(module.router, "gate") and hasattr(experts, "w1"):
        return _keep_child_order(_torchtitan(cls, module, options), module)
    if not hasattr(module, "gate"):
        _reject(module, "no `gate` router")
    if isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor):
        return _keep_child_order(_hf_v5(cls, module, options), module)
    if isinstance(experts, nn.ModuleList) and len(experts) > 0:
        return _keep_child_order(_expert_list(cls, module, options), module)
    _reject(module, f"unrecognised experts container {type(experts).__name__}")
    raise AssertionError  # unreachable
