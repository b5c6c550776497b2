"""Compile the fp8 grouped kernel for sm_90 without a GPU, in the plan's tiles (``FP8``) and the one-program-per-SM
form (128x128 on 8 warps); report each variant as JSON (registers, spills, shared memory, fp8 wgmmas, TMA loads)."""

from _sm90 import compile_sm90, report

from fly_lightning.kernels.triton._mx_fp8_grouped_kernel import _fp8_grouped_kernel
from fly_lightning.kernels.triton._mx_grouped_mm_kernel import FP8

TILES = {"default": (FP8.block_m, FP8.block_n, FP8.num_warps, FP8.num_stages), "128x128": (128, 128, 8, 4)}


def variant(tiles: str) -> dict:
    bm, bn, warps, stages = TILES[tiles]
    fn = _fp8_grouped_kernel
    sig = {a: "i32" for a in fn.arg_names}
    sig.update(X="*fp8e4nv", XS="*fp32", W="*fp8e4nv", WS="*fp32", OUT="*bf16", OFFS="*i32")
    const = dict(E_POW2=1024, BLOCK_M=bm, BLOCK_N=bn, GROUP_M=8, INTERPRET=False)
    aligned = ("X", "XS", "W", "WS", "OUT", "OFFS", "K", "N", "stride_om", "stride_xs")
    kernel, spill, regs = compile_sm90(fn, sig, const, aligned, num_warps=warps, num_stages=stages)
    ptx = kernel.asm["ptx"]
    return dict(
        spill_bytes=spill,
        registers=regs,
        threads=32 * warps,
        shared=kernel.metadata.shared,
        fp8_wgmma=sum("wgmma.mma_async" in line and ".e4m3.e4m3" in line for line in ptx.splitlines()),
        tma_loads=ptx.count("cp.async.bulk.tensor"),
    )


VARIANTS = {t: (lambda t=t: variant(t)) for t in TILES}

if __name__ == "__main__":
    report(VARIANTS)
