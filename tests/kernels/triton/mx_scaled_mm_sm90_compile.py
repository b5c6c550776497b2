"""Compile the MX GEMM kernel for sm_90 without a GPU and report each variant as JSON (see ``_sm90.py``): every
format pair the launcher runs, in its in-loop plans for few and some rows and the wide in-loop plan the mx_gemm suite
times beside the prepass (many rows run the prepass and cuBLAS, no kernel of this file)."""

from _sm90 import compile_sm90, report, sass_loop

from fly_lightning.kernels.triton.mx_scaled_mm import FMT_CODE, MXMMConfig, _mx_mm_kernel

PLANS = {
    "small": MXMMConfig(16, 64, 128, num_warps=4, num_stages=4, swap=True, split_k=4),
    "small-n128-w8": MXMMConfig(16, 128, 128, num_warps=8, num_stages=4, swap=True, split_k=4),  # 2 warpgroups
    "mid": MXMMConfig(64, 128, 128, num_warps=4, num_stages=4),
    "large": MXMMConfig(128, 256, 128, num_warps=8, num_stages=3),
}
PAIRS = {
    "e4m3": ("mxfp8_e4m3", "mxfp8_e4m3"),
    "e5m2": ("mxfp8_e5m2", "mxfp8_e5m2"),
    "fp4": ("mxfp4_e2m1", "mxfp4_e2m1"),
    "w-fp4": (None, "mxfp4_e2m1"),
    "w-e4m3": (None, "mxfp8_e4m3"),
}


def variant(
    pair: str,
    plan: str,
    out: str = "bf16",
    loop: bool = False,
    hw_cvt: bool = True,
    lut: bool = False,
    fragment_k: bool = False,
) -> dict:
    a_fmt, b_fmt = PAIRS[pair]
    cfg = PLANS[plan]
    fn = _mx_mm_kernel
    sig = {a: "i32" for a in fn.arg_names}
    sig.update(
        A="*bf16" if a_fmt is None else "*u8",
        A_SCALE="*u8",
        B="*u8",
        B_SCALE="*u8",
        OUT=f"*{out}",
        PARTIAL="*fp32",
        ARRIVED="*i32",
    )
    const = dict(
        A_FMT=FMT_CODE[a_fmt], B_FMT=FMT_CODE[b_fmt], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, SWAP=cfg.swap, SPLIT_K=cfg.split_k, INTERPRET=False, HW_CVT=hw_cvt, PTX=True, LUT=lut,
        FRAG_K=fragment_k,
    )  # fmt: skip
    aligned = ("A", "A_SCALE", "B", "B_SCALE", "OUT", "K", "stride_am", "stride_asm", "stride_bn", "stride_bsn")
    kernel, spill, regs = compile_sm90(fn, sig, const, aligned, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    r = dict(
        spill_bytes=spill, registers=regs, shared=kernel.metadata.shared,
        wgmma=ptx.count("wgmma.mma_async"), mma=ptx.count("mma.sync"),
        async_copies=ttgir.count("ttg.async_copy_global_to_local"), bf16x2_fma=ptx.count("fma.rn.bf16x2"),
    )  # fmt: skip
    if loop:
        r.update(sass_loop(kernel))
    return r


VARIANTS = {f"{p}-{q}": (lambda p=p, q=q: variant(p, q)) for p in PAIRS for q in ("small", "mid", "large")}
VARIANTS["e4m3-large-fp32out"] = lambda: variant("e4m3", "large", out="fp32")
# the fp8 conversion's two forms, with the static instruction count of the main loop (per thread and K step)
for _pair in ("e4m3", "e5m2"):
    VARIANTS[f"{_pair}-large-bits-loop"] = lambda p=_pair: variant(p, "large", loop=True, hw_cvt=False)
    VARIANTS[f"{_pair}-large-hwcvt-loop"] = lambda p=_pair: variant(p, "large", loop=True, hw_cvt=True)

# fp4 tiles as 32-bit words decoded by byte tables (MXMMConfig.fp4_lut), against the pair form's loop
for _pair, _plan in (("w-fp4", "small"), ("fp4", "mid")):
    VARIANTS[f"{_pair}-{_plan}-pairs-loop"] = lambda p=_pair, q=_plan: variant(p, q, loop=True)
    VARIANTS[f"{_pair}-{_plan}-lut-loop"] = lambda p=_pair, q=_plan: variant(p, q, loop=True, lut=True)


# swapped weight-only with K in the wgmma fragment's order (MXMMConfig.fragment_k), beside the natural order's loops
VARIANTS["w-e4m3-small-loop"] = lambda: variant("w-e4m3", "small", loop=True)
for _tag, _pair, _lut in (("w-fp4-small-pairs", "w-fp4", False), ("w-fp4-small-lut", "w-fp4", True),
                          ("w-e4m3-small", "w-e4m3", False)):  # fmt: skip
    VARIANTS[f"{_tag}-fragk-loop"] = lambda p=_pair, u=_lut: variant(p, "small", loop=True, lut=u, fragment_k=True)
VARIANTS["w-fp4-small-n128-w8-lut-fragk-loop"] = lambda: variant("w-fp4", "small-n128-w8", loop=True, lut=True,
                                                                 fragment_k=True)  # fmt: skip

if __name__ == "__main__":
    report(VARIANTS)
