"""Compile the fp8 grouped GEMM (MX operands re-expressed as e4m3 with 1x128 scales) for sm_90 without a GPU, in the
MX grouped plan's tiles (``_mx_grouped_mm_kernel.FP8``), for bf16 output; report it as JSON."""

from _sm90 import compile_sm90, report

from fly_lightning.kernels.triton._fp8_grouped_mm_kernel import _fp8_grouped_mm_kernel
from fly_lightning.kernels.triton._mx_grouped_mm_kernel import FP8


def variant() -> dict:
    fn = _fp8_grouped_mm_kernel
    sig = {a: "i32" for a in fn.arg_names}
    sig.update(X="*u8", XS="*fp32", W="*u8", WS="*fp32", OUT="*bf16", OFFS="*i32")
    const = dict(E_POW2=1024, BLOCK_M=FP8.block_m, BLOCK_N=FP8.block_n, GROUP_M=FP8.group_m, UPCAST=False,
                 INTERPRET=False)  # fmt: skip
    aligned = ("X", "XS", "W", "WS", "OUT", "OFFS", "K", "stride_xm", "stride_we", "stride_wn", "stride_om")
    kernel, spill, regs = compile_sm90(fn, sig, const, aligned, num_warps=FP8.num_warps, num_stages=FP8.num_stages)
    ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
    return dict(
        spill_bytes=spill, registers=regs, shared=kernel.metadata.shared,
        fp8_wgmma=sum(1 for line in ptx.splitlines() if "wgmma.mma_async" in line and "e4m3" in line),
        async_copies=ttgir.count("ttg.async_copy_global_to_local"),
    )  # fmt: skip


VARIANTS = {"fp8-bf16out": variant}

if __name__ == "__main__":
    report(VARIANTS)
