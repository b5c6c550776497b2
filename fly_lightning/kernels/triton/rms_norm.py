"""Triton RMSNorm forward, registered as the ``triton`` backend of ``rms_norm``.

Two kernels:
- ``_rms_norm_rows``: ROWS rows per program, the whole row in registers (or in chunks for very wide rows).
- ``_rms_norm_unaligned``: contiguous rows whose width H is not a multiple of the 16-byte vector. Row starts are then
  misaligned, and masked loads on an unaligned H are issued one element at a time; this kernel instead moves the
  16-byte-aligned interior of each row with full vector loads/stores and the <16-byte head and tail separately.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fly_lightning.kernels import outputs
from fly_lightning.kernels.triton._launch import FastLaunch
from fly_lightning.kernels.triton._math import cdiv
from fly_lightning.kernels.triton._support import device_reason, interpreting, launch_tuned, on_device
from fly_lightning.ops.rms_norm import RMS_NORM

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_BLOCK = 32768  # widest row kept whole in registers; wider rows are processed in chunks


@triton.jit
def _scale(xhat, w, offset, CAST_FIRST: tl.constexpr, X_DTYPE: tl.constexpr, W_DTYPE: tl.constexpr):
    if CAST_FIRST:
        # Llama-style: round the normalised value to x's dtype and (w + offset) to w's dtype, then multiply
        w_eff = (w.to(tl.float32) + offset).to(W_DTYPE).to(tl.float32)
        return xhat.to(X_DTYPE).to(tl.float32) * w_eff
    return xhat * (w.to(tl.float32) + offset)


@triton.jit
def _rms_norm_rows(
    X,
    W,
    Y,
    RSTD,
    n_rows,
    stride_x,
    stride_y,
    eps,
    offset,
    H: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    CHUNKED: tl.constexpr,
    HAS_W: tl.constexpr,
    CAST_FIRST: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    x_row = X + rows.to(tl.int64)[:, None] * stride_x
    y_row = Y + rows.to(tl.int64)[:, None] * stride_y
    cols = tl.arange(0, BLOCK)[None, :]
    if CHUNKED:
        acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for start in range(0, H, BLOCK):
            m = row_ok[:, None] & (start + cols < H)
            x = tl.load(x_row + start + cols, mask=m, other=0.0).to(tl.float32)
            acc += x * x
        rstd = tl.rsqrt(tl.sum(acc, axis=1) / H + eps)
        for start in range(0, H, BLOCK):
            m = row_ok[:, None] & (start + cols < H)
            xhat = tl.load(x_row + start + cols, mask=m, other=0.0).to(tl.float32) * rstd[:, None]
            if HAS_W:
                w = tl.load(W + start + cols, mask=start + cols < H, other=0.0)
                xhat = _scale(xhat, w, offset, CAST_FIRST, X.dtype.element_ty, W.dtype.element_ty)
            tl.store(y_row + start + cols, xhat.to(Y.dtype.element_ty), mask=m)
    elif ROWS == 1:
        # one row per program as a 1D tile with a scalar row pointer: ~1% faster than the [1, BLOCK] tile on the H200
        # (benchmarks/sweep_rms_norm_rows.py), the row-mask broadcast and 2D indexing gone
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + c, mask=c < H, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
        xhat = x * r
        if HAS_W:
            w = tl.load(W + c, mask=c < H, other=0.0)
            xhat = _scale(xhat, w, offset, CAST_FIRST, X.dtype.element_ty, W.dtype.element_ty)
        tl.store(Y + row * stride_y + c, xhat.to(Y.dtype.element_ty), mask=c < H)
        rstd = tl.full([ROWS], 0.0, tl.float32) + r
    else:
        m = row_ok[:, None] & (cols < H)
        x = tl.load(x_row + cols, mask=m, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / H + eps)
        xhat = x * rstd[:, None]
        if HAS_W:
            w = tl.load(W + cols, mask=cols < H, other=0.0)
            xhat = _scale(xhat, w, offset, CAST_FIRST, X.dtype.element_ty, W.dtype.element_ty)
        tl.store(y_row + cols, xhat.to(Y.dtype.element_ty), mask=m)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def _rms_norm_unaligned(
    X,
    W,
    Y,
    RSTD,
    eps,
    offset,
    H: tl.constexpr,
    VEC: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_W: tl.constexpr,
    CAST_FIRST: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = row * H
    first = tl.multiple_of((base + VEC - 1) // VEC * VEC, VEC)  # first vector-aligned element of the row
    last = tl.multiple_of((base + H) // VEC * VEC, VEC)  # end of the row's last whole vector
    n_mid = tl.multiple_of(last - first, VEC)
    cols = tl.arange(0, BLOCK)
    edge = tl.arange(0, VEC)
    mid_m = cols < n_mid
    head_m = edge < first - base
    tail_m = edge < base + H - last
    x_mid = tl.load(X + first + cols, mask=mid_m, other=0.0).to(tl.float32)
    x_head = tl.load(X + base + edge, mask=head_m, other=0.0).to(tl.float32)
    x_tail = tl.load(X + last + edge, mask=tail_m, other=0.0).to(tl.float32)
    ss = tl.sum(x_mid * x_mid, axis=0) + tl.sum(x_head * x_head, axis=0) + tl.sum(x_tail * x_tail, axis=0)
    rstd = tl.rsqrt(ss / H + eps)
    y_mid, y_head, y_tail = x_mid * rstd, x_head * rstd, x_tail * rstd
    if HAS_W:
        w_mid = tl.load(W + (first - base) + cols, mask=mid_m, other=0.0)
        w_head = tl.load(W + edge, mask=head_m, other=0.0)
        w_tail = tl.load(W + (last - base) + edge, mask=tail_m, other=0.0)
        y_mid = _scale(y_mid, w_mid, offset, CAST_FIRST, X.dtype.element_ty, W.dtype.element_ty)
        y_head = _scale(y_head, w_head, offset, CAST_FIRST, X.dtype.element_ty, W.dtype.element_ty)
        y_tail = _scale(y_tail, w_tail, offset, CAST_FIRST, X.dtype.element_ty, W.dtype.element_ty)
    tl.store(Y + first + cols, y_mid.to(Y.dtype.element_ty), mask=mid_m)
    tl.store(Y + base + edge, y_head.to(Y.dtype.element_ty), mask=head_m)
    tl.store(Y + last + edge, y_tail.to(Y.dtype.element_ty), mask=tail_m)
    tl.store(RSTD + row, rstd)


def _configs(kernel: str) -> list[triton.Config]:
    """Autotuning space, measured once per (H, flags) and cached by Triton."""
    if kernel == "unaligned":
        return [triton.Config({}, num_warps=w) for w in (2, 4, 8, 16)]
    return [triton.Config({"ROWS": r}, num_warps=w) for r in (1, 2, 4, 8) for w in (2, 4, 8, 16)]


def _prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    block = kwargs.get("BLOCK", named_args.get("BLOCK"))
    # keep a whole [ROWS, BLOCK] tile at <= 64 fp32 values per thread, and no more warps than elements need
    kept = [
        c
        for c in configs
        if c.kwargs.get("ROWS", 1) * block <= 64 * 32 * c.num_warps
        and c.num_warps * 32 * 4 <= c.kwargs.get("ROWS", 1) * block
    ]
    return kept or configs[:1]


# cache_results: the picks are kept in Triton's cache directory, so a later process launches without re-measuring
_rms_norm_rows_tuned = triton.autotune(
    _configs("rows"),
    key=["H", "HAS_W", "CAST_FIRST"],
    prune_configs_by={"early_config_prune": _prune},
    cache_results=True,
)(_rms_norm_rows)
_rms_norm_unaligned_tuned = triton.autotune(
    _configs("unaligned"), key=["H", "HAS_W", "CAST_FIRST"], cache_results=True
)(_rms_norm_unaligned)


@dataclass(frozen=True)
class LaunchConfig:
    kernel: str  # "rows" or "unaligned"
    block: int
    rows: int = 1
    num_warps: int = 4


@functools.cache  # every call asks: the answer depends on these three only
def launch_config(h: int, itemsize: int, contiguous_rows: bool) -> LaunchConfig:
    """Kernel and block per row width; rows per program and warps are autotuned unless a config is forced.

    ``benchmarks/bench_rms_norm.py --sweep`` times the alternatives explicitly.
    """
    vec = 16 // itemsize
    if contiguous_rows and h % vec and h >= 4 * vec:
        # the tile holds the row's aligned interior, never wider than h // vec * vec: for h just above a power of two
        # (4097) next_pow2(h) would double it (measured: 94 -> 70 us at 16384 x 4097, sweep_rms_norm_unaligned)
        block = triton.next_power_of_2(h // vec * vec)
        return LaunchConfig("unaligned", block, 1, _warps(block * itemsize))
    block = min(triton.next_power_of_2(h), MAX_BLOCK)
    rows = max(1, min(16, 2048 // block)) if h <= 1024 else 1
    return LaunchConfig("rows", block, rows, _warps(block * rows * itemsize))  # rows/warps: forced configs only


def _warps(row_bytes: int) -> int:
    # about 64 bytes of the row per thread, between 1 and 16 warps
    return int(min(16, max(1, triton.next_power_of_2(row_bytes // (64 * 32)))))


def _supports(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, cast: bool) -> bool | str:
    if (reason := device_reason(x, weight)) is not None:
        return reason
    if x.dtype not in _DTYPES:
        return f"dtype {x.dtype}"
    if weight is not None and weight.dtype not in _DTYPES:
        return f"weight dtype {weight.dtype}"
    if x.numel() == 0:
        return True  # nothing to launch; the launcher returns empty outputs
    if x.stride(-1) != 1:
        return "last dim not contiguous"
    if weight is not None and weight.numel() > 1 and weight.stride(0) != 1:
        return "weight not contiguous"  # the kernels read it as a dense vector
    try:
        x.view(-1, x.shape[-1])
    except RuntimeError:
        return "leading dims not collapsible to rows (would need a copy)"
    return True


@dataclass(frozen=True)
class _Plan:
    cfg: LaunchConfig
    tuned: bool  # autotune rows per program and warps (launch_tuned) instead of launching cfg's
    consts: dict  # the kernel's constexprs


@functools.lru_cache(maxsize=512)
def _plan(
    h: int,
    itemsize: int,
    contiguous_rows: bool,
    has_w: bool,
    cast_first: bool,
    config: LaunchConfig | None,
    interpret: bool,
) -> _Plan:
    """Everything about a launch that depends only on the call's signature (cached: the eager path is host-bound)."""
    cfg = config or launch_config(h, itemsize, contiguous_rows)
    if config is None and interpret and cfg.kernel == "rows":
        # the interpreter runs programs one after another: few programs with many rows each
        cfg = LaunchConfig("rows", cfg.block, max(1, min(256, 16384 // cfg.block)), 4)
    flags = dict(HAS_W=has_w, CAST_FIRST=cast_first)
    if cfg.kernel == "unaligned":
        consts = dict(H=h, VEC=16 // itemsize, BLOCK=cfg.block, **flags)
    else:
        consts = dict(H=h, BLOCK=cfg.block, CHUNKED=cfg.block < h, **flags)
    return _Plan(cfg, config is None and not interpret, consts)


_UNALIGNED = FastLaunch(_rms_norm_unaligned)
_ROWS = FastLaunch(_rms_norm_rows)


def _launch(
    plan: _Plan,
    x2: torch.Tensor,
    w: torch.Tensor,
    y: torch.Tensor,
    rstd: torch.Tensor,
    n_rows: int,
    eps: float,
    offset: float,
) -> None:
    cfg, consts = plan.cfg, plan.consts
    if cfg.kernel == "unaligned":
        args = (x2, w, y, rstd, eps, offset)
        if plan.tuned:
            launch_tuned(_rms_norm_unaligned_tuned, lambda meta: (n_rows,), args, consts)
        else:
            _UNALIGNED((n_rows,), args, num_warps=cfg.num_warps, **consts)
    else:
        args = (x2, w, y, rstd, n_rows, x2.stride(0), consts["H"], eps, offset)
        if plan.tuned:
            launch_tuned(_rms_norm_rows_tuned, lambda meta: (cdiv(n_rows, meta["ROWS"]),), args, consts)
        else:
            _ROWS((cdiv(n_rows, cfg.rows),), args, ROWS=cfg.rows, num_warps=cfg.num_warps, **consts)


@RMS_NORM.implement(
    "triton",
    supports=_supports,
    constraints="x fp32/bf16/fp16 on GPU; last dim contiguous, leading dims collapsible to rows; any H (unaligned H "
    "uses a vector-aligned interior path; H > 32768 runs in chunks)",
)
def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    offset: float,
    cast_before_scale: bool,
    config: LaunchConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    h = x.shape[-1]
    out_dtype = torch.promote_types(x.dtype, weight.dtype) if cast_before_scale and weight is not None else x.dtype
    # every row, whichever kernel runs (and rows of no elements below)
    y = outputs.empty(x.shape, dtype=out_dtype, device=x.device)
    rstd = outputs.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    if x.numel() == 0:  # rows of width 0 have no mean square: NaN, as the reference computes it
        return y, rstd.fill_(float("nan"))
    x2 = x.view(-1, h)
    has_w = weight is not None
    contiguous_rows = x2.stride(0) == h and out_dtype == x.dtype
    plan = _plan(h, x.element_size(), contiguous_rows, has_w, cast_before_scale and has_w, config, interpreting())
    with on_device(x):
        _launch(plan, x2, weight if has_w else x2, y, rstd, x2.shape[0], eps, offset)  # x2: a placeholder, never read
    return y, rstd
