"""Compile the moe_combine and moe_dispatch kernels for sm_90 without a GPU and report each variant as JSON
(see ``_sm90.py``)."""

import re

from _sm90 import compile_sm90, report

from fly_lightning.kernels.triton.moe_combine import NUM_WARPS, _moe_combine_fwd, _moe_dispatch_fwd, _plan


def variant(h: int, k: int, index: bool, rows: str = "bf16", out: str = "bf16") -> dict:
    bt, bh = _plan(h, 2 if rows != "fp32" else 4)
    sig = dict(ROWS=f"*{rows}", stride_r="i32", W="*fp32", stride_wt="i32", stride_wk="i32", IDX="*i32",
               Y=f"*{out}", stride_y="i32", T="i32", H="i32")  # fmt: skip
    const = dict(K=k, BT=bt, BH=bh, HAS_INDEX=index)
    aligned = ("ROWS", "W", "IDX", "Y", "stride_r", "stride_y", "H")
    kernel, spill, _ = compile_sm90(_moe_combine_fwd, sig, const, aligned, num_warps=NUM_WARPS)
    ptx = kernel.asm["ptx"]
    return dict(spill_bytes=spill, vector_loads=len(re.findall(r"ld\.global(?:\.\w+)*\.v[248]\.", ptx)))


def dispatch(h: int, k: int, weighted: bool, x: str = "bf16", out: str = "bf16") -> dict:
    bs, bh = _plan(h, 2 if x != "fp32" else 4)
    sig = dict(X=f"*{x}", stride_x="i32", W="*fp32", PERM="*i32", Y=f"*{out}", stride_y="i32", S="i32", H="i32")
    const = dict(TOPK=k, BS=bs, BH=bh, HAS_W=weighted)
    aligned = ("X", "W", "PERM", "Y", "stride_x", "stride_y", "H")
    kernel, spill, _ = compile_sm90(_moe_dispatch_fwd, sig, const, aligned, num_warps=NUM_WARPS)
    ptx = kernel.asm["ptx"]
    return dict(spill_bytes=spill, vector_loads=len(re.findall(r"ld\.global(?:\.\w+)*\.v[248]\.", ptx)))


VARIANTS = {
    "h2048-k8-index": lambda: variant(2048, 8, True),
    "h4096-k2-index": lambda: variant(4096, 2, True),
    "h2048-k8-slots-fp32-out": lambda: variant(2048, 8, False, out="fp32"),
    "h7168-k8-fp32-rows": lambda: variant(7168, 8, True, rows="fp32", out="fp32"),
    "dispatch-h2048-k8-weighted": lambda: dispatch(2048, 8, True),
    "dispatch-h4096-k2-fp32-grad": lambda: dispatch(4096, 2, True, x="fp32"),
    "dispatch-h2048-k8-unweighted": lambda: dispatch(2048, 8, False),
}

if __name__ == "__main__":
    report(VARIANTS)
