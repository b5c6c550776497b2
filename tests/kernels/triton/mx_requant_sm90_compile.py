"""Compile the MX -> e4m3 1x128 re-expression kernel for sm_90 without a GPU, as the fp8 prepass plan launches it
(the hardware e4m3 conversions), for each pair of element formats; report each variant as JSON."""

from _sm90 import compile_sm90, report

from fly_lightning.kernels.triton._mx_dequant import FMT_CODE
from fly_lightning.kernels.triton._mx_requant import COLS, ROWS, _requant_kernel

PAIRS = {"e4m3": ("mxfp8_e4m3", "mxfp8_e4m3"), "fp4": ("mxfp4_e2m1", "mxfp4_e2m1"), "e4m3-fp4": ("mxfp8_e4m3",
         "mxfp4_e2m1")}  # fmt: skip


def variant(pair: str) -> dict:
    a_fmt, b_fmt = PAIRS[pair]
    fn = _requant_kernel
    sig = {a: "i32" for a in fn.arg_names}
    data = {"mxfp8_e4m3": "*fp8e4nv", "mxfp4_e2m1": "*u8"}  # e4m3 data as it is, e2m1 pairs as bytes
    sig.update(A=data[a_fmt], A_SCALE="*u8", A_Q="*fp8e4nv", A_QS="*fp32", B=data[b_fmt], B_SCALE="*u8",
               B_Q="*fp8e4nv", B_QS="*fp32")  # fmt: skip
    const = dict(A_FMT=FMT_CODE[a_fmt], B_FMT=FMT_CODE[b_fmt], BR=ROWS, BC=COLS, HW_CVT=True)
    aligned = ("A", "A_SCALE", "A_Q", "A_QS", "B", "B_SCALE", "B_Q", "B_QS", "C", "stride_a", "stride_b")
    kernel, spill, regs = compile_sm90(fn, sig, const, aligned, num_warps=4, num_stages=1)
    ptx = kernel.asm["ptx"]
    cvt = ptx.count("cvt.rn.satfinite.e4m3x2.f16x2")
    f32_cvt = ptx.count("cvt.rn.satfinite.e4m3x2.f32")
    return dict(spill_bytes=spill, registers=regs, e4m3_cvt=cvt, f32_cvt=f32_cvt)


VARIANTS = {p: (lambda p=p: variant(p)) for p in PAIRS}

if __name__ == "__main__":
    report(VARIANTS)
