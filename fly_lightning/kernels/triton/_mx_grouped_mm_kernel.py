"""Triton MX grouped GEMM (Hopper: no MX tensor cores): the kernel, its configurations and its launcher.

Design:
- Tile schedule as the bf16 grouped GEMM's ``scan`` schedule (``_grouped_mm_kernel``): the grid depends on shapes only,
  every program reads the int32 end offsets on the device, counts the tiles and walks its tiles ``pid, pid + P, ...``
  with a group cursor (``_advance``); within a group, tiles in bands of ``GROUP_M`` row tiles (``_band_swizzle``). No
  host sync: CUDA graphs and ``torch.compile`` see a fixed launch. Offsets are clamped on the device.
- Operands stay MX in memory (1 or 1/2 byte per element plus 1/32 byte of scale) and are dequantised in registers,
  one ``BLOCK_K`` slab at a time, by the shared helpers of ``_mx_dequant`` (bit placement and power-of-two multiplies:
  exact in bf16), then a bf16 ``tl.dot`` with fp32 accumulation. High-precision activations (weight-only) are read as
  they are (fp32 rounded to bf16, as the ATen path does).
- The weights are ``[E, N, K / per_byte]``: each output column's K run is contiguous, read as ``[BLOCK_N, BLOCK_K]``
  and transposed for the dot. Rows of a tile past its group's end read row 0 (in bounds) and are never stored.
- ``BLOCK_K`` divides K (the support predicate asks K % 128 == 0), so the K loop has no masks.
- MX activations on Hopper below ``SWAP_WIDE_MAX_ROWS`` rows per group take swapped tiles: x
  dequantised to bf16 in memory (stored in the swapped tiles' K order), the weights converted in registers as the
  MMA's register operand. From that many rows, and on other GPUs from ``PREPASS_MIN_ROWS``, both operands are
  dequantised once into bf16 tensors (``_prepass``) and the bf16 grouped GEMM runs on them (each element converted
  once, not once per tile); the weights of groups without rows are skipped there (mx_grouped_mm suite, H100,
  87d5121: 1.21-1.22x faster with half or all but one of the groups empty, 1.08x with a quarter). Weight-only never
  does: frozen MX experts exist to save memory, and that would hold all groups in bf16.
- The interpreter's bf16 ``tl.dot`` and bf16 arithmetic are wrong: there the operands are dequantised to fp32 and
  stay fp32 (``UPCAST``).
- Swapped tiles (configuration flags): ``swap`` puts the weights on the MMA's M side, as its register operand;
  ``fragment_k`` sums K in that operand's fragment order (``_fragment_k``), so each lane decodes one natural run of 32
  values and feeds it as it is (sm90 SASS, Triton 3.6: K loop 427 -> 384 instructions MXFP4, 372 -> 322 MXFP8,
  nothing stored to shared memory); ``x_prepass`` dequantises MX activations to bf16 first (a copy of x only), which
  ``fragment_k`` needs, and stores it in that K order: read as it is, x takes 16-byte loads instead of the
  fragment order's 4-byte gathers (256x128 tiles: 1.74-1.88x faster, ``probe_mx_swap_tiles``, H100). ``SWAPPED`` (64-row
  tiles) for groups of few rows, where each weight tile feeds one or two row tiles (mx_grouped_mm suite, H100,
  bf76cf0: 0.325 / 0.298 ms MXFP8 / MXFP4 against the bf16 grouped GEMM's 0.383 at 64 rows per group: fewer bytes
  than bf16 weights), MXFP8 weights through 96 rows; ``SWAPPED_MID`` (128-row tiles) above that, MXFP4 weights
  from 65 rows; ``SWAPPED_WIDE`` (256 rows x 128 weights) from 256. Weight-only swapped tiles are untimed: not planned.
- fp8 MMAs (e4m3 / e2m1 re-expressed with one scale per 128 along K, then an fp8 grouped kernel) were planned at
  256-1023 rows per group until ``SWAPPED_WIDE`` took that band: faster there, and exact where that form rounded small
  blocks to within 2^-17 of a 128-group's largest element (removed; its kernel and probe are in git history).
- Not taken: warp specialisation, converter warps filling bf16 weight tiles in shared memory for wgmma warps, written
  in Gluon (``benchmarks/probe_mx_ws_gluon``, H100, at 512-2048 rows per group): 0.63-0.72x our bf16 grouped GEMM
  where these plans ran 0.63-0.82x; with the conversion left out, its pipeline alone ran 0.72-0.87x.
- Not taken: the prepass's weight conversion on a second stream, chunk by chunk of experts, beside the GEMM of the
  previous chunk (``benchmarks/probe_mx_prepass_overlap``, H200, from 1024 rows per group): -1.5% to +3.3%, about
  the chunking's own spread (the persistent GEMM holds every SM).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fly_lightning.kernels.triton import _grouped_mm_kernel as gk
from fly_lightning.kernels.triton._fragment_k import STEP as FRAGMENT_STEP
from fly_lightning.kernels.triton._fragment_k import to_fragment_order
from fly_lightning.kernels.triton._grouped_mm_kernel import _advance, _band_swizzle, _scan_start
from fly_lightning.kernels.triton._launch import FastLaunch
from fly_lightning.kernels.triton._math import cdiv, next_pow2
from fly_lightning.kernels.triton._mx_dequant import FMT_CODE, dequantize, hopper, load_operand, ptx_pairs
from fly_lightning.kernels.triton._support import num_sms, on_device
from fly_lightning.quant import formats


@triton.jit
def _k_step(
    acc, x_rows, xs_rows, w_rows, ws_rows, kk,
    X_FMT: tl.constexpr, W_FMT: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, PTX: tl.constexpr,
    SWAP: tl.constexpr, FRAG_K: tl.constexpr, X_FRAG: tl.constexpr,
):  # fmt: skip
    """One K slab into ``acc``: ``[rows, cols]``, or ``[cols, rows]`` when ``SWAP`` (weights on the MMA's M side,
    as its register operand; with ``FRAG_K`` in the register fragment's K order, decoded in place; ``X_FRAG``: x
    already stored in that order, read with contiguous loads)."""
    # the hardware float8 -> f16 conversion on the GPU (1.3-1.76x faster in the dense MX GEMM)
    a = load_operand(x_rows, xs_rows, kk, X_FMT, BLOCK_K, UPCAST, not UPCAST, FRAG_K=FRAG_K and not X_FRAG)
    # pairwise fp4 weights (dequant_fp4's PTX) but not beside fp4 activations: 16 bytes of spills there
    b = load_operand(w_rows, ws_rows, kk, W_FMT, BLOCK_K, UPCAST, not UPCAST, PTX=PTX and X_FMT != 3)
    if FRAG_K:
        tl.static_assert(SWAP and X_FMT == 0)
        b = to_fragment_order(b)
    if SWAP:
        acc = tl.dot(b, tl.trans(a), acc)
    else:
        acc = tl.dot(a, tl.trans(b), acc)
    return acc


# fmt: off
@triton.jit
def _mx_tile(
    tile, g, g_first, g_start, g_size, X, XS, W, WS, OUT, N,
    stride_xm, stride_xsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om, num_n, k_tiles,
    X_FMT: tl.constexpr, W_FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, INTERPRET: tl.constexpr, PTX: tl.constexpr, SWAP: tl.constexpr,
    FRAG_K: tl.constexpr, X_FRAG: tl.constexpr,
):
    """Compute and store output tile ``tile`` (of group g, whose rows are [g_start, g_start + g_size))."""
    pid_m, pid_n = _band_swizzle(tile - g_first, tl.cdiv(g_size, BLOCK_M), num_n, GROUP_M)
    rows = g_start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < g_start + g_size
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    src = tl.where(row_ok, rows, 0).to(tl.int64)  # in bounds: such rows are read, never stored
    col = tl.where(col_ok, cols, 0).to(tl.int64)
    x_rows = X + src[:, None] * stride_xm
    xs_rows = XS + src[:, None] * stride_xsm
    g64 = g.to(tl.int64)
    w_rows = W + g64 * stride_we + col[:, None] * stride_wn
    ws_rows = WS + g64 * stride_wse + col[:, None] * stride_wsn

    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if INTERPRET:  # the interpreter cannot range over a device value
        kk = 0
        while kk < k_tiles:
            acc = _k_step(acc, x_rows, xs_rows, w_rows, ws_rows, kk, X_FMT, W_FMT, BLOCK_K, UPCAST, PTX, SWAP, FRAG_K,
                          X_FRAG)
            kk += 1
    else:
        for kk in range(0, k_tiles):
            acc = _k_step(acc, x_rows, xs_rows, w_rows, ws_rows, kk, X_FMT, W_FMT, BLOCK_K, UPCAST, PTX, SWAP, FRAG_K,
                          X_FRAG)
    if SWAP:
        acc = tl.trans(acc)
    o_ptrs = OUT + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(o_ptrs, acc.to(OUT.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _mx_grouped_mm_kernel(
    X, XS, W, WS, OUT, OFFS, M, N, K, E,
    stride_xm, stride_xsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om, NUM_PROGS,
    X_FMT: tl.constexpr, W_FMT: tl.constexpr, E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr, INTERPRET: tl.constexpr, PTX: tl.constexpr = False, SWAP: tl.constexpr = False,
    FRAG_K: tl.constexpr = False, X_FRAG: tl.constexpr = False,
):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    k_tiles = K // BLOCK_K
    total, g, g_first, g_start, g_end, g_size, g_tiles = _scan_start(pid, OFFS, M, E, num_n, BLOCK_M, E_POW2)
    if INTERPRET:
        tile = pid
        while tile < total:
            g, g_first, g_start, g_end, g_size, g_tiles = _advance(
                tile, g, g_first, g_start, g_end, g_size, g_tiles, OFFS, M, E, num_n, BLOCK_M)
            _mx_tile(tile, g, g_first, g_start, g_size, X, XS, W, WS, OUT, N,
                     stride_xm, stride_xsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om, num_n, k_tiles,
                     X_FMT, W_FMT, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, UPCAST, INTERPRET, PTX, SWAP, FRAG_K, X_FRAG)
            tile += NUM_PROGS
    else:
        for tile in range(pid, total, NUM_PROGS):
            g, g_first, g_start, g_end, g_size, g_tiles = _advance(
                tile, g, g_first, g_start, g_end, g_size, g_tiles, OFFS, M, E, num_n, BLOCK_M)
            _mx_tile(tile, g, g_first, g_start, g_size, X, XS, W, WS, OUT, N,
                     stride_xm, stride_xsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om, num_n, k_tiles,
                     X_FMT, W_FMT, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, UPCAST, INTERPRET, PTX, SWAP, FRAG_K, X_FRAG)
# fmt: on


@dataclass(frozen=True)
class MXGroupedMMConfig:
    """One launch configuration. ``block_k`` must divide K (the launcher checks); ``programs_per_sm = 0`` launches
    one program per tile of the host-side upper bound ``(cdiv(M, block_m) + E) x cdiv(N, block_n)``."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 128
    group_m: int = 8
    num_stages: int = 3
    num_warps: int = 8
    programs_per_sm: int = 1
    prepass: bool = False  # operands dequantised to bf16 in memory, then the bf16 grouped GEMM (tile fields unused)
    swap: bool = False  # weights on the MMA's M side (its register operand), the group's rows on its N side
    fragment_k: bool = False  # swapped, high-precision x: K in the register fragment's order (``_fragment_k``)
    x_prepass: bool = False  # MX x dequantised to bf16 in memory first (small), then the high-precision x kernel

    def label(self) -> str:
        if self.prepass:
            return "prepass-bf16-grouped"
        persist = f"p{self.programs_per_sm}" if self.programs_per_sm else "np"
        flags = ("_swap" if self.swap else "") + ("_fragk" if self.fragment_k else "")
        return (
            ("xprepass_" if self.x_prepass else "")
            + f"{self.block_m}x{self.block_n}x{self.block_k}_g{self.group_m}_s{self.num_stages}_w{self.num_warps}"
            + f"_{persist}{flags}"
        )


# Hopper. From one sweep on the H200 (Triton 3.6; Qwen3-30B-A3B gate/up, Mixtral-8x7B down, OLMoE down with one expert
# taking every row: 512 to 16384 rows per expert), TFLOP/s of the best configuration against 128x128x128 s3 w8:
# MXFP8 x MXFP8 128x256x64 s3 171-175 (130), MXFP4 x MXFP4 128x256x128 s2 271-288, bf16 x MX (weight-only)
# 256x128x64 s3 304-323 (fp8) and 391-401 (fp4). ptxas spills 8 bytes in the first two (e4m3 and e2m1, bf16 output),
# which the sweep timed anyway. Groups of fewer than 96 rows: a 64-row tile.
SMALL_GROUPS = MXGroupedMMConfig(64, 128, 64, 8, 4, 4)
MX_MX = MXGroupedMMConfig(128, 256, 64, 8, 3, 8)
MXFP4_MXFP4 = MXGroupedMMConfig(128, 256, 128, 8, 2, 8)
WEIGHT_ONLY = MXGroupedMMConfig(256, 128, 64, 8, 3, 8)
# Many rows per group: each weight element feeds >= 256 rows, so dequantising it once in memory (3 bytes of traffic
# for fp8) costs less than converting it in every row tile's main loop; the bf16 grouped GEMM then runs at its rate.
PREPASS_MIN_ROWS = 256
PREPASS = MXGroupedMMConfig(prepass=True)
SWAP_MAX_ROWS = 64
SWAPPED = MXGroupedMMConfig(64, 128, 128, 8, 3, 8, swap=True, fragment_k=True, x_prepass=True)
# 65 to 255 rows per group. mx_grouped_mm suite, H100, bf76cf0, 128 rows per group (128 experts, K 2048, N 1536):
# SWAPPED_MID 0.321 / 0.290 ms MXFP8 / MXFP4 against the in-loop plan's 0.441 / 0.417 (bf16 grouped GEMM 0.324); at
# 256 rows 0.379 / 0.359 against SWAPPED_WIDE's 0.306 / 0.308. ``probe_mx_swap_tiles --band`` (H100, 0285c85, same
# K and N, device time, x the bf16 grouped GEMM for in-loop 64-row tiles / SWAPPED / SWAPPED_MID): MXFP8 at 72-96 rows
# 0.34-0.40 / 0.78-0.82 / 0.57-0.68, at 128 0.33 / 0.80 / 1.04; MXFP4 at 72-96 0.45-0.48 / 0.78-0.81 / 1.00-1.11, at
# 128 0.45 / 0.80 / 1.16. Hence MXFP8 weights keep SWAPPED through this many rows, MXFP4 weights take SWAPPED_MID
# from SWAP_MAX_ROWS + 1 (their 128-row tiles decode half the bytes per weight).
SWAP_FP8_MAX_ROWS = 96
SWAPPED_MID = MXGroupedMMConfig(128, 128, 128, 8, 3, 8, swap=True, fragment_k=True, x_prepass=True)
# 256 rows x 128 weights, 3 stages: 249 registers, 224 KB of shared memory, no spills (sm90)
SWAPPED_WIDE = MXGroupedMMConfig(256, 128, 128, 8, 3, 8, swap=True, fragment_k=True, x_prepass=True)
SWAP_WIDE_MAX_ROWS = 1024
"""MX x on Hopper takes ``SWAPPED_WIDE`` from ``PREPASS_MIN_ROWS`` up to (not including) this many rows per group, the
bf16 prepass from here. The swapped kernel converts each weight tile once per 256 rows; the prepass converts each
weight once but writes and rereads a bf16 copy. ``probe_mx_swap_tiles`` (H100, Triton 3.6, device time: the kernel
on fragment-ordered bf16 x plus x's dequantisation, timed apart), in ms against the plan then taken (fp8 below 1024
rows, else the prepass), MXFP8 then MXFP4: 256 rows per group (64 experts) 0.30 / 0.30 against 0.46 / 0.42; 512
(32 experts) 0.56 / 0.56 against 0.68 / 0.64, (Qwen3-30B-A3B gate/up) 0.97 / 0.96 against 1.09 / 1.01; 1024 (OLMoE
gate/up) 1.26 / 1.25 against 1.22 / 1.13, (DeepSeek-V3 down) 1.87 / 1.88 against 1.87 / 1.74; 4096 2.16 / 2.12
against 1.76 / 1.66. The mx_grouped_mm suite (H100, bf76cf0, event-timed, the prepass beside it): 0.306 / 0.308
against 0.557 / 0.513 at 256 rows; 0.560 / 0.573 against 0.733 / 0.687 at 512 (32 experts), 0.927 / 0.946 against
1.139 / 1.056 (Qwen3-30B-A3B gate/up), 0.565 / 0.557 against 0.630 / 0.591 (its down, K 768); at 1000 rows (16
experts) 0.399 / 0.407 against 0.394 / 0.375: the band ends about there."""
# The interpreter runs programs one after another: small tiles, few programs (still several tiles each).
INTERPRETER_CONFIG = MXGroupedMMConfig(32, 32, 64, 2, 1, 4)
INTERPRETER_PROGRAMS = 3


def choose_config(
    m: int, e: int, on_cpu: bool, x_fmt: str | None = None, w_fmt: str = "", sm90: bool = False
) -> MXGroupedMMConfig:
    """The table's configuration for ``m`` rows over ``e`` groups and the operands' formats (``sm90``: the GPU is a
    Hopper, whose wgmma register fragment the swapped tiles are laid out for and where they were timed)."""
    if on_cpu:
        return INTERPRETER_CONFIG
    rows = m / max(1, e)
    # not weight-only: its frozen MX experts exist to save memory, and the prepass holds every group's weights in bf16;
    # swapped tiles dequantise x first, so weight-only never takes them either (untimed)
    if x_fmt is not None and sm90:
        if rows <= (SWAP_MAX_ROWS if w_fmt == "mxfp4_e2m1" else SWAP_FP8_MAX_ROWS):
            return SWAPPED
        if rows < PREPASS_MIN_ROWS:
            return SWAPPED_MID
        if PREPASS_MIN_ROWS <= rows < SWAP_WIDE_MAX_ROWS:
            return SWAPPED_WIDE
    if x_fmt is not None and rows >= PREPASS_MIN_ROWS:
        return PREPASS
    return loop_config(m, e, x_fmt, w_fmt)


def loop_config(m: int, e: int, x_fmt: str | None = None, w_fmt: str = "") -> MXGroupedMMConfig:
    """The table's in-loop configuration (tiles converted in the main loop; no prepass) on the GPU."""
    rows = m / max(1, e)
    if rows < 96:
        return SMALL_GROUPS
    if x_fmt is None:
        return WEIGHT_ONLY if rows >= 256 else MX_MX  # a 256-row tile wastes much of a smaller group
    if x_fmt == w_fmt == "mxfp4_e2m1":
        return MXFP4_MXFP4
    return MX_MX


def _bytes(t: torch.Tensor | None) -> torch.Tensor | None:
    """fp8 / E8M0 tensors as uint8 (torch's float8 dtypes cannot be passed to a kernel)."""
    return None if t is None else t.view(torch.uint8)


_MX_GROUPED = FastLaunch(_mx_grouped_mm_kernel)


def launch(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    x_fmt: str | None,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    w_fmt: str,
    offs: torch.Tensor,
    out: torch.Tensor,
    config: MXGroupedMMConfig | None = None,
) -> torch.Tensor:
    """``out[rows of e] = dequant(x)[rows of e] @ dequant(w[e]).T`` per group; rows past ``offs[-1]`` untouched.

    ``x`` ``[M, K]`` (MX bytes with ``x_scale`` ``[M, K / 32]``, or bf16/fp32), ``w`` ``[E, N, K / per_byte]`` with
    ``w_scale`` ``[E, N, K / 32]``; the last dim of every operand contiguous; ``config.block_k`` must divide K."""
    e, n = w.shape[0], w.shape[1]
    m, k = x.shape[0], w_scale.shape[2] * formats.BLOCK
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()  # rows past the last offset too: the product over an empty K is zero everywhere
    interp = x.device.type == "cpu"
    cfg = config or choose_config(m, e, interp, x_fmt, w_fmt, hopper(x))
    if cfg.prepass:
        return _prepass(x, x_scale, x_fmt, w, w_scale, w_fmt, offs, out)
    if k % cfg.block_k:
        raise ValueError(f"mx_grouped_mm kernel: block_k={cfg.block_k} does not divide K={k}")
    if cfg.x_prepass and x_fmt is None:
        raise ValueError(f"mx_grouped_mm kernel: x_prepass needs MX x: {cfg}")
    if cfg.fragment_k and not (cfg.swap and cfg.block_k == FRAGMENT_STEP and (x_fmt is None or cfg.x_prepass)):
        raise ValueError(f"mx_grouped_mm kernel: fragment_k is for swapped tiles, block_k {FRAGMENT_STEP}, "
                         f"high-precision x (or x_prepass): {cfg}")  # fmt: skip
    # only x in memory as bf16 (fp32 when interpreting), in the K order the swapped tiles sum (contiguous loads
    # there); the weights stay MX
    x_frag = cfg.x_prepass and cfg.fragment_k
    if cfg.x_prepass:
        x, x_scale, x_fmt = dequantize(x, x_scale, x_fmt, fragment_order=x_frag), None, None
    upper = (cdiv(m, cfg.block_m) + e) * cdiv(n, cfg.block_n)
    if interp:
        progs = min(INTERPRETER_PROGRAMS, upper)
    elif cfg.programs_per_sm:
        progs = min(cfg.programs_per_sm * num_sms(x.device.index or 0), upper)
    else:
        progs = upper
    xs = _bytes(x_scale) if x_scale is not None else x  # placeholder pointer, never read for high precision x
    xb = x if x_fmt is None else _bytes(x)
    with on_device(x):
        _MX_GROUPED(
            (progs,),
            (xb, xs, _bytes(w), _bytes(w_scale), out, offs, m, n, k, e,
             x.stride(0), xs.stride(0), w.stride(0), w.stride(1), w_scale.stride(0), w_scale.stride(1), out.stride(0),
             progs),
            X_FMT=FMT_CODE[x_fmt], W_FMT=FMT_CODE[w_fmt], E_POW2=max(1024, next_pow2(e)),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            UPCAST=interp, INTERPRET=interp, PTX=ptx_pairs(x), SWAP=cfg.swap, FRAG_K=cfg.fragment_k, X_FRAG=x_frag,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    return out


def _rows_of_groups(w, w_scale, offs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The weights and their scales as ``[E * N, ...]`` rows for the conversion passes, and the offsets that let them
    skip the rows of groups without rows (None without groups)."""
    e, n = w.shape[0], w.shape[1]
    return w.reshape(e * n, w.shape[2]), w_scale.reshape(e * n, w_scale.shape[2]), offs if e else None


def _prepass(x, x_scale, x_fmt, w, w_scale, w_fmt, offs, out) -> torch.Tensor:
    """Both operands dequantised to bf16 in memory (``_mx_dequant.dequantize``; weights of empty groups skipped),
    then the bf16 grouped GEMM on them. Alive during the call: a bf16 copy of x and of every group's weights."""
    e, n = w.shape[0], w.shape[1]
    w2, ws2, skip = _rows_of_groups(w, w_scale, offs)
    if x_fmt is None:
        xb, wb = x.to(torch.bfloat16), dequantize(w2, ws2, w_fmt)
    else:
        # one launch for both; weights of groups without rows are skipped (the GEMM never reads them)
        xb, wb = dequantize(x, x_scale, x_fmt, w2, ws2, w_fmt, offs=skip)
    # the interpreter's fp32 values to bf16: exact, they came from bf16-representable MX values
    xb, wb = xb.to(torch.bfloat16), wb.to(torch.bfloat16).view(e, n, -1)
    return gk.launch(xb, wb.transpose(1, 2), offs, out)
