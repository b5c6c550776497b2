"""Triton MoE routing, registered as the ``triton`` backend of ``moe_route``: the support predicate, the
per-signature launch plan and the launcher (the counting tails' zeroed workspaces: ``_workspace``). The kernels and
their design are in ``_moe_route_kernel.py``, the launch configurations in ``_moe_route_config.py``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from fly_lightning.kernels import outputs
from fly_lightning.kernels.triton._launch import FastLaunch
from fly_lightning.kernels.triton._math import cdiv, next_pow2
from fly_lightning.kernels.triton._moe_route_config import (
    NEWER_TRITON,
    LaunchConfig,
    _grid,
    default_tail,
    launch_config,
    tile_shape,
)
from fly_lightning.kernels.triton._moe_route_kernel import PACK_BITS, _moe_route_fwd, _perm_base, _perm_scatter
from fly_lightning.kernels.triton._select import BF16_INF, FP16_INF, MAX_K
from fly_lightning.kernels.triton._support import device_reason, interpreting, on_device
from fly_lightning.kernels.triton._workspace import zeroed
from fly_lightning.ops.moe_route import MOE_ROUTE

MAX_E = 1024
# ROCm: libdevice's fast division is CUDA's (__nv_fast_fdividef), which the AMD backend cannot link: there the fast
# sigmoid is off (tests/kernels/triton/test_moe_route_gfx950.py compiles the biased kernels for gfx950)
ON_HIP = torch.version.hip is not None
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _supports(
    logits_TE: torch.Tensor,
    k: int,
    score: str,
    renormalize: bool,
    bias_E: torch.Tensor | None,
    route_scale: float,
    n_groups: int | None,
    topk_groups: int | None,
    return_permutation: bool,
) -> bool | str:
    if (reason := device_reason(logits_TE, bias_E)) is not None:
        return reason
    if logits_TE.dtype not in _DTYPES:
        return f"dtype {logits_TE.dtype}"
    if bias_E is not None and bias_E.dtype not in _DTYPES:
        return f"bias dtype {bias_E.dtype}"
    n_experts = logits_TE.shape[1]
    if n_experts > MAX_E:
        return f"{n_experts} experts > {MAX_E}"
    if k > MAX_K:
        return f"k={k} > {MAX_K}"
    if n_experts > 1 and logits_TE.stride(1) != 1:
        return "last dim not contiguous"
    if bias_E is not None and n_experts > 1 and bias_E.stride(0) != 1:
        return "bias not contiguous"
    if n_groups is not None and n_groups > 32:
        return f"{n_groups} groups > 32"
    return True


@dataclass(frozen=True)
class _Plan:
    programs: int
    tiles: int
    tiles_per_program: int
    rows: int
    packed_tail: bool
    constexprs: dict


@functools.lru_cache(maxsize=512)
def _plan(
    n_tokens: int,
    n_experts: int,
    k: int,
    dtype: torch.dtype,
    row_stride: int,
    score: str,
    renormalize: bool,
    has_bias: bool,
    n_groups: int | None,
    topk_groups: int | None,
    perm: bool,
    device: torch.device,
    config: LaunchConfig | None,
    interpret: bool,
) -> _Plan:
    """Everything about a launch that depends only on the call's signature (cached: the eager path is host-bound)."""
    itemsize = torch.finfo(dtype).bits // 8
    cfg = config or launch_config(n_experts, k, itemsize, n_groups is not None, has_bias)
    shape = tile_shape(n_experts, n_groups, row_stride, itemsize, cfg)
    tiles = cdiv(n_tokens, shape.ROWS)
    programs, per_program = _grid(device, cfg, tiles)
    sel_logits = not has_bias and n_groups is None
    packed = (cfg.tail or default_tail(n_experts)) == "packed" and packed_tail_fits(n_tokens, k, programs)
    constexprs = dict(
        E=n_experts,
        K=k,
        KP=next_pow2(k),
        BLOCK_E=next_pow2(n_experts),
        G=shape.G,
        LG=shape.LG,
        ROWS=shape.ROWS,
        C=shape.C,
        VEC=shape.VEC,
        SG=shape.SG,
        NG=shape.NG,
        CB=shape.CB,
        ALIGN=shape.VEC,
        SIGMOID=score == "sigmoid",
        RENORM=renormalize,
        HAS_BIAS=has_bias,
        SEL_LOGITS=sel_logits,
        HALF_KEYS=sel_logits and dtype in (torch.bfloat16, torch.float16),
        INF16=FP16_INF if dtype == torch.float16 else BF16_INF,
        TOPK_G=topk_groups or 0,
        PERM=perm,
        DIRECT_STORE=NEWER_TRITON if cfg.direct_store is None else cfg.direct_store,
        PREFETCH=cfg.prefetch,
        FAST_SIGMOID=cfg.fast_sigmoid and not ON_HIP,
        TALLY_SEM="relaxed" if cfg.relaxed_tail else "release",
        READ_SEM="relaxed" if cfg.relaxed_tail else "acq_rel",
        PACKED_TAIL=packed,
        NUM_STAGES=cfg.num_stages,
        INTERPRET=interpret,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return _Plan(programs, tiles, per_program, shape.ROWS, packed, constexprs)


def packed_tail_fits(n_tokens: int, k: int, programs: int) -> bool:
    """Whether the packed tail's fields hold this launch's totals (else the launcher uses the ticket tail)."""
    return n_tokens * k < 1 << PACK_BITS and programs <= (1 << (64 - 2 * PACK_BITS)) - 1


_ROUTE = FastLaunch(_moe_route_fwd)
_PERM_BASE = FastLaunch(_perm_base)
_PERM_SCATTER = FastLaunch(_perm_scatter)


@MOE_ROUTE.implement(
    "triton",
    supports=_supports,
    constraints="logits [T, E] fp32/bf16/fp16, E <= 1024, k <= 16, softmax/sigmoid, selection bias, up to 32 "
    "expert groups; counts, offsets and stable permutation fused; no host sync",
)
def moe_route_triton(
    logits_TE: torch.Tensor,
    k: int,
    score: str,
    renormalize: bool,
    bias_E: torch.Tensor | None,
    route_scale: float,
    n_groups: int | None,
    topk_groups: int | None,
    return_permutation: bool,
    config: LaunchConfig | None = None,
) -> tuple[torch.Tensor, ...]:
    n_tokens, n_experts = logits_TE.shape
    dev = logits_TE.device
    i32 = dict(dtype=torch.int32, device=dev)
    plan = None
    if n_tokens:
        plan = _plan(
            n_tokens,
            n_experts,
            k,
            logits_TE.dtype,
            logits_TE.stride(0),
            score,
            renormalize,
            bias_E is not None,
            n_groups,
            topk_groups,
            return_permutation,
            dev,
            config,
            interpreting(),
        )
    # every output element is stored (counts and offsets of every expert by the tail; each program's count of every
    # expert in hist)
    weights = outputs.empty((n_tokens, k), dtype=torch.float32, device=dev)
    ids = outputs.empty((n_tokens, k), **i32)
    counts = outputs.empty((n_experts,), **i32)
    offsets = outputs.empty((n_experts,), **i32)
    if return_permutation:
        sorted_slots, slot_pos = outputs.empty((n_tokens * k,), **i32), outputs.empty((n_tokens, k), **i32)
    else:
        sorted_slots, slot_pos = outputs.empty((0,), **i32), outputs.empty((0,), **i32)
    hist = outputs.empty((plan.programs * n_experts,), **i32) if plan is not None and return_permutation else counts
    if plan is None:  # no tokens
        counts.zero_()
        offsets.zero_()
        return weights, ids, counts, offsets, sorted_slots, slot_pos
    with on_device(logits_TE):  # the workspace, the capture check and the launches all on the logits' GPU
        if plan.packed_tail:  # one int64 word per expert
            ws = zeroed(dev, 2 * n_experts)[: 2 * n_experts].view(torch.int64)
        else:
            ws = zeroed(dev, 1 + n_experts)
        _ROUTE(
            (plan.programs,),
            (
                logits_TE,
                logits_TE.stride(0),
                bias_E if bias_E is not None else logits_TE,
                weights,
                ids,
                slot_pos if return_permutation else ids,
                hist,
                counts,
                offsets,
                ws,
                n_tokens,
                plan.tiles,
                plan.tiles_per_program,
                route_scale,
            ),
            **plan.constexprs,
        )
        if return_permutation:
            _PERM_BASE((cdiv(n_experts, 32),), (hist, counts, offsets, plan.programs, n_experts), EB=32, PB=64,
                       OFFSETS_HERE=plan.packed_tail)  # fmt: skip
            n_slots = n_tokens * k
            _PERM_SCATTER(
                (cdiv(n_slots, 1024),),
                (ids, slot_pos, hist, sorted_slots, n_slots, n_experts, plan.tiles_per_program * plan.rows),
                K=k,
                BLOCK=1024,
                num_warps=4,
            )
    return weights, ids, counts, offsets, sorted_slots, slot_pos
