"""Compile every Triton kernel of ours for AMD gfx950 on the CPU, in the variants their launchers pick, and report each
as JSON on stdout (run by ``test_gfx950_compile.py``; the routing kernel has its own, ``moe_route_gfx950_compile.py``).

Nothing here runs on AMD hardware: this shows the kernels build for MI350 without spills, not that they are right or
fast there.
"""

from dataclasses import replace

import torch
from _gfx950 import compile_gfx950
from _sm90 import report

from fly_lightning.kernels.triton import moe_combine, mx_cast, rms_norm, swiglu, topk
from fly_lightning.kernels.triton import mx_fake_quantize as mx_fake_quantize_kernel
from fly_lightning.kernels.triton._grouped_mm_config import PRE_HOPPER_CONFIG, GroupedMMConfig
from fly_lightning.kernels.triton._grouped_mm_kernel import _effective_config, _grouped_mm_kernel
from fly_lightning.kernels.triton._mx_elements import cast_constants


def rms_norm_rows(h: int) -> dict:
    cfg = rms_norm.launch_config(h, 2, True)
    sig = dict(X="*bf16", W="*bf16", Y="*bf16", RSTD="*fp32", n_rows="i32", stride_x="i32", stride_y="i32",
               eps="fp32", offset="fp32")  # fmt: skip
    const = dict(H=h, BLOCK=cfg.block, ROWS=cfg.rows, CHUNKED=cfg.block < h, HAS_W=True, CAST_FIRST=True)
    aligned = ("X", "W", "Y", "RSTD", "stride_x", "stride_y")
    return compile_gfx950(rms_norm._rms_norm_rows, sig, const, aligned, num_warps=cfg.num_warps)


def rms_norm_unaligned(h: int) -> dict:
    cfg = rms_norm.launch_config(h, 2, True)
    sig = dict(X="*bf16", W="*bf16", Y="*bf16", RSTD="*fp32", eps="fp32", offset="fp32")
    const = dict(H=h, VEC=8, BLOCK=cfg.block, HAS_W=True, CAST_FIRST=False)
    return compile_gfx950(rms_norm._rms_norm_unaligned, sig, const, ("X", "W", "Y", "RSTD"), num_warps=4)


def swiglu_fwd(i: int, act: int = 0) -> dict:
    bt, bi = swiglu._plan(i)
    sig = dict(G="*bf16", stride_g="i32", U="*bf16", stride_u="i32", Y="*bf16", S="i32", N="i32")
    aligned = ("G", "U", "Y", "stride_g", "stride_u", "N")
    return compile_gfx950(swiglu._swiglu_fwd, sig, dict(BT=bt, BI=bi, ACT=act), aligned, num_warps=4)


def combine(h: int, k: int) -> dict:
    bt, bh = moe_combine._plan(h, 2)
    sig = dict(ROWS="*bf16", stride_r="i32", W="*fp32", stride_wt="i32", stride_wk="i32", IDX="*i32", Y="*bf16",
               stride_y="i32", T="i32", H="i32")  # fmt: skip
    const = dict(K=k, BT=bt, BH=bh, HAS_INDEX=True)
    aligned = ("ROWS", "W", "IDX", "Y", "stride_r", "stride_y", "H")
    return compile_gfx950(moe_combine._moe_combine_fwd, sig, const, aligned, num_warps=moe_combine.NUM_WARPS)


def dispatch(h: int, k: int) -> dict:
    bs, bh = moe_combine._plan(h, 2)
    sig = dict(X="*bf16", stride_x="i32", W="*fp32", PERM="*i32", Y="*bf16", stride_y="i32", S="i32", H="i32")
    const = dict(TOPK=k, BS=bs, BH=bh, HAS_W=True)
    aligned = ("X", "W", "PERM", "Y", "stride_x", "stride_y", "H")
    return compile_gfx950(moe_combine._moe_dispatch_fwd, sig, const, aligned, num_warps=moe_combine.NUM_WARPS)


def topk_fwd(n: int, k: int, dtype: torch.dtype) -> dict:
    _, const = topk._plan(n, k, dtype, n, 4096, None)
    const = dict(const)
    num_warps = const.pop("num_warps")
    ptr = "*fp32" if dtype == torch.float32 else "*bf16"
    sig = dict(X=ptr, stride_x="i32", V_OUT=ptr, I_OUT="*i64", R="i32")
    return compile_gfx950(topk._topk_fwd, sig, const, ("X", "V_OUT", "I_OUT", "stride_x"), num_warps=num_warps)


def mx_cast_rows(fmt: str, bf16: bool) -> dict:
    sig = dict(X="*i16" if bf16 else "*fp32", stride_x="i32", DATA="*u8", SCALE="*u8", R="i32", K="i32")
    # HW=False: on ROCm the launcher rounds by integer arithmetic (mx_cast._hw_cvt), bf16 loaded as its bits
    dtype = torch.bfloat16 if bf16 else torch.float32
    const = dict(cast_constants("mx_cast", fmt, "floor", dtype, hw=False), BR=16, G=8)
    return compile_gfx950(mx_cast._mx_cast_rows, sig, const, ("X", "DATA", "SCALE", "stride_x", "K"), num_warps=4)


def mx_cast_cols(fmt: str, mode: str) -> dict:
    """The column-wise cast (ROCm: integer rounding, bf16 as its bits)."""
    sig = dict(X="*i16", stride_x="i32", DATA="*u8", SCALE="*u8", K="i32", N="i32")
    const = dict(cast_constants("mx_cast", fmt, mode, torch.bfloat16, hw=False), BN=64, G=2)
    return compile_gfx950(mx_cast._mx_cast_cols, sig, const, ("X", "DATA", "SCALE", "stride_x", "N"), num_warps=4)


def mx_fake_quantize(fmt: str, mode: str, cols: bool) -> dict:
    """Fake quantisation from bf16 (ROCm: integer rounding there and back, bf16 as its bits), rows or columns."""
    fn = mx_fake_quantize_kernel._fake_quant_cols if cols else mx_fake_quantize_kernel._fake_quant_rows
    sig = dict(X="*i16", stride_x="i32", OUT="*i16", **({"K": "i32", "N": "i32"} if cols else {"R": "i32", "K": "i32"}))
    const = dict(cast_constants("mx_fake_quantize", fmt, mode, torch.bfloat16, hw=False), G=2 if cols else 8)
    const["BN" if cols else "BR"] = 64 if cols else 16
    return compile_gfx950(fn, sig, const, ("X", "OUT", "stride_x", "N" if cols else "K"), num_warps=4)


def mx_cast_fp4_pairs() -> dict:
    """bf16 -> MXFP4 as the launcher runs it on ROCm: pairs, without the PTX conversion (``PTX=False``)."""
    sig = dict(X="*i32", stride_x="i32", DATA="*u8", SCALE="*u8", R="i32", K="i32")
    const = dict(BR=16, G=8, PTX=False, RCEIL=False)
    return compile_gfx950(mx_cast._mx_cast_fp4_pairs, sig, const, ("X", "DATA", "SCALE", "stride_x", "K"), num_warps=4)


def grouped(cfg: GroupedMMConfig, gather: bool = False, scatter: bool = False) -> dict:
    """As the launcher runs ``cfg`` on ROCm: the pointer path (``tma_available`` is False there)."""
    cfg = _effective_config(replace(cfg, tma=False, tma_store=False), False, False, False, interp=False)
    const = dict(
        E_POW2=1024, TABLE=cfg.schedule == "table", LOG2_E=8, TOPK=8 if (gather or scatter) else 1,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, W_K_MAJOR=True,
        TMA_A=False, TMA_W=False, TMA_STORE=False, GATHER=gather, SCATTER=scatter, UPCAST=False, WS_K=False,
        WS_TILES=False, FLATTEN=cfg.flatten, INTERPRET=False, stride_wk=1, SPECIALIZE=False, N_C=0, K_C=0, SXM_C=0,
        SWE_C=0, SWK_C=0, SWN_C=0, SOM_C=0,
    )  # fmt: skip
    fn = _grouped_mm_kernel
    sig = {a: "*i32" if a in ("OFFS", "IDX", "TILE_END") else "i32" for a in fn.arg_names}
    sig.update(X="*bf16", W="*bf16", OUT="*bf16")
    aligned = ("X", "W", "OUT", "OFFS", "IDX", "TILE_END", "N", "K", "stride_xm", "stride_we", "stride_om")
    return compile_gfx950(fn, sig, const, aligned, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


VARIANTS = {
    "rms_norm-rows-4096": lambda: rms_norm_rows(4096),
    "rms_norm-rows-2048": lambda: rms_norm_rows(2048),
    "rms_norm-unaligned-4097": lambda: rms_norm_unaligned(4097),
    "swiglu-768": lambda: swiglu_fwd(768),
    "swiglu-14336": lambda: swiglu_fwd(14336),
    "swiglu-1536-gelu": lambda: swiglu_fwd(1536, act=1),
    "swiglu-1536-gelu_tanh": lambda: swiglu_fwd(1536, act=2),
    "moe_combine-h2048-k8": lambda: combine(2048, 8),
    "moe_dispatch-h2048-k8": lambda: dispatch(2048, 8),
    "topk-128-k8-fp32": lambda: topk_fwd(128, 8, torch.float32),
    "topk-64-k8-bf16": lambda: topk_fwd(64, 8, torch.bfloat16),
    "mx_cast-mxfp8_e4m3-bf16": lambda: mx_cast_rows("mxfp8_e4m3", True),
    "mx_cast-mxfp4_e2m1-fp32": lambda: mx_cast_rows("mxfp4_e2m1", False),
    "mx_cast-mxfp4_e2m1-bf16-pairs": mx_cast_fp4_pairs,
    "mx_cast-mxfp8_e4m3-cols-rceil": lambda: mx_cast_cols("mxfp8_e4m3", "rceil"),
    "mx_cast-mxfp4_e2m1-cols": lambda: mx_cast_cols("mxfp4_e2m1", "floor"),
    "mx_fake_quantize-mxfp8_e4m3-rows-rceil": lambda: mx_fake_quantize("mxfp8_e4m3", "rceil", cols=False),
    "mx_fake_quantize-mxfp4_e2m1-cols": lambda: mx_fake_quantize("mxfp4_e2m1", "floor", cols=True),
    "grouped_mm-pre-hopper": lambda: grouped(PRE_HOPPER_CONFIG),
    "grouped_mm-pre-hopper-gather": lambda: grouped(PRE_HOPPER_CONFIG, gather=True),
    "grouped_mm-pre-hopper-scatter": lambda: grouped(PRE_HOPPER_CONFIG, scatter=True),
}

if __name__ == "__main__":
    report(VARIANTS)
