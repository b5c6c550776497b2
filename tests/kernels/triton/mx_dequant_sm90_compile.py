"""Compile the prepass dequantising kernel (MX -> bf16, two operands per launch) for sm_90 without a GPU, as the
prepass plans launch it (hardware fp8 conversions, pairwise fp4), with and without the grouped GEMM's skipping of
groups without rows, and with the first operand stored in the swapped tiles' K order; report each variant as JSON."""

import re

from _sm90 import compile_sm90, report

from fly_lightning.kernels.triton._mx_dequant import DEQUANT_COLS, DEQUANT_ROWS, FMT_CODE, _dequant_kernel

PAIRS = {"e4m3": ("mxfp8_e4m3", "mxfp8_e4m3"), "fp4": ("mxfp4_e2m1", "mxfp4_e2m1")}


def variant(pair: str, skip: bool, frag: bool = False) -> dict:
    a_fmt, b_fmt = PAIRS[pair]
    fn = _dequant_kernel
    sig = {a: "i32" for a in fn.arg_names}
    sig.update(A="*u8", A_SCALE="*u8", A_OUT="*bf16", B="*u8", B_SCALE="*u8", B_OUT="*bf16", OFFS="*i32")
    const = dict(A_FMT=FMT_CODE[a_fmt], B_FMT=FMT_CODE[b_fmt], BR=DEQUANT_ROWS, BC=DEQUANT_COLS, FP32=False,
                 HW_CVT=True, PTX=True, SKIP_EMPTY=skip, A_FRAG=frag)  # fmt: skip
    aligned = (
        "A",
        "A_SCALE",
        "A_OUT",
        "B",
        "B_SCALE",
        "B_OUT",
        "OFFS",
        "C",
        "stride_a",
        "stride_b",
        "stride_ao",
        "stride_bo",
    )  # as K % 128 == 0 makes them at run time (Triton specialises multiples of 16)
    kernel, spill, regs = compile_sm90(fn, sig, const, aligned, num_warps=4, num_stages=1)
    ptx = kernel.asm["ptx"]
    # the offsets are read only where groups are skipped: an s32 global load from OFFS
    offs_loads = ptx.count("ld.global.b32") + ptx.count("ld.global.u32")
    # bf16 stores by width: 16-byte vectors, or 2-byte scalars (partial sectors, each written many times)
    wide_stores = len(re.findall(r"st\.global(?:\.\w+)*\.v4\.b32", ptx))
    narrow_stores = len(re.findall(r"st\.global(?:\.\w+)*\.b16", ptx))
    return dict(
        spill_bytes=spill, registers=regs, offs_loads=offs_loads, wide_stores=wide_stores, narrow_stores=narrow_stores
    )


VARIANTS = {f"{p}{'-skip' if s else ''}": (lambda p=p, s=s: variant(p, s)) for p in PAIRS for s in (False, True)}
VARIANTS |= {f"{p}-frag": (lambda p=p: variant(p, False, frag=True)) for p in PAIRS}

if __name__ == "__main__":
    report(VARIANTS)
