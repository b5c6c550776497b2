"""Compile the fp8 grouped kernel for sm_90 without a GPU, in its tile configurations, with the scales loaded through
TMA and by pointers; report each variant as JSON (registers, spills, shared memory, the K loop's fp8 wgmmas, TMA
loads and global loads)."""

from _sm90 import compile_sm90, report

from fly_lightning.kernels.triton._mx_fp8_grouped_kernel import DEFAULT, _fp8_grouped_kernel

TILES = {
    "default": (DEFAULT.block_m, DEFAULT.block_n, DEFAULT.num_warps, DEFAULT.num_stages),
    "64x256": (64, 256, 8, 4),
}


def variant(tiles: str, tma_scales: bool) -> dict:
    bm, bn, warps, stages = TILES[tiles]
    fn = _fp8_grouped_kernel
    sig = {a: "i32" for a in fn.arg_names}
    sig.update(X="*fp8e4nv", XS="*fp32", W="*fp8e4nv", WS="*fp32", OUT="*bf16", OFFS="*i32")
    const = dict(E_POW2=1024, BLOCK_M=bm, BLOCK_N=bn, GROUP_M=8, INTERPRET=False, TMA_S=tma_scales)
    aligned = ("X", "XS", "W", "WS", "OUT", "OFFS", "K", "N", "stride_om", "stride_xs")
    kernel, spill, regs = compile_sm90(fn, sig, const, aligned, num_warps=warps, num_stages=stages)
    ptx = kernel.asm["ptx"]
    return dict(
        spill_bytes=spill,
        registers=regs,
        shared=kernel.metadata.shared,
        fp8_wgmma=sum("wgmma.mma_async" in line and ".e4m3.e4m3" in line for line in ptx.splitlines()),
        tma_loads=ptx.count("cp.async.bulk.tensor"),
        global_loads=ptx.count("ld.global"),
    )


VARIANTS = {f"{t}{'' if s else '-ptr-scales'}": (lambda t=t, s=s: variant(t, s)) for t in TILES for s in (True, False)}

if __name__ == "__main__":
    report(VARIANTS)
