"""Compile the MX cast kernel for sm_90 without a GPU, as the launcher runs it on one (conversion instructions for
bf16 and fp8, ``mx_cast.HW_CVT``), for each format and input dtype; report each variant as JSON."""

from _sm90 import compile_sm90, report

from fly_lightning.kernels.triton.mx_cast import _BITS, PLAN, _mx_cast_rows
from fly_lightning.quant import formats


def variant(fmt: str, dtype: str) -> dict:
    f = formats.FORMATS[fmt]
    ebits, mbits, bias = _BITS[fmt]
    br, g, warps = PLAN
    sig = {a: "i32" for a in _mx_cast_rows.arg_names}
    sig.update(X=f"*{dtype}", DATA="*u8", SCALE="*u8")
    const = dict(
        BR=br, G=g, EMAX=f.emax, MAX=f.max, EBITS=ebits, MBITS=mbits, BIAS=bias, FP4=f.bits == 4,
        BF16=dtype == "bf16", HW=True,
    )  # fmt: skip
    aligned = ("X", "DATA", "SCALE", "K", "stride_x")
    kernel, spill, regs = compile_sm90(_mx_cast_rows, sig, const, aligned, num_warps=warps, num_stages=1)
    ptx = kernel.asm["ptx"]
    return dict(spill_bytes=spill, registers=regs, fp8_cvt=ptx.count("cvt.rn.satfinite.e4m3x2.f32")
                + ptx.count("cvt.rn.satfinite.e5m2x2.f32"))  # fmt: skip


VARIANTS = {
    f"{fmt}-{dtype}": (lambda f=fmt, d=dtype: variant(f, d)) for fmt in formats.FORMATS for dtype in ("bf16", "fp32")
}

if __name__ == "__main__":
    report(VARIANTS)
