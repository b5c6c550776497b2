"""Compile the MX cast kernels for sm_90 without a GPU, as the launchers run them on one (conversion instructions for
bf16 and fp8, ``mx_cast.HW_CVT``), for each format, input dtype and scale mode, row-wise and column-wise; report each
variant as JSON."""

import torch
from _sm90 import compile_sm90, report

from fly_lightning.kernels.triton._mx_elements import cast_constants
from fly_lightning.kernels.triton.mx_cast import (
    COLS_FP4_PLAN,
    COLS_PLAN,
    PLAN,
    _mx_cast_cols,
    _mx_cast_cols_fp4_pairs,
    _mx_cast_cols_fp4_words,
    _mx_cast_fp4_pairs,
    _mx_cast_rows,
)
from fly_lightning.quant import formats


def variant(fmt: str, dtype: str, rceil: bool = False, cols: bool = False) -> dict:
    """The element kernel, row-wise (``_mx_cast_rows``) or column-wise (``_mx_cast_cols``), in its launch plan."""
    fn = _mx_cast_cols if cols else _mx_cast_rows
    tile, g, warps = COLS_PLAN if cols else PLAN
    sig = {a: "i32" for a in fn.arg_names}
    sig.update(X=f"*{dtype}", DATA="*u8", SCALE="*u8")
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    const = dict(cast_constants("mx_cast", fmt, "rceil" if rceil else "floor", torch_dtype, True), G=g)
    const["BN" if cols else "BR"] = tile
    aligned = ("X", "DATA", "SCALE", "N" if cols else "K", "stride_x")
    kernel, spill, regs = compile_sm90(fn, sig, const, aligned, num_warps=warps, num_stages=1)
    ptx = kernel.asm["ptx"]
    return dict(spill_bytes=spill, registers=regs, fp8_cvt=ptx.count("cvt.rn.satfinite.e4m3x2.f32")
                + ptx.count("cvt.rn.satfinite.e5m2x2.f32"))  # fmt: skip


def fp4_pairs(
    rceil: bool = False, cols: bool = False, words: bool = False, even: bool = True, max16: bool = True
) -> dict:
    """The bf16 -> MXFP4 kernels the launchers pick (``_mx_cast_fp4_pairs``, column-wise
    ``_mx_cast_cols_fp4_pairs`` or, with ``words``, ``_mx_cast_cols_fp4_words``, unmasked where ``even``) in their
    PTX form and plans (``max16``: the word kernel's block maxima by ``max.u16x2``, as from sm90)."""
    fn = _mx_cast_cols_fp4_words if words else _mx_cast_cols_fp4_pairs if cols else _mx_cast_fp4_pairs
    tile, g, warps = COLS_FP4_PLAN if words else COLS_PLAN if cols else PLAN
    sig = {a: "i32" for a in fn.arg_names}
    if words:
        sig.update(X="*i32", DATA="*i16", SCALE="*i16")
        aligned = ("X", "DATA", "SCALE", "NW", "stride_w")
    else:
        sig.update(X="*i16" if cols else "*i32", DATA="*u8", SCALE="*u8")
        aligned = ("X", "DATA", "SCALE", "N" if cols else "K", "stride_x")
    const = dict(BN=tile) if cols else dict(BR=tile)
    if words:
        const.update(EVEN=even, MAX16=max16)
    kernel, spill, regs = compile_sm90(
        fn, sig, dict(const, G=g, PTX=True, RCEIL=rceil), aligned, num_warps=warps, num_stages=1
    )
    ptx = kernel.asm["ptx"]
    fp8_cvt = ptx.count("cvt.rn.satfinite.e4m3x2.f32") + ptx.count("cvt.rn.satfinite.e5m2x2.f32")
    return dict(spill_bytes=spill, registers=regs, fp8_cvt=fp8_cvt,
                f16x2_cvt=ptx.count("cvt.rn.f16x2.f32"), f16x2_min=ptx.count("min.f16x2"),
                u16x2_max=ptx.count("max.u16x2"))  # fmt: skip


VARIANTS = {
    f"{fmt}-{dtype}": (lambda f=fmt, d=dtype: variant(f, d)) for fmt in formats.FORMATS for dtype in ("bf16", "fp32")
}
VARIANTS["mxfp4_e2m1-bf16-pairs"] = fp4_pairs
# rceil scales: from bf16 only (fp32 input takes ATen)
VARIANTS.update({f"{fmt}-bf16-rceil": (lambda f=fmt: variant(f, "bf16", rceil=True)) for fmt in formats.FORMATS})
VARIANTS["mxfp4_e2m1-bf16-pairs-rceil"] = lambda: fp4_pairs(rceil=True)
VARIANTS["mxfp4_e2m1-bf16-cols-pairs"] = lambda: fp4_pairs(cols=True)
VARIANTS["mxfp4_e2m1-bf16-cols-pairs-rceil"] = lambda: fp4_pairs(rceil=True, cols=True)
VARIANTS["mxfp4_e2m1-bf16-cols-words"] = lambda: fp4_pairs(cols=True, words=True)
VARIANTS["mxfp4_e2m1-bf16-cols-words-rceil"] = lambda: fp4_pairs(rceil=True, cols=True, words=True)
VARIANTS["mxfp4_e2m1-bf16-cols-words-masked"] = lambda: fp4_pairs(cols=True, words=True, even=False)
VARIANTS["mxfp4_e2m1-bf16-cols-words-max32"] = lambda: fp4_pairs(cols=True, words=True, max16=False)  # before sm90
# column-wise: floor from bf16 and fp32, rceil from bf16
for _fmt in formats.FORMATS:
    VARIANTS[f"{_fmt}-bf16-cols"] = lambda f=_fmt: variant(f, "bf16", cols=True)
    VARIANTS[f"{_fmt}-fp32-cols"] = lambda f=_fmt: variant(f, "fp32", cols=True)
    VARIANTS[f"{_fmt}-bf16-cols-rceil"] = lambda f=_fmt: variant(f, "bf16", rceil=True, cols=True)

if __name__ == "__main__":
    report(VARIANTS)
