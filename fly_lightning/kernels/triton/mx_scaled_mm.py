"""Triton MX GEMM for Hopper, registered as the ``triton`` backend of ``mx_scaled_mm``. Hopper has fp8 tensor cores
but no MX ones; ``plan`` picks one of three forms by rows (history and timings of forms not kept: git log).

- Many rows (M >= ``PREPASS_MIN_M``), MX x MX with e4m3 / e2m1 elements and a bf16 output (``FP8_BLOCKWISE``): both
  operands re-expressed as e4m3 with one fp32 power-of-two scale per 128 values along K (``_mx_requant``, one
  launch), then cuBLAS's blockwise fp8 GEMM (``torch._scaled_mm``, 1x128 x 1x128). A precision change, bounded and
  measured: see ``FP8_BLOCKWISE``. Otherwise (e5m2, fp32 or fp16 outputs, other GPUs) the bf16 prepass: each operand
  dequantised once into bf16 (``_mx_dequant.dequantize``), cuBLAS's bf16 GEMM on the copies (exact values, fp32
  sums; ``(M + N) * K * 2`` bytes alive during the call). Converting in the main loop instead costs every output
  tile its own conversion (about 300 TFLOP/s on the H200 against cuBLAS's 800).
- Few rows (M <= 64, decode): tiles dequantised in registers (bit placement and power-of-two multiplies, exact) into
  a bf16 ``tl.dot`` with fp32 accumulation; operands swapped (``out^T = dequant(b) @ a^T``: the weights fill the
  MMA's M side) and K split across programs so that enough programs stream the weights (fp32 partials summed in
  the kernel, in split order, by each tile's last program). Weight-only MXFP4 runs unswapped (``mma.sync`` at 16
  rows: no shared-memory trip for the converted weights), up to ``LUT_MAX_M`` rows with the byte-table decode
  (``MXMMConfig.fp4_lut``). Neither bandwidth nor the decode alone bounds it: with the decode cut out entirely the
  kernel still took 75% of the plan's device time at 16x28672x4096 (34.3 against 45.8 us, memory roof 21 us) and
  81-95% on the other weight-only shapes; the scale multiplies took 8-9% at <= 32 rows, and building a row's four
  scale pairs in one register gained 2-4% there but lost 11-12% at 64 (``probe_mx_w4_floor``, H100, 005afd5). The
  split-K arrival counters are a zeroed workspace the kernel leaves zero (``_workspace``): no memset per call.
- Between: the same in-loop tiles, unswapped (64x128).

``MXMMConfig.fragment_k`` (swapped weight-only, K summed in the wgmma register fragment's order, no shared-memory
round trip) stays for explicit configs and the compile checks: it was never the fastest form (0.55-0.98x of the
plan's, H200, cd386b1).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fly_lightning.kernels import outputs
from fly_lightning.kernels.layout import copy_reason
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
    device_reason,
    interpreting,
    num_sms,
    on_device,
)
from fly_lightning.kernels.triton._workspace import zeroed
from fly_lightning.ops.mx_scaled_mm import MX_SCALED_MM

K_ALIGN = 128  # the fast kernel's K granularity (BLOCK_K); the reference takes K % 32
PREPASS_MIN_M = 128
"""Rows from which ``plan`` converts the operands in a prepass and runs cuBLAS. By device time (CUDA-graph replays,
H200, 4e6f598) the bf16 prepass won from 128 rows (0.081 against 0.085 ms MXFP8, 0.074 against 0.119 MXFP4 at
128x14336x4096; 2.3x at 256x4096x4096); with host-bound eager timing the in-loop plan's one launch wins below about
1024 rows, a cost hidden whenever the host runs ahead of the GPU, as in a training step."""
FP8_BLOCKWISE = True
"""Whether the prepass plan re-expresses MX x MX operands (e4m3 / e2m1 elements, bf16 output, N % 16) for cuBLAS's
blockwise fp8 GEMM on Hopper with CUDA >= 12.9. Precision: e2m1 groups are exact while their non-zero blocks'
scales span <= 14, e4m3 and wider groups round within 2^-17 of the group's largest element (``_mx_requant``); the
fp8 MMAs' sums are promoted to fp32 every 128 K. Measured (mx_gemm suite, H100, f35bf63): relative error of the bf16
output unchanged (1.66e-3 on every shape); against cuBLAS bf16 at M >= 1024, 0.94x (MXFP8) and 1.01x (MXFP4)
event-timed, 1.02x / 1.06x device time, where the bf16 prepass ran 0.72x / 0.84x (H200, b71629c). Beside the bf16
prepass in that run: faster from 2048 rows event-timed, and by device time wherever both were graph-timed (128-512
rows: 0.026-0.068 against 0.032-0.108 ms); but a host-bound eager call costs about 40 us more host time (cuBLAS's
blockwise setup: 0.12 against 0.08 ms per call at 128-1024 rows, K 4096). The plan goes by device time, as
``PREPASS_MIN_M`` does. fp32 outputs keep the bf16 prepass (exact fp32 sums: the fp8 form's differ by 1.25e-4
relative on MXFP8, ``probe_mx_fp8_blockwise``)."""
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
            tl.store(ARRIVED + pid, 0)  # every program of the tile has arrived: zero again for the next launch


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
        and _fp8_takes(a_fmt, b_fmt, n, out_dtype)
        and (available(device) if fp8_gemm is None else fp8_gemm)
    )
    return _plan(m, n, k, a_fmt, b_fmt, device, sms, interp, fp8)


def _fp8_takes(a_fmt: str | None, b_fmt: str, n: int, out_dtype: torch.dtype) -> bool:
    """Whether the fp8 prepass serves these operands: e4m3 / e2m1 both, N % 16 (cuBLAS), a bf16 output."""
    return a_fmt in FP8_FORMATS and b_fmt in FP8_FORMATS and n % 16 == 0 and out_dtype == torch.bfloat16


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
    if config is None:  # plan() emits valid plans only: checks for explicit configs, off the per-call path
        cfg = plan(m, n, k, a_fmt, b_fmt, a.device, out_dtype=out_dtype)
    else:
        cfg = config
        _check_config(cfg, a_fmt, b_fmt, n, k, out_dtype)
    if m == 0 or n == 0 or k == 0:
        return torch.zeros(m, n, dtype=out_dtype, device=a.device)
    if cfg.fp8_blockwise:
        qa, sa, qb, sb = requantize(a, a_scale, a_fmt, b, b_scale, b_fmt)
        return torch._scaled_mm(qa, qb.t(), sa, sb, out_dtype=out_dtype)
    if cfg.prepass:
        return _prepass_mm(a, a_scale, a_fmt, b, b_scale, b_fmt, out_dtype)
    interp = a.device.type == "cpu" and interpreting()
    ptx = ptx_pairs(a)  # inline PTX: NVIDIA only
    lut = cfg.fp4_lut and not interp and ptx
    if lut and any(
        t.data_ptr() % 4 or t.stride(0) % 4 for t, f in ((a, a_fmt), (b, b_fmt)) if f == "mxfp4_e2m1"
    ):  # fmt: skip
        if config is not None:
            raise ValueError(f"mx_scaled_mm: {cfg} loads MXFP4 rows as 32-bit words: rows and data 4-byte aligned")
        lut = False  # the plan's pick on unaligned rows: the pair decode, same tiles
    split = cfg.split_k
    out = outputs.empty(m, n, dtype=out_dtype, device=a.device)
    tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    if split == 1:
        partial = arrived = out  # unused
    else:  # fp32 partials, and per output tile the count of its programs done (zero between launches)
        partial = outputs.empty(split, m, n, dtype=torch.float32, device=a.device)
        arrived = zeroed(a.device, tiles)
    # float8 / e8m0 tensors cannot be kernel arguments: bytes (each view costs the host about a microsecond)
    b_u8 = b if b.dtype == torch.uint8 else b.view(torch.uint8)
    bs_u8 = b_scale.view(torch.uint8)
    a_arg = a if a_fmt is None or a.dtype == torch.uint8 else a.view(torch.uint8)
    a_s = bs_u8 if a_scale is None else a_scale.view(torch.uint8)  # b's scales: a placeholder for bf16 a
    with on_device(a):
        _MX_MM(
            (tiles, split),
            (a_arg, a_s, b_u8, bs_u8, out, partial, arrived, m, n, k,
             a.stride(0), a_s.stride(0), b.stride(0), b_scale.stride(0), n, m * n),
            **_constants(cfg, a_fmt, b_fmt, interp, ptx, lut),
        )  # fmt: skip
    return out


def _check_config(cfg: MXMMConfig, a_fmt, b_fmt, n: int, k: int, out_dtype: torch.dtype) -> None:
    """An explicit plan's conditions, before any launch."""
    if cfg.fp8_blockwise and not (cfg.prepass and _fp8_takes(a_fmt, b_fmt, n, out_dtype)):
        raise ValueError(f"mx_scaled_mm: {cfg} takes {FP8_FORMATS} operands, N % 16 and a bf16 output")
    if k % (cfg.block_k * cfg.split_k):
        raise ValueError(f"mx_scaled_mm: K={k} is not a multiple of block_k * split_k in {cfg}")
    if cfg.fragment_k and not (cfg.swap and a_fmt is None and cfg.block_k == FRAGMENT_STEP and not cfg.prepass):
        raise ValueError(f"mx_scaled_mm: fragment_k is for swapped weight-only plans, block_k {FRAGMENT_STEP}: {cfg}")
    if cfg.swap and not cfg.prepass and "mxfp4_e2m1" in (a_fmt, b_fmt) and cfg.block_k != K_ALIGN:
        # plan() never emits it; an explicit 128x128x64 swapped plan (8 warps, 4 stages) gave wrong results on the H200
        raise ValueError(f"mx_scaled_mm: swapped MXFP4 plans need block_k {K_ALIGN} (others are untrusted): {cfg}")


@functools.lru_cache(maxsize=1024)
def _constants(cfg: MXMMConfig, a_fmt, b_fmt, interp: bool, ptx: bool, lut: bool) -> dict:
    """The kernel's constexprs and launch options for a plan (built once: the launch runs on every call)."""
    return dict(
        A_FMT=FMT_CODE[a_fmt], B_FMT=FMT_CODE[b_fmt], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, SWAP=cfg.swap, SPLIT_K=cfg.split_k,
        INTERPRET=interp, HW_CVT=cfg.fp8_cvt == "hw", PTX=ptx, LUT=lut, FRAG_K=cfg.fragment_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


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
    "swapped; up to 32, fp4 decoded from 32-bit words where rows are 4-byte aligned); M >= 128, e4m3 / e2m1, bf16 "
    "out, N % 16 (sm90, CUDA 12.9+): re-expressed as e4m3 with one scale per 128 along K (fp8 copies during the "
    "call), then cuBLAS's blockwise fp8 GEMM (sums promoted every 128 K); other M >= 128: dequantised to bf16 in a "
    "prepass (a bf16 copy of each operand during the call), then cuBLAS",
)
def mx_scaled_mm_triton(a, a_scale, a_fmt, b, b_scale, b_fmt, out_dtype) -> torch.Tensor:
    return launch(a, a_scale, a_fmt, b, b_scale, b_fmt, out_dtype)
