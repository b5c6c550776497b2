"""Compile the prepass dequantising kernel (MX -> bf16, two operands per launch) for sm_90 without a GPU, as the
prepass plans launch it (hardware fp8 conversions, pairwise fp4), with and without the grouped GEMM's skipping of
groups without rows; report each variant as JSON."""

from _sm90 import compile_sm90, report

from fly_lightning.kernels.triton._mx_dequant import DEQUANT_COLS, DEQUANT_ROWS, FMT_CODE, _dequant_kernel

PAIRS = {"e4m3": ("mxfp8_e4m3", "mxfp8_e4m3"), "fp4": ("mxfp4_e2m1", "mxfp4_e2m1")}


def variant(pair: str, skip: bool) -> dict:
    a_fmt, b_fmt = PAIRS[pair]
    fn = _dequant_kernel
    sig = {a: "i32" for a in fn.arg_names}
    sig.update(A="*u8", A_SCALE="*u8", A_OUT="*bf16", B="*u8", B_SCALE="*u8", B_OUT="*bf16", OFFS="*i32")
    const = dict(A_FMT=FMT_CODE[a_fmt], B_FMT=FMT_CODE[b_fmt], BR=DEQUANT_ROWS, BC=DEQUANT_COLS, FP32=False,
                 HW_CVT=True, PTX=True, SKIP_EMPTY=skip)  # fmt: skip
    aligned = ("A", "A_SCALE", "A_OUT", "B", "B_SCALE", "B_OUT", "OFFS", "C", "stride_a", "stride_b")
    kernel, spill, regs = compile_sm90(fn, sig, const, aligned, num_warps=4, num_stages=1)
    ptx = kernel.asm["ptx"]
    # the offsets are read only where groups are skipped: an s32 global load from OFFS
    return dict(spill_bytes=spill, registers=regs, offs_loads=ptx.count("ld.global.b32") + ptx.count("ld.global.u32"))


VARIANTS = {f"{p}{'-skip' if s else ''}": (lambda p=p, s=s: variant(p, s)) for p in PAIRS for s in (False, True)}

if __name__ == "__main__":
    report(VARIANTS)
