"""Triton MoE combine and dispatch, registered as the ``triton`` backends of ``moe_combine`` and ``moe_dispatch``.

One pass: each program owns a ``[BT tokens, BH columns]`` block of the output, reads its tokens' k rows (through the
index when the rows are in expert order: whole-row gathers, so the reads stay coalesced), accumulates ``w * row`` in
fp32 registers in slot order and stores the block once in the output dtype. Memory-bound: the rows are read once and
nothing but the output is written (the ATen path widens and copies them first).

Dispatch is the same gather the other way round: each program owns ``[BS expert-ordered rows, BH columns]``, reads
each row's slot from the permutation, loads its token's row (and the slot's weight), scales in fp32 and stores once.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fly_lightning.kernels import outputs
from fly_lightning.kernels.triton._launch import FastLaunch
from fly_lightning.kernels.triton._math import cdiv, next_pow2
from fly_lightning.kernels.triton._support import device_reason, on_device, rows_per_program
from fly_lightning.ops.moe_combine import MOE_COMBINE, MOE_DISPATCH

MAX_K = 32  # slots per token, unrolled
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _moe_combine_fwd(
    ROWS,
    stride_r,
    W,
    stride_wt,
    stride_wk,
    IDX,
    Y,
    stride_y,
    T,
    H,
    K: tl.constexpr,
    BT: tl.constexpr,
    BH: tl.constexpr,
    HAS_INDEX: tl.constexpr,
):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    t_ok = t < T
    ok = t_ok[:, None] & (h < H)[None, :]
    t64 = t.to(tl.int64)
    acc = tl.zeros([BT, BH], tl.float32)
    for j in tl.static_range(K):
        slot = t64 * K + j
        if HAS_INDEX:
            row = tl.load(IDX + slot, mask=t_ok, other=0).to(tl.int64)
        else:
            row = slot
        w = tl.load(W + t64 * stride_wt + j * stride_wk, mask=t_ok, other=0.0).to(tl.float32)
        x = tl.load(ROWS + row[:, None] * stride_r + h[None, :], mask=ok, other=0.0).to(tl.float32)
        acc += w[:, None] * x
    tl.store(Y + t64[:, None] * stride_y + h[None, :], acc.to(Y.dtype.element_ty), mask=ok)


def _supports(
    rows: torch.Tensor, weights: torch.Tensor, index: torch.Tensor | None, out_dtype: torch.dtype | None
) -> bool | str:
    if (reason := device_reason(rows, weights, index)) is not None:
        return reason
    if rows.dtype not in _DTYPES or weights.dtype not in _DTYPES or (out_dtype or rows.dtype) not in _DTYPES:
        return f"dtypes rows {rows.dtype}, weights {weights.dtype}, out {out_dtype or rows.dtype}"
    if weights.shape[1] > MAX_K:
        return f"k={weights.shape[1]} > {MAX_K}"
    if rows.shape[1] > 1 and rows.stride(1) != 1:
        return "rows' last dim not contiguous"
    if index is not None and index.numel() > 1 and index.stride(0) != 1:
        return "index not contiguous"
    return True


NUM_WARPS = 4


@functools.lru_cache(maxsize=256)
def _plan(h: int, itemsize: int) -> tuple[int, int]:
    """(BT, BH): up to 4 KB of each row (2048 bf16 / 1024 fp32 columns), about 4096 elements per program."""
    bh = min(next_pow2(h), 4096 // itemsize)
    return max(1, 4096 // bh), bh


_COMBINE = FastLaunch(_moe_combine_fwd)


@MOE_COMBINE.implement(
    "triton",
    supports=_supports,
    constraints=f"rows [T*k, H] fp32/bf16/fp16 (last dim contiguous), weights fp32/bf16/fp16, k <= {MAX_K}, "
    "contiguous int32 index or none; one pass, fp32 accumulation in slot order",
)
def moe_combine_triton(
    rows: torch.Tensor, weights: torch.Tensor, index: torch.Tensor | None, out_dtype: torch.dtype | None
) -> torch.Tensor:
    t, k = weights.shape
    h = rows.shape[1]
    y = outputs.empty((t, h), dtype=out_dtype or rows.dtype, device=rows.device)  # the grid covers [T, H]
    if y.numel() == 0:
        return y
    if k == 0:
        return y.zero_()
    bt, bh = _plan(h, rows.element_size())
    bt = rows_per_program(t, bt, rows)
    grid = (cdiv(t, bt), cdiv(h, bh))
    with on_device(rows):
        _COMBINE(
            grid,
            (
                rows,
                rows.stride(0),
                weights,
                weights.stride(0),
                weights.stride(1),
                rows if index is None else index,  # unused without an index
                y,
                y.stride(0),
                t,
                h,
            ),
            K=k,
            BT=bt,
            BH=bh,
            HAS_INDEX=index is not None,
            num_warps=NUM_WARPS,
        )
    return y


@triton.jit
def _moe_dispatch_fwd(
    X,
    stride_x,
    W,
    PERM,
    Y,
    stride_y,
    S,
    H,
    TOPK: tl.constexpr,
    BS: tl.constexpr,
    BH: tl.constexpr,
    HAS_W: tl.constexpr,
):
    r = tl.program_id(0) * BS + tl.arange(0, BS)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    r_ok = r < S
    ok = r_ok[:, None] & (h < H)[None, :]
    slot = tl.load(PERM + r, mask=r_ok, other=0).to(tl.int64)
    x = tl.load(X + (slot // TOPK)[:, None] * stride_x + h[None, :], mask=ok, other=0.0).to(tl.float32)
    if HAS_W:
        x = x * tl.load(W + slot, mask=r_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(Y + r.to(tl.int64)[:, None] * stride_y + h[None, :], x.to(Y.dtype.element_ty), mask=ok)


def _supports_dispatch(
    x: torch.Tensor, perm: torch.Tensor, topk: int, weights: torch.Tensor | None, out_dtype: torch.dtype | None
) -> bool | str:
    if (reason := device_reason(x, perm, weights)) is not None:
        return reason
    if x.dtype not in _DTYPES or (out_dtype or x.dtype) not in _DTYPES:
        return f"dtypes x {x.dtype}, out {out_dtype or x.dtype}"
    if weights is not None and (weights.dtype not in _DTYPES or not weights.is_contiguous()):
        return f"weights {weights.dtype}, contiguous={weights.is_contiguous()}"
    if x.shape[1] > 1 and x.stride(1) != 1:
        return "x's last dim not contiguous"
    if perm.numel() > 1 and perm.stride(0) != 1:
        return "perm not contiguous"
    return True


_DISPATCH = FastLaunch(_moe_dispatch_fwd)


@MOE_DISPATCH.implement(
    "triton",
    supports=_supports_dispatch,
    constraints="x [T, H] fp32/bf16/fp16 (last dim contiguous), contiguous int32 perm, contiguous weights or none; "
    "one pass, fp32 scaling, one rounding",
)
def moe_dispatch_triton(
    x: torch.Tensor, perm: torch.Tensor, topk: int, weights: torch.Tensor | None, out_dtype: torch.dtype | None
) -> torch.Tensor:
    s, h = perm.shape[0], x.shape[1]
    y = outputs.empty((s, h), dtype=out_dtype or x.dtype, device=x.device)  # the grid covers [S, H]
    if y.numel() == 0:
        return y
    bs, bh = _plan(h, x.element_size())
    bs = rows_per_program(s, bs, x)
    with on_device(x):
        _DISPATCH(
            (cdiv(s, bs), cdiv(h, bh)),
            (x, x.stride(0), x if weights is None else weights, perm, y, y.stride(0), s, h),  # x: placeholder weights
            TOPK=topk,
            BS=bs,
            BH=bh,
            HAS_W=weights is not None,
            num_warps=NUM_WARPS,
        )
    return y
