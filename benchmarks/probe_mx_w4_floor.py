"""Probe (GPU): where the weight-only MXFP4 kernel's time goes at few rows (the mx_gemm suite's weight-only shapes).

The plan's kernel is timed beside copies of itself whose fp4 decode is cut down, each with the byte-table loader
(``MXMMConfig.fp4_lut``), the same tiles and split as the plan:

- ``lut``: the byte-table decode as the plan has it at <= 32 rows (the plan at 64 rows decodes pairs);
- ``scale4``: the byte tables with each row's four block scales turned into bf16 scale pairs together, in one
  register (fewer instructions per scale than one at a time);
- ``noscale``: the byte tables without the block scale multiply (wrong values: the scales' cost);
- ``nodecode``: no decode, the 32-bit words fed to the MMA as bf16 pairs (wrong values: what loads, MMAs and the
  pipeline cost alone);
- ``roof``: the bytes the kernel must read (fp4 weights, scales, activations) and write, at the measured copy
  bandwidth, launch latency left out.

Device time from CUDA-graph replays, side by side. Then the host time of one eager weight-only call taken apart
(16x4096x4096, the suite's most host-bound case). Prints; not a suite.

    python -m benchmarks.probe_mx_w4_floor          # both parts
    python -m benchmarks.probe_mx_w4_floor --host   # the host part alone
"""

from __future__ import annotations

import sys
from dataclasses import replace

import torch
import triton
import triton.language as tl

import fly_lightning
from benchmarks.harness import copy_bandwidth_gbps, host_us, probe_graph_ms
from fly_lightning.kernels import outputs
from fly_lightning.kernels.triton import _mx_dequant as md
from fly_lightning.kernels.triton import mx_scaled_mm as kernel
from fly_lightning.kernels.triton._launch import FastLaunch
from fly_lightning.kernels.triton._workspace import zeroed
from fly_lightning.ops.mx_scaled_mm import MX_SCALED_MM, mx_scaled_mm_reference

SHAPES = [(16, 4096, 4096), (16, 28672, 4096), (32, 4096, 14336), (64, 6144, 4096), (64, 8192, 8192)]
CALLS = 20
FMT = "mxfp4_e2m1"


# the byte tables of ``_mx_dequant._fp4_words_lut`` without its four scale multiplies
_NOSCALE_ASM = tl.constexpr(md.FP4_WORDS_LUT_ASM.value[: md.FP4_WORDS_LUT_ASM.value.index(" mov.b32 z")] + " }")


@triton.jit
def _lut_noscale(words_u32):
    """``_mx_dequant._fp4_words_lut`` without its four scale multiplies."""
    return tl.inline_asm_elementwise(
        _NOSCALE_ASM,
        "=r,=r,=r,=r,r",
        [words_u32],
        dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
        is_pure=True,
        pack=1,
    )


@triton.jit
def _words_noscale(words_u32, scale):
    R: tl.constexpr = words_u32.shape[0]
    KW: tl.constexpr = words_u32.shape[1]
    s = tl.reshape(tl.broadcast_to(scale.to(tl.uint32)[:, :, None], (R, KW // 4, 4)), (R, KW))
    o0, o1, o2, o3 = _lut_noscale(words_u32 ^ s)  # the scales still loaded: one xor per word
    return md.words_to_bf16(o0, o1, o2, o3)


@triton.jit
def _words_nodecode(words_u32, scale):
    R: tl.constexpr = words_u32.shape[0]
    KW: tl.constexpr = words_u32.shape[1]
    s = tl.reshape(tl.broadcast_to(scale.to(tl.uint32)[:, :, None], (R, KW // 4, 4)), (R, KW))
    w0 = words_u32 ^ s
    return md.words_to_bf16(w0, w0 >> 1, w0 >> 2, w0 >> 3)


@triton.jit
def _scale_pairs4(s0, s1, s2, s3):
    """Four E8M0 scales (widened) to their bf16 scale pairs, the four at once in one register: per byte, the high
    byte ``s >> 1``, the low ``(s & 1) << 7``, plus 0x40 where all bits are equal (0: 2^-127, 255: NaN); the same
    words as ``_mx_dequant._e8m0_bf16_pairs``."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 w, r, y, t, sp, lo, hi;"
        " prmt.b32 w, $4, $5, 0x0040; prmt.b32 r, $6, $7, 0x0040; prmt.b32 w, w, r, 0x5410;"
        " shr.b32 r, w, 1; xor.b32 y, w, r; and.b32 y, y, 0x7F7F7F7F; add.u32 t, y, 0x7F7F7F7F;"
        " not.b32 t, t; and.b32 sp, t, 0x80808080; shr.b32 sp, sp, 1;"
        " and.b32 hi, r, 0x7F7F7F7F; shl.b32 lo, w, 7; and.b32 lo, lo, 0x80808080; or.b32 lo, lo, sp;"
        " prmt.b32 $0, lo, hi, 0x4040; prmt.b32 $1, lo, hi, 0x5151;"
        " prmt.b32 $2, lo, hi, 0x6262; prmt.b32 $3, lo, hi, 0x7373; }",
        "=r,=r,=r,=r,r,r,r,r",
        [s0, s1, s2, s3],
        dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
        is_pure=True,
        pack=1,
    )


@triton.jit
def _words_scale4(words_u32, scale):
    """``_mx_dequant.dequant_fp4_words`` with the scale pairs of a row's four blocks built together."""
    R: tl.constexpr = words_u32.shape[0]
    KW: tl.constexpr = words_u32.shape[1]
    tl.static_assert(KW == 16)
    even, odd = tl.split(tl.reshape(scale.to(tl.uint32), (R, 2, 2)))
    s0, s2 = tl.split(even)
    s1, s3 = tl.split(odd)
    p0, p1, p2, p3 = _scale_pairs4(s0, s1, s2, s3)
    pairs = tl.reshape(tl.join(tl.join(p0, p2), tl.join(p1, p3)), (R, 4))
    s_pair = tl.reshape(tl.broadcast_to(pairs[:, :, None], (R, 4, 4)), (R, KW))
    o0, o1, o2, o3 = md._fp4_words_lut(words_u32, s_pair)
    return md.words_to_bf16(o0, o1, o2, o3)


def _variant(decode) -> tuple[FastLaunch, tuple]:
    """A fresh copy of the MX GEMM kernel whose loader decodes MXFP4 words with ``decode``: new JIT functions down
    the chain, so that their cache keys hold the replaced source."""
    saved = (md.dequant_fp4_words, md.load_operand, kernel.load_operand)
    md.dequant_fp4_words = decode
    loader = triton.jit(md.load_operand.fn)
    md.load_operand = kernel.load_operand = loader
    try:
        fresh = triton.jit(kernel._mx_mm_kernel.fn)
        fresh.cache_key  # noqa: B018 (the dependency hash, read while the replacements are in place)
    finally:
        md.dequant_fp4_words, md.load_operand, kernel.load_operand = saved
    return FastLaunch(fresh), (decode, loader)


def _launcher(fl: FastLaunch, chain: tuple, cfg: kernel.MXMMConfig):
    """``kernel.launch`` with ``fl`` as its kernel; the replaced loader chain installed while it compiles."""

    def call(x, w, b, b_s):
        saved = (md.dequant_fp4_words, md.load_operand, kernel.load_operand, kernel._MX_MM)
        md.dequant_fp4_words, md.load_operand = chain
        kernel.load_operand, kernel._MX_MM = chain[1], fl
        try:
            return kernel.launch(x, None, None, b, b_s, FMT, torch.bfloat16, cfg)
        finally:
            md.dequant_fp4_words, md.load_operand, kernel.load_operand, kernel._MX_MM = saved

    return call


def host_breakdown() -> None:
    m, n, k = 16, 4096, 4096
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b, b_s = fly_lightning.mx_cast(torch.randn(n, k, device="cuda", dtype=torch.bfloat16), FMT, "floor")
    cfg = kernel.plan(m, n, k, None, FMT, x.device)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    partial = torch.empty(cfg.split_k, m, n, device="cuda", dtype=torch.float32)
    arrived = zeroed(x.device, tiles)  # the kernel leaves it zero
    bu, bsu = b.view(torch.uint8), b_s.view(torch.uint8)
    consts = kernel._constants(cfg, None, FMT, False, True, cfg.fp4_lut)  # what launch() passes on an H100
    args = (x, bsu, bu, bsu, out, partial, arrived, m, n, k, x.stride(0), bsu.stride(0), bu.stride(0), bsu.stride(0),
            n, m * n)  # fmt: skip

    parts = {
        "public mx_scaled_mm": lambda: fly_lightning.mx_scaled_mm(x, b, b_s, FMT),
        "dispatcher": lambda: MX_SCALED_MM(x, None, None, b, b_s, FMT, torch.bfloat16),
        "launch()": lambda: kernel.launch(x, None, None, b, b_s, FMT, torch.bfloat16),
        "FastLaunch alone": lambda: kernel._MX_MM((tiles, cfg.split_k), args, **consts),
        "torch.zeros(tiles)": lambda: torch.zeros(tiles, device="cuda", dtype=torch.int32),
        "zeroed(tiles)": lambda: zeroed(x.device, tiles),
        "outputs.empty x2": lambda: (
            outputs.empty(m, n, dtype=torch.bfloat16, device=x.device),
            outputs.empty(cfg.split_k, m, n, dtype=torch.float32, device=x.device),
        ),
        "plan() (cached)": lambda: kernel.plan(m, n, k, None, FMT, x.device),
        "torch.mm bf16": lambda: torch.mm(x, x.t()),
    }
    with torch.no_grad():
        print(f"host us per call, w4 {m}x{n}x{k} ({cfg.label()}):", flush=True)
        for _ in range(2):
            for name, fn in parts.items():
                print(f"   {name:22s} {host_us(fn):6.1f}", flush=True)


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    if "--host" in sys.argv:  # the host part alone
        host_breakdown()
        return
    gbps = copy_bandwidth_gbps()
    print(f"copy bandwidth {gbps:.0f} GB/s", flush=True)
    variants = {
        "scale4": _variant(_words_scale4),
        "noscale": _variant(_words_noscale),
        "nodecode": _variant(_words_nodecode),
    }
    for m, n, k in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        b, b_s = fly_lightning.mx_cast(w, FMT, "floor")
        ref = mx_scaled_mm_reference(x, None, None, b, b_s, FMT, torch.float32)
        plan = kernel.plan(m, n, k, None, FMT, x.device)
        lut = replace(plan, fp4_lut=True)
        fns = {
            "plan": lambda x, w, b, b_s: kernel.launch(x, None, None, b, b_s, FMT, torch.bfloat16),
            "bf16": lambda x, w, b, b_s: torch.mm(x, w.t()),
            "lut": lambda x, w, b, b_s, c=lut: kernel.launch(x, None, None, b, b_s, FMT, torch.bfloat16, c),
        }
        for name, (fl, chain) in variants.items():
            fns[name] = _launcher(fl, chain, lut)
        ms, errs = probe_graph_ms(fns, [(x, w, b, b_s)], ref, f"{m}x{n}x{k}", CALLS)
        nbytes = b.numel() + b_s.numel() + x.numel() * 2 + m * n * 2
        roof_us = nbytes / gbps / 1e3
        print(f"w4 {m}x{n}x{k} ({plan.label()}; lut {lut.label()}): roof {roof_us:.1f} us", flush=True)
        print("   " + "  ".join(f"{nm}={t * 1e3:.1f}" + ("!" if errs[nm] > 1e-2 else "") for nm, t in ms.items()))
    host_breakdown()


if __name__ == "__main__":
    main()
