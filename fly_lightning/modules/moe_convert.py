"""``FlyMoE.from_module``: recognise an existing MoE block and wrap its weights in the same layout.

Recognised blocks:
- transformers v5 sparse MoE blocks (``gate`` top-k router with ``weight`` [E, H]; ``experts`` with
  ``gate_up_proj``/``down_proj`` and a SiLU or GELU ``act_fn``: SwiGLU or GeGLU): Mixtral, Qwen2/3-MoE without
  shared expert, OLMoE, ...;
- per-expert ``nn.ModuleList`` blocks (transformers 4 style): ``gate`` ``nn.Linear(H, E)``, experts with
  ``w1``/``w3``/``w2`` or ``gate_proj``/``up_proj``/``down_proj`` Linear layers;
- torchtitan ``MoE`` (``router.gate``, ``experts.w1/w2/w3``, optional ``shared_experts`` and ``expert_bias``);
- transformers v5 blocks whose router is a ``router`` module (Jamba, Granite-MoE, Aria, Llama-4, AFMoE's
  ``router.gate``, DBRX's ``router.layer``) over fused (``[E, 2I, H]``), transposed (Llama-4's ``[E, H, 2I]``) or DBRX
  experts, and ``gate`` routers with a score-correction bias but no DeepSeek-V3 group fields (MiniMax-M2, ...): their
  routing (softmax or sigmoid scores, renormalised or not, scaled, ranked with the bias) is read off the router's own
  outputs on random tokens, in training and in eval mode, and must match one of the forms ``moe_route`` computes;
  a renormalising router's epsilon (``w / (sum + eps)``: 1e-20, none, LFM2-MoE's 1e-6) is read off it on tokens with
  tiny selected scores (``FlyMoE.renorm_eps``). Ernie 4.5's ``moe_statics`` correction bias is such a selection bias.

DeepSeek-V3-style routers (sigmoid scores, correction bias, node-limited groups) map to ``FlyMoE``'s options.
Anything else (biases, activations other than SiLU and GELU, router state it does not model, router jitter) raises
``ValueError`` naming what is not supported. transformers v5 blocks keep their router module (``gate``), so hooks on
it still fire.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, TypeVar

import torch
from torch import nn

from fly_lightning.modules.moe_layout import ExpertList

# the FlyMoE class, passed in by ``FlyMoE.from_module`` (which imports this module: no import back)
FlyMoEType = TypeVar("FlyMoEType", bound=nn.Module)


# transformers' activation classes by the function they compute (same function, formulas that round alike to ~1e-7):
# ``gelu`` / ``gelu_python`` (erf); ``gelu_pytorch_tanh``, ``gelu_new``, ``gelu_fast``, ``gelu_accurate`` (tanh form)
_GELU_CLASSES = {"GELUActivation": "gelu", "GELUTanh": "gelu_tanh", "PytorchGELUTanh": "gelu_tanh",
                 "NewGELUActivation": "gelu_tanh", "FastGELUActivation": "gelu_tanh",
                 "AccurateGELUActivation": "gelu_tanh"}  # fmt: skip


def _activation(act: Any) -> str | None:
    """The ``FlyMoE`` activation (``swiglu``'s) computing what ``act`` computes on the gate, or None."""
    if act is None or isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU"):
        return "silu"
    if act is torch.nn.functional.silu:
        return "silu"
    if act is torch.nn.functional.gelu:
        return "gelu"
    if type(act) is nn.GELU:
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(act.approximate)
    return _GELU_CLASSES.get(type(act).__name__)


def _act_name(act: Any) -> str:
    return getattr(act, "__name__", None) or type(act).__name__


def _reject(module: nn.Module, why: str) -> None:
    raise ValueError(f"FlyMoE.from_module: {type(module).__name__}: {why}")


def _check_clamped_swiglu(module: nn.Module, experts: nn.Module) -> None:
    """Clamped SwiGLU variants: gpt-oss's and MiniMax-M3-VL's ``(clamp(up) + 1) * g * sigmoid(alpha * g)``, HY-V4's."""
    limit = getattr(experts, "swiglu_limit", getattr(experts, "limit", None))
    alpha = getattr(experts, "swiglu_alpha", getattr(experts, "alpha", None))
    if limit is not None or alpha is not None:
        _reject(module, f"experts use a clamped SwiGLU variant (limit={limit}, alpha={alpha}): not the block's plain "
                        "SiLU SwiGLU (a new expert activation op would be needed)")  # fmt: skip


def _check_block(module: nn.Module, ungated_shared: bool = False) -> None:
    """``ungated_shared``: a ``shared_expert`` without ``shared_expert_gate`` is added ungated (Llama-4)."""
    gate_missing = getattr(module, "shared_expert", None) is not None and not ungated_shared
    if gate_missing and getattr(module, "shared_expert_gate", None) is None:
        _reject(module, "has a shared expert without its gate (or a gate without the expert)")
    if getattr(module, "shared_expert", None) is None and getattr(module, "shared_expert_gate", None) is not None:
        _reject(module, "has a shared expert without its gate (or a gate without the expert)")
    if getattr(module, "jitter_noise", 0) or getattr(module, "router_jitter_noise", 0):
        _reject(module, "router jitter noise is not supported")
    if getattr(module, "input_jitter_noise", 0):
        _reject(module, "input jitter noise is not supported")


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
    _check_clamped_swiglu(module, experts)
    activation = _activation(getattr(experts, "act_fn", None))
    if activation is None:
        _reject(module, f"expert activation {_act_name(experts.act_fn)} is not SiLU or GELU (erf or tanh)")
    e, two_i, h = experts.gate_up_proj.shape
    k = int(getattr(router, "top_k", getattr(module, "top_k", 0)))
    norm = bool(getattr(router, "norm_topk_prob", getattr(module, "norm_topk_prob", True)))  # Mixtral: always
    _check_router_state(module, router)
    kw = dict(layout="hf", norm_topk_prob=norm, router_fp32=_router_computes_fp32(router), activation=activation)
    block_bias = _block_bias(module)
    if (
        block_bias is not None
        or _statics_bias(router) is not None
        or (
            getattr(router, "e_score_correction_bias", None) is not None
            and not all(hasattr(router, a) for a in ("num_group", "topk_group", "routed_scaling_factor"))
        )
    ):  # a bias ranked without DeepSeek-V3's groups: the routing is read off the router's outputs
        if getattr(router, "bias", None) is not None:
            _reject(module, "router has a bias")
        _check_norm_min(module, router, k, e)
        kw |= _inferred_routing(module, router, k, e, h)
    else:
        kw |= _deepseek_router_options(module, router)
    kw |= options
    moe = _new(cls, router.weight, h, two_i // 2, e, k, False, **kw)
    # the router module itself (its weight, any correction bias: same keys): transformers records router logits with
    # hooks on its router class, which FlyMoE then runs (see FlyMoE.router_logits)
    moe.gate = router
    moe.experts.gate_up_proj, moe.experts.down_proj = experts.gate_up_proj, experts.down_proj
    _attach_block_bias(moe, module)
    _attach_shared(moe, module)
    return moe


_ROUTER_STATE = {"weight", "e_score_correction_bias", "moe_statics.e_score_correction_bias"}


def _statics_bias(router: nn.Module) -> torch.Tensor | None:
    """Ernie 4.5's selection bias: ``moe_statics.e_score_correction_bias``, ``[1, E]`` (as ``[E]``, a view)."""
    bias = getattr(getattr(router, "moe_statics", None), "e_score_correction_bias", None)
    return bias.view(-1) if isinstance(bias, torch.Tensor) and bias.dim() == 2 and bias.shape[0] == 1 else None


def _check_norm_min(module: nn.Module, router: nn.Module, k: int, e: int) -> None:
    """Ernie 4.5 renormalises by ``clamp(sum, min=norm_min)``: the plain sum wherever it is at least ``norm_min``,
    which a softmax's top-k sum (at least k / E) always is when ``norm_min <= k / E`` (the routing form itself is
    read off the router's outputs). A larger ``norm_min`` would act: not modelled."""
    norm_min = getattr(router, "norm_min", None)
    if norm_min is not None and not float(norm_min) <= k / e:
        _reject(module, f"router clamps the renormalising sum at norm_min={norm_min} > top_k / experts = {k / e}: "
                        "not modelled")  # fmt: skip


def _check_router_state(module: nn.Module, router: nn.Module) -> None:
    """Routers whose state we do not model (e.g. Ernie 4.5's ``moe_statics`` correction bias) are left: their state
    would drop out of the state_dict and out of the routing."""
    extra = {n for n, _ in router.named_parameters()} | {n for n, _ in router.named_buffers()}
    extra -= (
        _ROUTER_STATE if _statics_bias(router) is not None else _ROUTER_STATE - {"moe_statics.e_score_correction_bias"}
    )
    children = {n for n, _ in router.named_children()} - (
        {"moe_statics"} if _statics_bias(router) is not None else set()
    )
    if extra or children:
        names = sorted(extra) or sorted(children)
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
    ``sigmoid(shared_expert_gate(x))`` (``shared_expert``, Qwen2-MoE; ungated without the gate, Llama-4)."""
    if getattr(module, "shared_experts", None) is not None:
        moe.shared_experts = module.shared_experts
    if getattr(module, "shared_expert", None) is not None:
        moe.shared_expert, moe.shared_expert_gate = module.shared_expert, getattr(module, "shared_expert_gate", None)


# -- transformers v5 blocks routed by a ``router`` module, and routing read off a router's outputs --------------------

_BIAS_NAMES = ("e_score_correction_bias", "expert_bias")  # selection biases a block holds itself (MiniMax-M2, AFMoE)


def _block_bias(module: nn.Module) -> torch.Tensor | None:
    for name in _BIAS_NAMES:
        bias = getattr(module, name, None)
        if isinstance(bias, torch.Tensor):
            return bias
    return None


def _attach_block_bias(moe: nn.Module, module: nn.Module) -> None:
    """The block's own selection bias, shared under its name, as a parameter or a (persistent or not) buffer."""
    for name in _BIAS_NAMES:
        bias = getattr(module, name, None)
        if isinstance(bias, nn.Parameter):
            setattr(moe, name, bias)
        elif isinstance(bias, torch.Tensor):
            moe.register_buffer(name, bias, persistent=name not in module._non_persistent_buffers_set)


def _selection_bias(module: nn.Module, router: nn.Module) -> torch.Tensor | None:
    bias = _block_bias(module)
    if bias is None:
        bias = _statics_bias(router)
    return bias if bias is not None else getattr(router, "e_score_correction_bias", None)


def _call_router(module: nn.Module, router: nn.Module, x: torch.Tensor, e: int, bias: torch.Tensor | None):
    """``router(x)`` (or ``router(x, bias)``, MiniMax-M2 and AFMoE pass the block's bias), with [T, H] or [1, T, H]
    tokens; then ``(logits, dense [T, E] routing weights, logits index, takes the bias)``."""
    out, failure, bias_arg = None, None, False
    for shape in (x.shape, (1, *x.shape)):
        for with_bias in (False, True) if bias is not None else (False,):
            try:
                out = router(x.reshape(shape), bias) if with_bias else router(x.reshape(shape))
                bias_arg = with_bias
                break
            except Exception as exc:  # noqa: BLE001 - a router that needs other inputs cannot be read
                failure = failure or exc
        if out is not None:
            break
    if out is None:
        _reject(module, f"router could not be run on tokens ({type(failure).__name__}: {failure})")
    t = x.shape[0]
    if isinstance(out, torch.Tensor):  # logits only: the block routes (DBRX's route_tokens_to_experts)
        route = getattr(module, "route_tokens_to_experts", None)
        if route is None:
            _reject(module, "router returns logits only and the block has no route_tokens_to_experts")
        logits = out.reshape(t, -1)
        weights, ids = route(logits)
        return logits, _dense(weights, ids, t, e), 0, bias_arg
    out = tuple(out)
    if len(out) == 3:  # (logits, top-k weights, top-k ids): transformers v5 routers
        logits, weights, ids = out
        return logits.reshape(t, -1), _dense(weights, ids, t, e), 0, bias_arg
    if len(out) == 2 and out[0].shape == out[1].shape:  # Llama-4: (dense scores, logits)
        return out[1].reshape(t, -1), out[0].reshape(t, -1).float(), 1, bias_arg
    _reject(module, f"router returns {len(out)} outputs of a form not understood")
    raise AssertionError  # unreachable


def _dense(weights: torch.Tensor, ids: torch.Tensor, t: int, e: int) -> torch.Tensor:
    w = weights.reshape(t, -1).float()
    return torch.zeros(t, e, dtype=torch.float32, device=w.device).scatter(1, ids.reshape(t, -1).long(), w)


def _scale_fields(owners: tuple[nn.Module, ...]) -> list[float]:
    names = ("routed_scaling_factor", "route_scale")
    return [float(v) for m in owners for n in names if isinstance(v := getattr(m, n, None), (int, float))]


def _inferred_routing(
    module: nn.Module, router: nn.Module, k: int, e: int, h: int, call: nn.Module | None = None
) -> dict:
    """``FlyMoE`` routing options read off the router's own outputs on random tokens, in training and in eval mode
    (jitter, or a routing that differs in training, match no form): softmax or sigmoid scores, renormalised or not,
    a route scale from the router's or the block's scaling field, the selection bias (set to random values meanwhile,
    so that its use shows) ranked with the scores. Rejects a router none of these forms reproduces."""
    from fly_lightning.ops.moe_route import moe_route_reference  # the ops package imports modules: no cycle at import

    call = router if call is None else call
    w = router.weight
    if w.is_meta or type(w).__name__ == "DTensor":
        _reject(module, "router weights on meta / sharded: its routing cannot be read off its outputs")
    bias = _selection_bias(module, router)
    saved_bias = None if bias is None else bias.detach().clone()
    hooks = [(m, m._forward_hooks, m._forward_pre_hooks) for m in module.modules()]
    modes = [(m, m.training) for m in module.modules()]
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, h, generator=g).to(device=w.device, dtype=w.dtype)
    devices = [w.device.index or 0] if w.is_cuda else []
    seen: set = set()
    renorm_eps = None
    try:
        for m, _, _ in hooks:
            m._forward_hooks, m._forward_pre_hooks = OrderedDict(), OrderedDict()
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            if bias is not None:
                bias.copy_(torch.randn(bias.shape, generator=g) * 0.5)
            for training in (False, True):
                module.train(training)
                logits, dense, index, bias_arg = _call_router(module, call, x.clone(), e, bias)
                if logits.shape != (x.shape[0], e):
                    _reject(module, f"router logits of shape {tuple(logits.shape)}, not [tokens, {e} experts]")
                seen.add((_match_routing((call, router, module), logits, dense, k, bias, moe_route_reference), index,
                          bias_arg))  # fmt: skip
            if len(seen) == 1 and next(iter(seen))[0][1]:  # renormalised: which epsilon, with the bias still random
                score, _, scale = next(iter(seen))[0]
                renorm_eps = _renorm_eps(module, call, router, k, e, bias, score, scale, moe_route_reference)
    finally:
        for m, forward, pre in hooks:
            m._forward_hooks, m._forward_pre_hooks = forward, pre
        for m, mode in modes:
            m.training = mode
        if bias is not None:
            with torch.no_grad():
                bias.copy_(saved_bias)
    if len(seen) > 1:
        _reject(module, "router routes differently in training and in eval mode")
    (score, norm, scale), index, bias_arg = seen.pop()
    block_scale = getattr(module, "routed_scaling_factor", None)
    if scale == 1.0 and isinstance(block_scale, (int, float)) and not _scale_fields((call, router)):
        # the router's weights are unscaled and the block scales the routed output (Laguna, MiniMax-M3-VL): the same
        # up to rounding, as a route scale (the probe checks it)
        scale = float(block_scale)
    kw = dict(score_func=score, norm_topk_prob=norm, route_scale=scale)
    kw |= {"renorm_eps": renorm_eps} if renorm_eps is not None else {}
    return kw | ({"router_logits_index": index} if index else {}) | ({"router_bias_arg": True} if bias_arg else {})


# renormalisation epsilons of transformers' routers: moe_route's (DeepSeek-V3, AFMoE: 1e-20), none (MiniMax-M2,
# Laguna: w / sum(w)), LFM2-MoE's 1e-6
_RENORM_EPS = (1e-20, 0.0, 1e-6)


def _renorm_eps(module, call, router, k, e, bias, score, scale, reference) -> float | None:
    """The epsilon of a renormalising router, ``w / (sum(w) + eps) * scale``, read off its outputs on tokens whose
    selected scores sum from ~1 down to ~1e-28 (logits driven to 0 ... -64 through the router weight's
    pseudo-inverse), where the candidates ``_RENORM_EPS`` give different sums. None: ``moe_route``'s own (1e-20), or
    no candidate told apart from it on these tokens (a softmax's top-k sum never falls below k / E). Rejects a router
    that none reproduces: the block would differ from it on tokens whose selected scores are small."""
    w = router.weight.detach()
    v = torch.linalg.pinv(w.double().cpu()) @ torch.ones(e, dtype=torch.float64)  # x with w @ x = 1 (least squares)
    levels = torch.tensor([0.0, 4.0, 8.0, 16.0, 24.0, 32.0, 40.0, 48.0, 56.0, 64.0], dtype=torch.float64)
    x = (-levels[:, None] * v[None, :]).to(device=w.device, dtype=w.dtype)
    logits, dense, _, _ = _call_router(module, call, x, e, bias)
    raw, *_ = reference(logits.float(), k, score, False, bias)
    total, got = raw.double().sum(-1), dense.double().sum(-1)
    tol = 1e-4 if logits.dtype in (torch.float32, torch.float64) else 2e-2
    fits = []
    for eps in _RENORM_EPS:
        want = total * scale / (total + eps)
        err = (got - want).abs() / want.abs().clamp_min(1e-30)
        both_nan = got.isnan() & want.isnan()  # 0 / 0 at an exactly zero sum without epsilon, as the router gives
        if bool(((err <= tol) | both_nan).all()):
            fits.append(eps)
    if not fits:
        _reject(module, f"router renormalises with an epsilon none of {_RENORM_EPS} reproduces (w / (sum + eps), on "
                        "tokens whose selected scores are small)")  # fmt: skip
    return None if _RENORM_EPS[0] in fits else fits[0]


def _match_routing(owners, logits, dense, k, bias, reference) -> tuple[str, bool, float]:
    tol = 1e-4 if logits.dtype in (torch.float32, torch.float64) else 2e-2
    scales = [1.0, *_scale_fields(owners)]
    module = owners[-1]
    best = None
    for score in ("softmax", "sigmoid"):
        for norm in (True, False):
            weights, ids, *_ = reference(logits.float(), k, score, norm, bias)
            want = _dense(weights, ids, logits.shape[0], logits.shape[1])
            for scale in scales:
                err = ((dense - want * scale).norm() / dense.norm().clamp_min(1e-30)).item()
                if best is None or err < best[0]:
                    best = (err, (score, norm, scale))
    if best is None or not best[0] <= tol:
        _reject(module, f"router's top-k weights match no softmax/sigmoid top-k form (renormalised or not, scaled by "
                        f"{scales}, ranked with its bias): relative error {best[0]:.1e}")  # fmt: skip
    return best[1]


def _router_place(module: nn.Module) -> tuple[str, nn.Module]:
    """(dotted path from the block, module) of the module holding the router's ``[E, H]`` weight."""
    router = module.router
    if isinstance(getattr(router, "weight", None), torch.Tensor):
        return "router", router
    for name in ("gate", "layer"):  # AFMoE's router.gate, DBRX's router.layer
        sub = getattr(router, name, None)
        if isinstance(sub, nn.Linear):
            if sub.bias is not None:
                _reject(module, "router has a bias")
            return f"router.{name}", sub
    _reject(module, f"router {type(router).__name__} holds no [experts, hidden] weight")
    raise AssertionError  # unreachable


def _fused_layout(module: nn.Module, experts: nn.Module, e: int, h: int) -> tuple[str, int, str]:
    """(layout, intermediate size, activation) of fused or DBRX expert weights, after the checks that they are plain
    SwiGLU or GeGLU."""
    if getattr(experts, "gate_up_proj_bias", None) is not None or getattr(experts, "has_bias", False):
        extra = ""
        if hasattr(experts, "limit") or hasattr(experts, "alpha"):  # gpt-oss
            extra = (f" and a clamped SwiGLU (limit={getattr(experts, 'limit', None)}, alpha="
                     f"{getattr(experts, 'alpha', None)}, (up + 1) * glu, interleaved gate/up columns)")  # fmt: skip
        _reject(module, f"experts have biases{extra}: the block's experts are bias-free SiLU SwiGLU (a new expert "
                        "kernel would be needed)")  # fmt: skip
    mlp = getattr(experts, "mlp", None)
    if mlp is not None and all(isinstance(getattr(mlp, n, None), torch.Tensor) for n in ("w1", "v1", "w2")):
        act = getattr(mlp, "activation_fn", None)
        if (activation := _activation(act)) is None:
            _reject(module, f"expert activation {_act_name(act)} is not SiLU or GELU (erf or tanh)")
        return "dbrx", mlp.w1.shape[0] // e, activation
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) or gate_up.dim() != 3:
        _reject(module, f"unrecognised experts container {type(experts).__name__}")
    _check_clamped_swiglu(module, experts)
    if not hasattr(experts, "act_fn"):
        _reject(module, "experts have no act_fn (an activation other than SiLU SwiGLU)")
    if (activation := _activation(experts.act_fn)) is None:
        _reject(module, f"expert activation {_act_name(experts.act_fn)} is not SiLU or GELU (erf or tanh)")
    if gate_up.shape[2] == h and down.shape[1] == h and not getattr(experts, "is_transposed", False):
        return "hf", gate_up.shape[1] // 2, activation
    if gate_up.shape[1] == h and down.shape[2] == h:
        return "hf_transposed", gate_up.shape[2] // 2, activation
    _reject(module, f"expert weights of shapes {tuple(gate_up.shape)}, {tuple(down.shape)} fit no layout")
    raise AssertionError  # unreachable


def _hf_router(cls: type[FlyMoEType], module: nn.Module, options: dict) -> FlyMoEType:
    """transformers v5 blocks routed by a ``router`` module (see the module docstring)."""
    _check_block(module, ungated_shared=True)
    if getattr(module, "zero_expert_num", None):
        _reject(module, "zero-computation (identity) experts in the routing: not modelled")
    router = module.router
    if isinstance(getattr(router, "bias", None), torch.Tensor):
        if isinstance(getattr(module.experts, "gate_up_proj_bias", None), torch.Tensor):
            _fused_layout(module, module.experts, 0, 0)  # gpt-oss: the experts' reason, which says more
        _reject(module, "router has a bias")
    path, holder = _router_place(module)
    e, h = holder.weight.shape
    layout, i, activation = _fused_layout(module, module.experts, e, h)
    k = int(getattr(router, "top_k", getattr(module, "top_k", 0)) or 0)
    if not 1 <= k <= e:
        _reject(module, f"top_k={k} for {e} experts")
    extra = {n for n, _ in router.named_parameters()} | {n for n, _ in router.named_buffers()}
    extra -= {"weight", "e_score_correction_bias", "gate.weight", "layer.weight"}
    if extra:
        _reject(module, f"router has state this block does not model: {', '.join(sorted(extra))}")
    call = holder if path == "router.gate" else router  # AFMoE's router needs the block's bias and [B, S, H] tokens
    kw = dict(layout=layout, router_path=path, router_fp32=_router_computes_fp32(holder), activation=activation)
    kw |= _inferred_routing(module, holder, k, e, h, call=router)
    for name in ("router_jitter_noise", "input_jitter_noise", "moe_jitter_eps"):
        if getattr(router, name, None):  # jitter a training run would draw (after the routing form: its reason first)
            _reject(module, f"router {name}={getattr(router, name)} is not supported")
    if kw.get("router_bias_arg") and call is not router:
        kw.pop("router_bias_arg")
    if path == "router.layer":  # DBRX: the router module (logits only) is what the block calls and transformers hooks
        kw["router_call_path"] = "router"
    if kw.get("router_logits_index") == 1:
        # Llama-4: dense (scores, logits) router; the block scales the expert input by the score and returns
        # (output, router logits)
        kw |= dict(score_before_experts=True, return_router_logits=True, router_call_path="router")
    kw |= options
    moe = _new(cls, holder.weight, h, i, e, k, False, **kw)
    moe.router = router
    experts = module.experts
    if layout == "dbrx":
        for name in ("w1", "v1", "w2"):
            setattr(moe.experts.mlp, name, getattr(experts.mlp, name))
    else:
        moe.experts.gate_up_proj, moe.experts.down_proj = experts.gate_up_proj, experts.down_proj
    _attach_block_bias(moe, module)
    _attach_shared(moe, module)
    return moe


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
    activations = set()
    for ex in experts:
        if any(getattr(ex, n).bias is not None for n in (gate_n, up_n, down_n)):
            _reject(module, "expert Linear layers have biases")
        act = getattr(ex, "act_fn", getattr(ex, "act", None))
        if (activation := _activation(act)) is None:
            _reject(module, f"expert activation {_act_name(act)} is not SiLU or GELU (erf or tanh)")
        activations.add(activation)
    if len(activations) > 1:
        _reject(module, f"experts mix activations {sorted(activations)} (one per block)")
    i, h = getattr(first, gate_n).weight.shape
    k = int(getattr(module, "top_k", getattr(router, "top_k", 0)))
    norm = bool(getattr(module, "norm_topk_prob", True))
    kw = dict(layout=layout, norm_topk_prob=norm, activation=activations.pop()) | options
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
        if all(hasattr(module, a) for a in ("router", "input_linear", "output_linear")):  # JetMoE
            if callable(getattr(module, "map", None)):
                _reject(module, "mixture of attention heads (map/reduce around attention), not a feed-forward block")
            _reject(module, "JetMoE's parallel experts (input_linear/output_linear) with an output bias: a layout and "
                            "a bias this block does not model")  # fmt: skip
        _reject(module, "no `experts` attribute")
    if hasattr(module, "router") and hasattr(module.router, "gate") and hasattr(experts, "w1"):
        return _keep_child_order(_torchtitan(cls, module, options), module)
    if not hasattr(module, "gate") and hasattr(module, "router"):
        return _keep_child_order(_hf_router(cls, module, options), module)
    if not hasattr(module, "gate"):
        _reject(module, "no `gate` router")
    if isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor):
        return _keep_child_order(_hf_v5(cls, module, options), module)
    if isinstance(getattr(experts, "up_proj", None), torch.Tensor):  # Nemotron-H: up/down only
        act = getattr(experts, "act_fn", None)
        _reject(module, f"gate-less experts (up_proj/down_proj, activation {type(act).__name__}): the block's experts "
                        "are SwiGLU (a new expert activation op would be needed)")  # fmt: skip
    if isinstance(experts, nn.ModuleList) and len(experts) > 0:
        return _keep_child_order(_expert_list(cls, module, options), module)
    _reject(module, f"unrecognised experts container {type(experts).__name__}")
    raise AssertionError  # unreachable
