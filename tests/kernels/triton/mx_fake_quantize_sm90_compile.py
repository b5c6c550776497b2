"""Compile the MX fake-quantisation kernels for sm_90 without a GPU, as the launcher runs them on one (conversion
instructions for bf16 and fp8), for each format, input dtype and scale mode, row-wise and column-wise; report each
variant as JSON."""

import torch
from _sm90 import compile_sm90, report

from fly_lightning.kernels.triton._mx_elements import cast_constants
from fly_lightning.kernels.triton.mx_fake_quantize import COLS_PLAN, PLAN, _fake_quant_cols, _fake_quant_rows
from fly_lightning.quant import formats


def variant(fmt: str, dtype: str, rceil: bool, cols: bool) -> dict:
    fn = _fake_quant_cols if cols else _fake_quant_rows
    tile, g, warps = COLS_PLAN if cols else PLAN
    sig = {a: "i32" for a in fn.arg_names}
    sig.update(X=f"*{dtype}", OUT=f"*{dtype}")
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    const = dict(cast_constants("mx_fake_quantize", fmt, "rceil" if rceil else "floor", torch_dtype, True), G=g)
    const["BN" if cols else "BR"] = tile
    aligned = ("X", "OUT", "stride_x", "N" if cols else "K")
    kernel, spill, regs = compile_sm90(fn, sig, const, aligned, num_warps=warps, num_stages=1)
    ptx = kernel.asm["ptx"]
    fp8_cvt = sum(ptx.count(f"cvt.rn.satfinite.{t}x2.f32") for t in ("e4m3", "e5m2"))
    return dict(spill_bytes=spill, registers=regs, fp8_cvt=fp8_cvt, bf16_cvt=ptx.count("cvt.rn.bf16"))


VARIANTS = {
    f"{fmt}-{dtype}-{mode}-{axis}": (lambda f=fmt, d=dtype, m=mode, a=axis: variant(f, d, m == "rceil", a == "cols"))
    for fmt in formats.FORMATS
    for dtype, mode in (("bf16", "floor"), ("fp32", "floor"), ("bf16", "rceil"))
    for axis in ("rows", "cols")
}

if __name__ == "__main__":
    report(VARIANTS)
