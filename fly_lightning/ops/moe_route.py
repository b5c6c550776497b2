"""TopK MoE routing: scores, expert selection, gate weights, per-expert counts, group offsets and the token permutation.

Forward is dispatched (Triton / ATen); backward (gate weights -> logits) always runs existing ATen ops.

Router variants (explicit options):
- Mixtral, Qwen2/3-MoE, OLMoE: ``score="softmax"``, ``renormalize`` True (Mixtral, Qwen3) or False (OLMoE, Qwen2).
- DeepSeek-V3 (and torchtitan's ``TokenChoiceTopKRouter``): ``score="sigmoid"``, ``bias_E`` for aux-loss-free
  balancing (it changes which experts are chosen, never the weights), node-limited routing with ``n_groups`` /
  ``topk_groups`` (a group's score is the sum of its two best biased scores; experts outside the chosen groups are
  never selected), ``renormalize=True`` and ``route_scale`` (the routed scaling factor).

Semantics (the reference below is the oracle; the Triton kernel matches it exactly on expert ids, counts, offsets and
the permutation when ranking the logits, i.e. without bias and groups; with them it ranks its own fp32 scores, so a
row may swap two experts whose scores differ by fp32 rounding. On NVIDIA GPUs those ranked sigmoids use the fast
exponential and division (``fast_sigmoid``): scores of logits below about -87.3, subnormal in the reference, are 0
there, so such experts tie (lower index first) where the reference still orders them. Weights agree within fp32
rounding):
- Scores are computed in fp32. Without bias and groups the ranking is done on the logits themselves: softmax and
  sigmoid are increasing, so this is the same ranking, except that distinct logits whose fp32 probabilities round to
  the same value (saturated sigmoids, say) still rank by logit. With bias or groups the ranking is on
  ``score + bias`` in fp32.
- Ties rank the lower expert index first (also for groups); ``ids_TK`` is sorted by descending rank. (ATen's
  ``torch.topk`` leaves the order of equal values unspecified: on CPU it often returns the higher index first.)
- NaN ranks above every number, as in ``torch.topk``; several NaN rank by lower index. -0.0 and +0.0 are equal. A NaN
  logit makes its row's softmax weights NaN (sigmoid: that expert's weight, or the whole row once renormalised);
  NaN is propagated, never hidden.
- ``renormalize`` divides by ``sum + 1e-20`` (DeepSeek-V3 / torchtitan); ``route_scale`` multiplies afterwards.
- ``counts_E[e]`` is the number of (token, slot) pairs routed to expert ``e``; ``offsets_E`` its inclusive cumsum, the
  group end offsets ``torch._grouped_mm`` takes (int32). The permutation is stable: slots ``t * k + j`` sorted by
  expert, then by slot index, identical to ``torch.argsort(ids_TK.flatten(), stable=True)``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from fly_lightning.dispatch import register_op
from fly_lightning.ops._eager import EagerCall
from fly_lightning.registry import scalar_key, tensor_key

_FP32_MAX = torch.finfo(torch.float32).max

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_SCORES = ("softmax", "sigmoid")
RENORM_EPS = 1e-20


class MoERouting(NamedTuple):
    """Result of :func:`moe_route`.

    Attributes:
        weights_TK: gate weights, fp32, ``[T, k]``.
        ids_TK: chosen experts, int32, ``[T, k]``, best first.
        counts_E: (token, slot) pairs per expert, int32, ``[E]``.
        offsets_E: group end offsets (inclusive cumsum of ``counts_E``), int32, ``[E]``.
        sorted_slots_S: with ``return_permutation``: flat slot indices ``t * k + j`` sorted by expert, stable, int32,
            ``[T * k]``; ``sorted_slots_S // k`` are the tokens to gather for the grouped GEMM.
        slot_pos_TK: with ``return_permutation``: position of slot ``(t, j)`` in that order, int32, ``[T, k]``
            (``y_sorted[slot_pos_TK]`` brings expert outputs back to token order).
    """

    weights_TK: Tensor
    ids_TK: Tensor
    counts_E: Tensor
    offsets_E: Tensor
    sorted_slots_S: Tensor | None = None
    slot_pos_TK: Tensor | None = None


def group_reason(n_experts: int, k: int, n_groups: int, topk_groups: int) -> str | None:
    """Why group-limited routing cannot pick ``k`` of ``n_experts`` (None when it can): the groups must split the
    experts evenly into groups of at least 2 (a group scores its top 2), keep 1 to ``n_groups`` of them, and hold at
    least ``k`` experts in the kept ones. Also ``FlyMoE``'s constructor check."""
    if n_groups < 1 or n_experts % n_groups:
        return f"n_groups={n_groups} must be >= 1 and divide the {n_experts} experts"
    size = n_experts // n_groups
    if size < 2:
        return f"groups need >= 2 experts (groups of >= 2: a group scores its top 2), got {size}"
    if not 1 <= topk_groups <= n_groups:
        return f"topk_groups must be in [1, n_groups={n_groups}], got {topk_groups}"
    if k > topk_groups * size:
        return (
            f"k={k} is larger than the {topk_groups * size} experts of {topk_groups} groups of {size} (the experts "
            "reachable through the kept groups)"
        )
    return None


def _validate(
    logits_TE: Tensor,
    k: int,
    score: str,
    renormalize: bool,
    bias_E: Tensor | None,
    route_scale: float,
    n_groups: int | None,
    topk_groups: int | None,
    return_permutation: bool,
) -> None:
    if not isinstance(logits_TE, Tensor):
        raise ValueError(f"moe_route: logits must be a Tensor, got {type(logits_TE).__name__}")
    if logits_TE.dim() != 2:
        raise ValueError(f"moe_route: logits must be 2-D [tokens, experts], got shape {list(logits_TE.shape)}")
    if logits_TE.dtype not in _FLOATS:
        raise ValueError(f"moe_route: logits must be floating, got {logits_TE.dtype}")
    n_experts = logits_TE.shape[1]
    if isinstance(k, bool) or not isinstance(k, int):
        raise ValueError(f"moe_route: k must be an int, got {type(k).__name__}")
    if k < 1:
        raise ValueError(f"moe_route: k must be >= 1, got {k}")
    if k > n_experts:
        raise ValueError(f"moe_route: k={k} is larger than the number of experts {n_experts}")
    if score not in _SCORES:
        raise ValueError(f"moe_route: score must be one of {_SCORES}, got {score!r}")
    if bias_E is not None:
        if not isinstance(bias_E, Tensor) or bias_E.dim() != 1 or bias_E.shape[0] != n_experts:
            shape = list(bias_E.shape) if isinstance(bias_E, Tensor) else type(bias_E).__name__
            raise ValueError(f"moe_route: bias must have shape [{n_experts}], got {shape}")
        if bias_E.dtype not in _FLOATS:
            raise ValueError(f"moe_route: bias must be floating, got {bias_E.dtype}")
        if bias_E.device != logits_TE.device:
            raise ValueError(f"moe_route: bias on {bias_E.device}, logits on {logits_TE.device}")
    if not (math.isfinite(route_scale) and abs(route_scale) <= _FP32_MAX):  # the weights are fp32
        raise ValueError(f"moe_route: route_scale must be finite in fp32, got {route_scale}")
    if (n_groups is None) != (topk_groups is None):
        raise ValueError("moe_route: n_groups and topk_groups must be given together")
    for name, v in (("n_groups", n_groups), ("topk_groups", topk_groups)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise ValueError(f"moe_route: {name} must be an int, got {type(v).__name__}")
    if n_groups is not None and (reason := group_reason(n_experts, k, n_groups, topk_groups)) is not None:
        raise ValueError(f"moe_route: {reason}")
    if logits_TE.shape[0] * k >= 2**31:
        raise ValueError(f"moe_route: tokens * k = {logits_TE.shape[0] * k} does not fit int32 positions")


def _rank(values: Tensor, allowed: Tensor | None = None) -> Tensor:
    """Column indices of each row, best first: descending, NaN first, ties by lower index; disallowed ones last."""
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices
    if allowed is not None:  # a stable sort of that order by the flag keeps value order inside each part
        flag = allowed.gather(-1, order).to(torch.int8)
        order = order.gather(-1, torch.sort(flag, dim=-1, descending=True, stable=True).indices)
    return order


def _scores(x: Tensor, score: str) -> Tensor:
    return torch.softmax(x, dim=-1) if score == "softmax" else torch.sigmoid(x)


def ranked_values(x_TE: Tensor, score: str, bias_E: Tensor | None, grouped: bool) -> Tensor:
    """What the experts are ranked by, in ``x_TE``'s dtype, before any group masking: the logits themselves without
    bias and groups (softmax and sigmoid are increasing), else the scores plus the bias."""
    if bias_E is None and not grouped:
        return x_TE
    scores = _scores(x_TE, score)
    return scores if bias_E is None else scores + bias_E.to(scores.dtype)


def routing_counts(ids_TK: Tensor, n_experts: int, return_permutation: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Counts, group end offsets and (optionally) the stable permutation of ``ids_TK``, without host sync."""
    flat = ids_TK.flatten().long()
    sorted_ids, perm = torch.sort(flat, stable=True)
    experts = torch.arange(n_experts, device=ids_TK.device)
    offsets = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    if not return_permutation:
        none = dict(size=(0,), dtype=torch.int32)  # distinct tensors: custom op outputs may not alias
        return counts, offsets, ids_TK.new_empty(**none), ids_TK.new_empty(**none)
    pos = torch.empty_like(perm).scatter_(0, perm, torch.arange(flat.numel(), device=flat.device))
    return counts, offsets, perm.to(torch.int32), pos.to(torch.int32).view(ids_TK.shape)


def moe_route_reference(
    logits_TE: Tensor,
    k: int,
    score: str = "softmax",
    renormalize: bool = True,
    bias_E: Tensor | None = None,
    route_scale: float = 1.0,
    n_groups: int | None = None,
    topk_groups: int | None = None,
    return_permutation: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Plain-torch reference and oracle: ``(weights, ids, counts, offsets, sorted_slots, slot_pos)``.

    The permutation outputs are empty (``[0]``) unless ``return_permutation``. No host synchronisation, so it also
    serves as the ATen fallback under CUDA graphs.
    """
    x = logits_TE.float()
    n_tokens, n_experts = x.shape
    scores = _scores(x, score)
    sel = ranked_values(x, score, bias_E, n_groups is not None)  # the logits where they rank the same: no rounding ties
    allowed = None
    if n_groups is not None:
        size = n_experts // n_groups
        group_scores = sel.view(n_tokens, n_groups, size).topk(2, dim=-1).values.sum(-1)
        chosen = _rank(group_scores)[:, :topk_groups]
        allowed_G = torch.zeros(n_tokens, n_groups, dtype=torch.bool, device=x.device).scatter_(1, chosen, True)
        allowed = allowed_G.repeat_interleave(size, dim=1)
    ids = _rank(sel, allowed)[:, :k]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + RENORM_EPS)
    weights = weights * route_scale
    ids = ids.to(torch.int32)
    return (weights, ids, *routing_counts(ids, n_experts, return_permutation))


def _signature(
    logits_TE: Tensor,
    k: int,
    score: str,
    renormalize: bool,
    bias_E: Tensor | None,
    route_scale: float,
    n_groups: int | None,
    topk_groups: int | None,
    return_permutation: bool,
) -> tuple:
    return (
        tensor_key(logits_TE),
        scalar_key(k),
        score,
        renormalize,
        tensor_key(bias_E),
        route_scale,
        scalar_key(n_groups),
        scalar_key(topk_groups),
        return_permutation,
    )


MOE_ROUTE = register_op(
    "moe_route",
    reference=moe_route_reference,
    signature=_signature,
    validate=_validate,
    doc="TopK MoE routing; (logits, k, score, renormalize, bias, route_scale, n_groups, topk_groups, "
    "return_permutation) -> (weights, ids, counts, offsets, sorted_slots, slot_pos)",
)


@torch.library.custom_op("fly::moe_route", mutates_args=())
def moe_route_op(
    logits_TE: Tensor,
    k: int,
    score: str,
    renormalize: bool,
    bias_E: Tensor | None,
    route_scale: float,
    n_groups: int | None,
    topk_groups: int | None,
    return_permutation: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Dispatched forward: ``(weights, ids, counts, offsets, sorted_slots, slot_pos)``."""
    return MOE_ROUTE(logits_TE, k, score, renormalize, bias_E, route_scale, n_groups, topk_groups, return_permutation)


@moe_route_op.register_fake
def _(
    logits_TE: Tensor,
    k: int,
    score: str,
    renormalize: bool,
    bias_E: Tensor | None,
    route_scale: float,
    n_groups: int | None,
    topk_groups: int | None,
    return_permutation: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    _validate(logits_TE, k, score, renormalize, bias_E, route_scale, n_groups, topk_groups, return_permutation)
    n_tokens, n_experts = logits_TE.shape
    i32 = dict(dtype=torch.int32)
    slots = (n_tokens * k,) if return_permutation else (0,)
    pos = (n_tokens, k) if return_permutation else (0,)
    return (
        logits_TE.new_empty((n_tokens, k), dtype=torch.float32),
        logits_TE.new_empty((n_tokens, k), **i32),
        logits_TE.new_empty((n_experts,), **i32),
        logits_TE.new_empty((n_experts,), **i32),
        logits_TE.new_empty(slots, **i32),
        logits_TE.new_empty(pos, **i32),
    )


def _setup_context(ctx, inputs, output) -> None:
    logits_TE, k, score, renormalize, bias_E, route_scale, *_ = inputs
    ctx.save_for_backward(logits_TE, output[1])
    ctx.score, ctx.renormalize, ctx.route_scale = score, renormalize, route_scale


def _backward(ctx, grad_weights, *unused):
    logits_TE, ids_TK = ctx.saved_tensors
    grad = None
    if ctx.needs_input_grad[0] and grad_weights is not None:
        grad = moe_route_backward(grad_weights, logits_TE, ids_TK, ctx.score, ctx.renormalize, ctx.route_scale)
    return grad, None, None, None, None, None, None, None, None


def moe_route_backward(
    grad_weights_TK: Tensor, logits_TE: Tensor, ids_TK: Tensor, score: str, renormalize: bool, route_scale: float
) -> Tensor:
    """Gate weights -> logits through existing ATen ops; the chosen ids are constants (bias gets no gradient)."""
    x = logits_TE.to(torch.promote_types(logits_TE.dtype, torch.float32))
    s = _scores(x, score)
    idx = ids_TK.long()
    p = s.gather(1, idx)
    g = grad_weights_TK.to(x.dtype) * route_scale
    if renormalize:  # w = p / (sum(p) + eps): dw_j/dp_i = [i == j] / d - p_j / d^2
        d = p.sum(-1, keepdim=True) + RENORM_EPS
        g = g / d - (g * p).sum(-1, keepdim=True) / (d * d)
    grad_s = torch.zeros_like(s).scatter_(1, idx, g)  # a row never picks an expert twice
    if score == "softmax":
        grad_x = s * (grad_s - (grad_s * s).sum(-1, keepdim=True))
    else:
        grad_x = grad_s * s * (1.0 - s)
    return grad_x.to(logits_TE.dtype)


_moe_route_eager = EagerCall(MOE_ROUTE, moe_route_op, _setup_context, _backward)


def moe_route(
    logits_TE: Tensor,
    k: int,
    score: str = "softmax",
    renormalize: bool = True,
    bias_E: Tensor | None = None,
    route_scale: float = 1.0,
    n_groups: int | None = None,
    topk_groups: int | None = None,
    return_permutation: bool = False,
) -> MoERouting:
    """Route each token to its top-``k`` experts: gate weights, expert ids, counts, group offsets, permutation.

    Args:
        logits_TE: router logits ``[T, E]`` (fp32/bf16/fp16; fp64 runs on ATen).
        k: experts per token, ``1 <= k <= E``.
        score: ``"softmax"`` over the experts, or ``"sigmoid"`` per expert; computed in fp32.
        renormalize: divide the ``k`` weights by their sum (+1e-20).
        bias_E: optional ``[E]`` selection bias (DeepSeek-V3 aux-loss-free balancing): added to the scores for choosing
            experts and groups only; weights come from the unbiased scores; it gets no gradient.
        route_scale: multiplies the weights (after renormalisation).
        n_groups, topk_groups: node-limited routing (DeepSeek-V3): experts form ``n_groups`` equal groups, each scored
            by the sum of its two best (biased) scores; only the ``topk_groups`` best groups' experts can be chosen.
        return_permutation: also return the stable expert-sorted slot order and its inverse (see :class:`MoERouting`).

    Gradients flow from ``weights_TK`` to ``logits_TE``; ids, counts, offsets and the permutation carry none. See the
    module docstring for ties, NaN and the exact ranking rule. No host synchronisation: usable under CUDA graphs and
    ``torch.compile(fullgraph=True)``.
    """
    if isinstance(k, bool) or not isinstance(k, int):  # the custom op's schema would reject it less clearly
        raise ValueError(f"moe_route: k must be an int, got {type(k).__name__}")
    args = (
        logits_TE,
        k,
        score,
        bool(renormalize),
        bias_E,
        float(route_scale),
        n_groups,
        topk_groups,
        bool(return_permutation),
    )
    out = _moe_route_eager(*args)
    if return_permutation:
        return MoERouting(*out)
    return MoERouting(*out[:4])
