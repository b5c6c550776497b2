"""Triton MX GEMM for Hopper, registered as the ``triton`` backend of ``mx_scaled_mm``.

Hopper has no MX tensor cores, so each K step loads the MX bytes (fp8, or fp4 two per byte) and E8M0 scales of both
tiles, dequantises them in registers to bf16 (``_mx_dequant``: bit placement and two power-of-two multiplies, exact)
and feeds a bf16 ``tl.dot`` with fp32 accumulation. The weight-only form loads bf16 activations as they are. The
conversion runs on data the software pipeline (``num_stages``) already prefetched, and each weight tile is converted
once per output tile; a large ``BLOCK_K`` (128, the support boundary) amortises the scale loads.

Small M (decode, weight-only at M <= 64; weight-only MXFP4 there runs unswapped, see below) swaps the operands,
``out^T = dequant(b) @ a^T``, so that the weight tile fills the MMA's M side and the few tokens its N side, and
splits K across programs so that enough programs stream the weights (fp32 partials, summed in the kernel by each
tile's last program to finish). Result: fp32 accumulation
of the exact dequantised values, so it matches ``mx_scaled_mm_reference`` up to summation order (and underflow
below 2^-126, where bf16 keeps 7 bits).
Its bound is the decode, not bandwidth: at 16x28672x4096 (MXFP4 weights, H200, mx_gemm suite at 8182f20) it streams
62 MB of weights in 50 us of device time, 1.2 TB/s, against cuBLAS's 58 us for 4x the bytes in bf16. That is with the
fp4 pairs decoded in one word each (``dequant_fp4``'s PTX form: 56 us before; the sm90 main loop, compiled on the CPU,
630 -> 509 instructions per thread, 8 per weight element). The weight-only goal (2.5x bf16) needs a decode of about
one instruction per element (values and their bits laid out in memory so that one register's nibbles decode
together, as triton_kernels' Hopper MXFP4 path does) and the scales applied per 32-wide K slice to the MMA's partial
sums rather than to every element. ``MXMMConfig.fp4_lut`` (32-bit words of eight codes, decoded by byte tables with
one scale multiply per word) takes the swapped loop from 512 to 489 static instructions per thread and K step, 411
unswapped (``mma.sync`` at 16 rows). Timed (``benchmarks/probe_mx_weight_only.py``, H200, graph replays, 09b9f13):
unswapped with the tables 11.2 against 13.8 us at 16x4096x4096, 35.3 against 45.1 at 32x4096x14336, equal at
16x28672x4096, slower at 64 rows (and swapped with the tables 1.3-1.9x slower everywhere): ``plan`` takes it for
weight-only MXFP4 up to ``LUT_MAX_M`` rows (and the unswapped pair decode from there to 64 rows, see below). The
decode is about a third of the swapped loop; the rest is the
converted weights' trip through shared memory into the wgmma register operand (8 ``STS.128`` + 8 ``LDSM`` per K
step), operand moves, and a wait after each of its 8 small wgmmas. Triton's own ``tl.dot_scaled`` compiles to the
same shape of loop (548 instructions; 391 with ``fast_math``, which drops NaN-scale handling) and ran 1.3-2.4x slower
than ours on those shapes.
``MXMMConfig.fragment_k`` removes that round trip without a new weight layout: the swapped weight-only loop sums
each 128-wide K step in the order of wgmma's bf16 register fragment (``_fragment_k``). Lane ``c`` of a row then needs
the row's natural elements ``[32 c, 32 c + 32)``: one 16-byte load of MXFP4 (32 of fp8) and one scale, decoded in
place and renamed into the fragment; the bf16 activations are read in that order (4-byte runs, from L2). sm90 SASS
(Triton 3.6, compiled on the CPU), per thread and K step, against the same swapped plan in natural order: 374 against
393 instructions with the byte tables, 370 against 417 pairs, 312 against 389 MXFP8 (364 with 128 weight rows over
two warpgroups, each its own chain of wgmmas), no ``LDSM`` and 2 barriers instead of 11. ptxas still waits after
each of the 8 wgmmas (it gives every slice's operand the same registers). Timed (probe, H200, cd386b1): never the
fastest form; 0.98x-0.55x of the plan's on the five weight-only shapes, so no plan takes it.
The loops index K by step (``_mx_dequant.load_operand``: offsets are step times a constant, no divisions), so the
pipeliner prefetches the scale loads too. The instruction counts and timings quoted earlier in this docstring were
taken before that change, which shortened every small-M loop (the swapped byte-table loop 489 -> 393). Timed after
it (probe, H200, cd386b1, device time against cuBLAS bf16): 10.7 / 9.9 us at 16x4096x4096, 45.6 / 57.1 at
16x28672x4096, 30.9 / 34.6 at 32x4096x14336; at 64 rows unswapped now beats swapped (23.8 / 24.9 and 40.6 / 49.3 us
at 6144x4096 and 8192x8192), which ``plan`` takes.

Many rows (M >= ``PREPASS_MIN_M``, 128): the ``prepass`` plan dequantises each MX operand once into a bf16 tensor
(``_mx_dequant.dequantize``, bandwidth-bound) and runs cuBLAS's bf16 GEMM on them. Converting in the main loop costs
every output tile its own conversion of both operands (the loop reached about 300 TFLOP/s on the H200 against
cuBLAS's 800); the prepass converts each element once, at the price of one bf16 copy of each operand alive during the
call (``(M + N) * K * 2`` bytes). Same values, cuBLAS's fp32 accumulation, except the split-K reductions PyTorch lets
cuBLAS run in bf16 for a bf16 output (``allow_bf16_reduced_precision_reduction``, on by default), as in any bf16
layer; ``out_dtype=torch.float32`` keeps every sum in fp32.

Not kept: only the activations dequantised in a prepass, the weights converted in registers as the swapped MMA's
register operand (no shared-memory round trip for converted data): 1.7-2.4x slower than the prepass plan on five
shapes from M = 1024, both formats, in the best of six tile shapes (``benchmarks/probe_mx_half_prepass.py``, H200,
6c1666e); the per-tile conversion still bounds it.
Not kept: fp8 MMAs on the raw bytes per 32-wide K slice, each slice's product scaled (no conversion). On the H200 it
ran 0.35-0.45x this kernel (the per-slice scaling outweighs the MMA) and Hopper's fp8 accumulation lost about 1e-4 of
the output's range on e5m2 data (mx_gemm suite and GPU tests at befd49a).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fly_lightning.kernels import outputs
from fly_lightning.kernels.triton._fragment_k import STEP as FRAGMENT_STEP
from fly_lightning.kernels.triton._fragment_k import to_fragment_order
from fly_lightning.kernels.triton._launch import FastLaunch
from fly_lightning.kernels.triton._math import cdiv, next_pow2
from fly_lightning.kernels.triton._mx_dequant import (
    FMT_CODE,
    dequantize,
    load_operand,
    ptx_pairs,
)
from fly_lightning.kernels.triton._mx_requant import FORMATS as FP8_FORMATS
from fly_lightning.kernels.triton._mx_requant import available, requantize
from fly_lightning.kernels.triton._support import (
    ON_HIP,
    copy_reason,
    device_reason,
    interpreting,
    num_sms,
    on_device,
)
from fly_lightning.ops.mx_scaled_mm import MX_SCALED_MM

K_ALIGN = 128  # the fast kernel's K granularity (BLOCK_K); the reference takes K % 32
PREPASS_MIN_M = 128
"""Rows from which ``plan`` dequantises in a prepass and runs cuBLAS. By device time (CUDA-graph replays, H200, 4e6f598)
the prepass won from 128 rows (0.081 against 0.085 ms MXFP8, 0.074 against 0.119 MXFP4 at 128x14336x4096; 2.3x at
256x4096x4096); with host-bound eager timing the in-loop plan's one launch wins below about 1024 rows, a cost hidden
whenever the host runs ahead of the GPU, as in a training step."""
FP8_BLOCKWISE = True
"""Whether the prepass plan re-expresses MX x MX operands (e4m3 / e2m1 elements, bf16 output) for cuBLAS's blockwise
fp8 GEMM on Hopper (``_mx_requant``: exact for e2m1 groups whose scales span <= 14, else rounded within 2^-17 of the
group's largest element; the fp8 MMAs' sums promoted to fp32 every 128 K). Probe (``probe_mx_fp8_blockwise``, H100,
873ece0, the GEMMs alone): 1.16-1.26x cuBLAS bf16 on the ten mx_gemm shapes from 1024 rows, 1.48x at 256; relative
error of a bf16 output unchanged (1.66e-3), of an fp32 output 1.25e-4 MXFP8, 0 MXFP4 (so fp32 outputs keep the
bf16 prepass, which sums exactly in fp32)."""
LUT_MAX_M = 32
"""Rows up to which weight-only MXFP4 runs unswapped with the byte-table decode (``MXMMConfig.fp4_lut``)."""
FP8_CVT = "hw"
"""How ``plan`` converts fp8 elements on the GPU: "hw" (the float8 -> f16 conversion instructions) or "bits" (integer
bit placement). Both exact; "hw" measured 1.3-1.76x faster on all 17 dense MXFP8 shapes (H200, mx_gemm suite)."""


@dataclass(frozen=True)
class MXMMConfig:
    """One launch plan: tile sizes, warps, pipeline stages, ``swap`` (weights on the MMA's M side), ``split_k``;
    ``prepass``: operands dequantised to bf16 in memory, then cuBLAS (the tile fields unused)."""

    block_m: int
    block_n: int
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8
    swap: bool = False
    split_k: int = 1
    fp8_cvt: str = "bits"  # "bits": integer bit placement; "hw": float8 -> f16 conversion instructions (GPU)
    prepass: bool = False
    fp4_lut: bool = False  # MXFP4 tiles loaded as 32-bit words, decoded by byte tables (``dequant_fp4_words``; GPU)
    fragment_k: bool = False  # swapped weight-only: K permuted so decoded weights are the wgmma register fragment
    fp8_blockwise: bool = False  # prepass to e4m3 with 1x128 scales (``_mx_requant``), then cuBLAS's fp8 GEMM

    def label(self) -> str:
        if self.prepass:
            return "prepass-fp8-cublas" if self.fp8_blockwise else "prepass-cublas"
        s = f"{self.block_m}x{self.block_n}x{self.block_k}-w{self.num_warps}-s{self.num_stages}"
        s += ("-swap" if self.swap else "") + (f"-k{self.split_k}" if self.split_k > 1 else "")
        s += ("-hwcvt" if self.fp8_cvt == "hw" else "") + ("-lut" if self.fp4_lut else "")
        return s + ("-fragk" if self.fragment_k else "")


@triton.jit
def _mx_mm_kernel(
    A, A_SCALE, B, B_SCALE, OUT, PARTIAL, ARRIVED,
    M, N, K,
    stride_am, stride_asm, stride_bn, stride_bsn, stride_om, stride_split,
    A_FMT: tl.constexpr, B_FMT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SWAP: tl.constexpr, SPLIT_K: tl.constexpr, INTERPRET: tl.constexpr, HW_CVT: tl.constexpr,
    PTX: tl.constexpr = False, LUT: tl.constexpr = False, FRAG_K: tl.constexpr = False,
):  # fmt: skip
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # grouped order: GROUP_M row tiles share each weight column tile while it is in L2
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group
    pid_n = (pid % per_group) // group
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # rows past the end re-read valid rows (wrapped) so that loads need no mask; their results are not stored
    am = (rm % M).to(tl.int64)
    bn = (rn % N).to(tl.int64)
    a_rows, as_rows = A + (am * stride_am)[:, None], A_SCALE + (am * stride_asm)[:, None]
    b_rows, bs_rows = B + (bn * stride_bn)[:, None], B_SCALE + (bn * stride_bsn)[:, None]
    k_steps = K // (SPLIT_K * BLOCK_K)  # K is a multiple of BLOCK_K * SPLIT_K (the launcher's check)
    k_lo = tl.program_id(1) * k_steps
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(k_lo, k_lo + k_steps):
        b = load_operand(b_rows, bs_rows, kk, B_FMT, BLOCK_K, INTERPRET, HW_CVT, PTX, LUT)
        if FRAG_K:  # weight-only, swapped: a sum over K in another order, the decoded weights left where they are
            tl.static_assert(SWAP and A_FMT == 0 and BLOCK_K == 128)
            b = to_fragment_order(b)
        a = load_operand(a_rows, as_rows, kk, A_FMT, BLOCK_K, INTERPRET, HW_CVT, PTX, LUT, FRAG_K)
        if SWAP:
            acc = tl.dot(b, tl.trans(a), acc)
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    if SWAP:
        acc = tl.trans(acc)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    ptrs = OUT + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    if SPLIT_K == 1:
        tl.store(ptrs, acc.to(OUT.dtype.element_ty), mask=mask)
    else:
        # split K: each program stores its fp32 partial; the tile's last program to arrive sums all of them in split
        # order (the same sums whichever arrives last) and writes the output: no reduction launches after the GEMM
        tile = rm.to(tl.int64)[:, None] * N + rn[None, :]
        split_stride = stride_split.to(tl.int64)
        tl.store(PARTIAL + tl.program_id(1) * split_stride + tile, acc, mask=mask)
        # one thread runs the scalar atomic: the barrier orders every thread's partial before it (Triton 3.9 emits
        # one there, 3.6 does not), and acq_rel the partials of the programs before the last one's reads
        tl.debug_barrier()
        if tl.atomic_add(ARRIVED + pid, 1, sem="acq_rel") == SPLIT_K - 1:
            total = tl.zeros_like(acc)
            for s in range(SPLIT_K):
                total += tl.load(PARTIAL + s * split_stride + tile, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(ptrs, total.to(OUT.dtype.element_ty), mask=mask)


def plan(
    m: int,
    n: int,
    k: int,
    a_fmt: str | None,
    b_fmt: str,
    device: torch.device,
    sms: int | None = None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    fp8_gemm: bool | None = None,
) -> MXMMConfig:
    """The launch plan for a shape: swapped, K-split tiles for few rows, a prepass from ``PREPASS_MIN_M`` rows, 64x128
    in-loop tiles between (``sms``: the GPU's multiprocessors, read from ``device`` when not given). The prepass
    re-expresses MX x MX operands for cuBLAS's blockwise fp8 GEMM where ``fp8_gemm`` (``_mx_requant.available``,
    read from ``device`` when None) and ``FP8_BLOCKWISE`` allow, else dequantises to bf16. Cached: it runs on every
    call."""
    interp = device.type == "cpu" and interpreting()  # env read last
    fp8 = (
        m >= PREPASS_MIN_M
        and FP8_BLOCKWISE
        and out_dtype == torch.bfloat16
        and a_fmt in FP8_FORMATS
        and b_fmt in FP8_FORMATS
        and n % 16 == 0
        and (available(device) if fp8_gemm is None else fp8_gemm)
    )
    return _plan(m, n, k, a_fmt, b_fmt, device, sms, interp, fp8)


@functools.lru_cache(maxsize=4096)
def _plan(
    m: int, n: int, k: int, a_fmt: str | None, b_fmt: str, device: torch.device, sms: int | None, interp: bool,
    fp8: bool,
) -> MXMMConfig:  # fmt: skip
    if interp:  # the interpreter's cost is per program: few, small programs
        return MXMMConfig(min(64, max(16, next_pow2(m))), 64, K_ALIGN, swap=m <= 64)
    if m <= 64:
        bm = max(16, next_pow2(m))
        bn = 64
        tiles = cdiv(n, bn)
        if not sms:
            cuda = device.type == "cuda"
            sms = num_sms(torch.cuda.current_device() if device.index is None else device.index) if cuda else 1
        split = 1
        # split K until the weights are streamed by about two waves of programs, each keeping >= 4 K steps
        while tiles * split * 2 <= 2 * sms and k % (K_ALIGN * split * 2) == 0 and k // (split * 2) >= 4 * K_ALIGN:
            split *= 2
        # weight-only MXFP4: tokens on the MMA's M side (mma.sync), not swapped: at <= 32 rows with the byte-table
        # decode, 1.0-1.28x faster by device time than the swapped plan (probe_mx_weight_only, H200, 09b9f13); at 64
        # rows with the pair decode, 1.05x / 1.21x on 6144x4096 / 8192x8192 (the same probe, H200, cd386b1: the
        # byte tables there 1.0x / 1.16x)
        w4 = a_fmt is None and b_fmt == "mxfp4_e2m1"
        lut = w4 and m <= LUT_MAX_M
        return MXMMConfig(
            bm, bn, K_ALIGN, num_warps=4, num_stages=4, swap=not w4, split_k=split, fp8_cvt=FP8_CVT, fp4_lut=lut
        )
    if m >= PREPASS_MIN_M:
        return MXMMConfig(128, 256, K_ALIGN, 8, 3, fp8_cvt=FP8_CVT, prepass=True, fp8_blockwise=fp8)
    # in-loop, wide tiles (128x256 w8 s3: 1.24-1.33x faster than 128x128 at M >= 1024 before the prepass replaced it)
    # stay for explicit configs: the mx_gemm suite's plan scan and the sm90 compile check
    return MXMMConfig(64, 128, K_ALIGN, num_warps=4, num_stages=4, fp8_cvt=FP8_CVT)


def _copy_reason(name: str, t: torch.Tensor) -> str | None:
    return copy_reason(name, t) if t.shape[1] > 1 and t.stride(1) != 1 else None


def _supports(a, a_scale, a_fmt, b, b_scale, b_fmt, out_dtype) -> bool | str:
    if (reason := device_reason(a, a_scale, b, b_scale)) is not None:
        return reason
    if ON_HIP:
        # it builds for gfx950, but with SGPR spills in the wide plan (checked 2026-12-03): not compile-clean there
        return "ROCm (plans tuned for Hopper; gfx950 builds spill SGPRs, and gfx950 has MX MFMAs of its own)"
    if a.is_cuda and torch.cuda.get_device_capability(a.device) < (9, 0):
        return "GPU older than sm90 (bf16 multiplies and wgmma; tested on sm90)"
    if a_fmt is None and a.dtype != torch.bfloat16:
        return f"{a.dtype} activations (the kernel feeds bf16 MMAs; fp32 a runs on ATen)"
    k = b_scale.shape[1] * 32
    if k % K_ALIGN:
        return f"K={k} not a multiple of {K_ALIGN} (the kernel's BLOCK_K)"
    for name, t in (("a", a), ("a_scale", a_scale), ("b", b), ("b_scale", b_scale)):
        if t is not None and (reason := _copy_reason(name, t)) is not None:
            return reason
    return True


_MX_MM = FastLaunch(_mx_mm_kernel)


def launch(a, a_scale, a_fmt, b, b_scale, b_fmt, out_dtype, config: MXMMConfig | None = None) -> torch.Tensor:
    m, n = a.shape[0], b.shape[0]
    k = b_scale.shape[1] * 32
    cfg = config or plan(m, n, k, a_fmt, b_fmt, a.device, out_dtype=out_dtype)
    if cfg.fp8_blockwise and not (
        cfg.prepass and a_fmt in FP8_FORMATS and b_fmt in FP8_FORMATS and out_dtype == torch.bfloat16 and n % 16 == 0
    ):
        raise ValueError(f"mx_scaled_mm: {cfg} takes {FP8_FORMATS} operands, N % 16 and a bf16 output")
    if k % (cfg.block_k * cfg.split_k):
        raise ValueError(f"mx_scaled_mm: K={k} is not a multiple of block_k * split_k in {cfg}")
    if cfg.fragment_k and not (cfg.swap and a_fmt is None and cfg.block_k == FRAGMENT_STEP and not cfg.prepass):
        raise ValueError(f"mx_scaled_mm: fragment_k is for swapped weight-only plans, block_k {FRAGMENT_STEP}: {cfg}")
    if cfg.swap and not cfg.prepass and "mxfp4_e2m1" in (a_fmt, b_fmt) and cfg.block_k != K_ALIGN:
        # plan() never emits it; an explicit 128x128x64 swapped plan (8 warps, 4 stages) gave wrong results on the H200
        raise ValueError(f"mx_scaled_mm: swapped MXFP4 plans need block_k {K_ALIGN} (others are untrusted): {cfg}")
    interp = a.device.type == "cpu" and interpreting()
    lut = cfg.fp4_lut and not interp and ptx_pairs(a)  # inline PTX: NVIDIA only
    if lut and any(
        t.data_ptr() % 4 or t.stride(0) % 4 for t, f in ((a, a_fmt), (b, b_fmt)) if f == "mxfp4_e2m1"
    ):  # fmt: skip
        if config is not None:
            raise ValueError(f"mx_scaled_mm: {cfg} loads MXFP4 rows as 32-bit words: rows and data 4-byte aligned")
        lut = False  # the plan's pick on unaligned rows: the pair decode, same tiles
    if m == 0 or n == 0 or k == 0:
        return torch.zeros(m, n, dtype=out_dtype, device=a.device)
    if cfg.fp8_blockwise:
        qa, sa, qb, sb = requantize(a, a_scale, a_fmt, b, b_scale, b_fmt)
        return torch._scaled_mm(qa, qb.t(), sa, sb, out_dtype=out_dtype)
    if cfg.prepass:
        return _prepass_mm(a, a_scale, a_fmt, b, b_scale, b_fmt, out_dtype)
    split = cfg.split_k
    out = outputs.empty(m, n, dtype=out_dtype, device=a.device)
    tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    if split == 1:
        partial = arrived = out  # unused
    else:  # fp32 partials, and per output tile the count of its programs done (zeroed per call: no shared state)
        partial = outputs.empty(split, m, n, dtype=torch.float32, device=a.device)
        arrived = torch.zeros(tiles, dtype=torch.int32, device=a.device)
    a_arg = a if a_fmt is None else a.view(torch.uint8)  # float8 / e8m0 tensors cannot be kernel arguments
    a_s = (b_scale if a_scale is None else a_scale).view(torch.uint8)  # b's scales: a placeholder for bf16 a
    with on_device(a):
        _MX_MM(
            (tiles, split),
            (a_arg, a_s, b.view(torch.uint8), b_scale.view(torch.uint8), out, partial, arrived, m, n, k,
             a.stride(0), a_s.stride(0), b.stride(0), b_scale.stride(0), n, m * n),
            A_FMT=FMT_CODE[a_fmt], B_FMT=FMT_CODE[b_fmt], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, SWAP=cfg.swap, SPLIT_K=split,
            INTERPRET=interp, HW_CVT=cfg.fp8_cvt == "hw", PTX=ptx_pairs(a), LUT=lut, FRAG_K=cfg.fragment_k,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    return out


def _prepass_mm(a, a_scale, a_fmt, b, b_scale, b_fmt, out_dtype) -> torch.Tensor:
    """Both operands dequantised in memory, then one GEMM (cuBLAS on the GPU; fp32 under the interpreter)."""
    if a_fmt is None:
        a_hp, b_hp = a, dequantize(b, b_scale, b_fmt)
    else:
        a_hp, b_hp = dequantize(a, a_scale, a_fmt, b, b_scale, b_fmt)  # one launch for both
    if b_hp.dtype == torch.float32:  # the interpreter's fp32 values: an fp32 GEMM, one rounding
        return torch.mm(a_hp.float(), b_hp.t()).to(out_dtype)
    if out_dtype == torch.bfloat16:
        return torch.mm(a_hp, b_hp.t())
    # cuBLAS's fp32 accumulator, rounded once to out_dtype (not through bf16)
    return torch.mm(a_hp, b_hp.t(), out_dtype=torch.float32).to(out_dtype)


@MX_SCALED_MM.implement(
    "triton",
    supports=_supports,
    constraints="sm90+ (CUDA; ROCm on ATen); "
    "MX x MX (e4m3, e5m2, e2m1; formats may differ), bf16 x MX (weight-only); "
    "K % 128; last dims (data and scales) contiguous, any row stride; tiles dequantised to bf16 in registers, "
    "bf16 MMAs with fp32 accumulation; few rows: K split, operands swapped (weight-only MXFP4 up to 64 rows: not "
    "swapped; up to 32, fp4 decoded from 32-bit words where rows are 4-byte aligned); M >= 128: dequantised to bf16 "
    "in a prepass (a bf16 copy of each operand during the call), then cuBLAS",
)
def mx_scaled_mm_triton(a, a_scale, a_fmt, b, b_scale, b_fmt, out_dtype) -> torch.Tensor:
    return launch(a, a_scale, a_fmt, b, b_scale, b_fmt, out_dtype)
