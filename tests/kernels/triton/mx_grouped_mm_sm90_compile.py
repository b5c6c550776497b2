"""Compile the MX grouped GEMM kernel for sm_90 without a GPU and report each variant as JSON (see ``_sm90.py``): every
format pair in the configurations the launcher picks (few and many rows per group), the swapped weight-only
candidates in both K orders, and the wide swapped plan with x gathered instead of stored in the fragment's order;
each with its innermost K loop's static counts."""

from dataclasses import replace

from _sm90 import compile_sm90, report, sass_loop

from fly_lightning.kernels.triton._mx_grouped_mm_kernel import (
    FMT_CODE,
    MXGroupedMMConfig,
    _mx_grouped_mm_kernel,
    choose_config,
    loop_config,
)

# rows per group: the launcher picks the plan from these and the formats on Hopper (MX x takes swapped tiles, x
# dequantised first: of 64 rows up to 64 (96 with MXFP8 weights), then of 128, of 256 from 256 up to 1023;
# weight-only takes the WEIGHT_ONLY tiles from 256); "large" is the in-loop table at 200 rows (off Hopper)
ROWS = {"small": 64, "large": 200, "mid": 200, "wide": 400, "weight-only-wide": 384}
PAIRS = {
    "e4m3": ("mxfp8_e4m3", "mxfp8_e4m3"),
    "e5m2": ("mxfp8_e5m2", "mxfp8_e5m2"),
    "fp4": ("mxfp4_e2m1", "mxfp4_e2m1"),
    "w-e4m3": (None, "mxfp8_e4m3"),
    "w-fp4": (None, "mxfp4_e2m1"),
    "e4m3-fp4": ("mxfp8_e4m3", "mxfp4_e2m1"),
}


# weights on the MMA's M side (register operand), 64-row groups on its N side, in natural K order and in the register
# fragment's (fragment_k)
SWAPPED = MXGroupedMMConfig(64, 128, 128, 8, 3, 8, swap=True)


def variant(pair: str, plan: str, out: str = "bf16", x_frag: bool = True) -> dict:
    """``x_frag=False``: a plan's x read in natural order, gathered into the fragment's K order by the loads."""
    x_fmt, w_fmt = PAIRS[pair]
    if plan.startswith("swap"):
        cfg = replace(SWAPPED, fragment_k=plan == "swap-fragk")
    elif plan == "large":
        cfg = loop_config(ROWS[plan] * 8, 8, x_fmt, w_fmt)
    else:
        cfg = choose_config(ROWS[plan] * 8, 8, False, x_fmt, w_fmt, sm90=True)
        x_fmt = None if cfg.x_prepass else x_fmt  # the kernel then reads x dequantised to bf16 (fragment order)
    fn = _mx_grouped_mm_kernel
    sig = {a: "i32" for a in fn.arg_names}
    sig.update(X="*bf16" if x_fmt is None else "*u8", XS="*bf16" if x_fmt is None else "*u8", W="*u8", WS="*u8",
               OUT=f"*{out}", OFFS="*i32")  # fmt: skip
    const = dict(
        X_FMT=FMT_CODE[x_fmt], W_FMT=FMT_CODE[w_fmt], E_POW2=1024, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, UPCAST=False, INTERPRET=False, PTX=True, SWAP=cfg.swap,
        FRAG_K=cfg.fragment_k, X_FRAG=x_frag and cfg.x_prepass and cfg.fragment_k,
    )  # fmt: skip
    aligned = ("X", "XS", "W", "WS", "OUT", "OFFS", "N", "K", "stride_xm", "stride_xsm", "stride_we", "stride_wn",
               "stride_wse", "stride_wsn", "stride_om")  # fmt: skip
    kernel, spill, regs = compile_sm90(fn, sig, const, aligned, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    r = dict(
        spill_bytes=spill, registers=regs, shared=kernel.metadata.shared,
        wgmma=ptx.count("wgmma.mma_async"), mma=ptx.count("mma.sync"),
        async_copies=ttgir.count("ttg.async_copy_global_to_local"), bf16x2_fma=ptx.count("fma.rn.bf16x2"),
    )  # fmt: skip
    r.update(sass_loop(kernel, innermost_mma=True))
    return r


VARIANTS = {f"{pair}-{plan}": (lambda p=pair, q=plan: variant(p, q)) for pair in PAIRS for plan in ("small", "large")}
VARIANTS |= {f"{p}-weight-only-wide": (lambda p=p: variant(p, "weight-only-wide")) for p in ("w-e4m3", "w-fp4")}
VARIANTS |= {f"{p}-{q}": (lambda p=p, q=q: variant(p, q)) for p in ("e4m3", "e5m2", "fp4", "e4m3-fp4")
             for q in ("mid", "wide")}  # fmt: skip
VARIANTS["e4m3-wide-gathered-x"] = lambda: variant("e4m3", "wide", x_frag=False)
VARIANTS["e4m3-large-fp32out"] = lambda: variant("e4m3", "large", out="fp32")
VARIANTS |= {f"{p}-{q}": (lambda p=p, q=q: variant(p, q)) for p in ("w-e4m3", "w-fp4") for q in ("swap", "swap-fragk")}

if __name__ == "__main__":
    report(VARIANTS)
