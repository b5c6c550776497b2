"""Compile the swiglu kernel for sm_90 without a GPU and report each variant as JSON (see ``_sm90.py``)."""

import re

from _sm90 import compile_sm90, report

from fly_lightning.kernels.triton.swiglu import _plan, _swiglu_fwd


def variant(i: int, dtype: str = "bf16", act: int = 0) -> dict:
    bt, bi = _plan(i)
    sig = dict(G=f"*{dtype}", stride_g="i32", U=f"*{dtype}", stride_u="i32", Y=f"*{dtype}", S="i32", N="i32")
    aligned = ("G", "U", "Y", "stride_g", "stride_u", "N")
    kernel, spill, _ = compile_sm90(_swiglu_fwd, sig, dict(BT=bt, BI=bi, ACT=act), aligned, num_warps=4)
    ptx = kernel.asm["ptx"]
    return dict(
        spill_bytes=spill,
        vector_loads=len(re.findall(r"ld\.global(?:\.\w+)*\.v[248]\.", ptx)),
        vector_stores=len(re.findall(r"st\.global(?:\.\w+)*\.v[248]\.", ptx)),
    )


VARIANTS = {
    "i768": lambda: variant(768),
    "i1536": lambda: variant(1536),
    "i14336-fp32": lambda: variant(14336, "fp32"),
    "i1536-gelu": lambda: variant(1536, act=1),  # GeGLU, erf
    "i1536-gelu-tanh": lambda: variant(1536, act=2),
}

if __name__ == "__main__":
    report(VARIANTS)
