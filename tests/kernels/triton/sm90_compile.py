"""Compile the grouped GEMM kernel for sm_90 without a GPU (Triton's bundled ptxas) and report each variant as JSON.

Run in a process without TRITON_INTERPRET (``test_grouped_mm_sm90.py`` does): under the interpreter ``@triton.jit``
gives interpreted functions that cannot be compiled.
"""

from dataclasses import replace

from _sm90 import compile_sm90 as _compile
from _sm90 import report

from fly_lightning.kernels.triton._grouped_mm_config import CONFIG_TABLE, GroupedMMConfig, tune_candidates
from fly_lightning.kernels.triton._grouped_mm_kernel import _effective_config, _grouped_mm_kernel


def compile_sm90(cfg: GroupedMMConfig, k_major=True, gather=False, scatter=False, tma=None, out="bf16"):
    """Compile as the launcher would run ``cfg`` (its TMA choices and ``_effective_config``)."""
    fn = _grouped_mm_kernel
    tma = cfg.tma if tma is None else tma
    tma_a, tma_store = tma and not gather, tma and cfg.tma_store and not scatter
    cfg = _effective_config(cfg, tma_a, tma, tma_store, interp=False)
    const = dict(
        E_POW2=1024, TABLE=cfg.schedule == "table", LOG2_E=8, TOPK=8 if (gather or scatter) else 1,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, W_K_MAJOR=k_major,
        TMA_A=tma_a, TMA_W=tma, TMA_STORE=tma_store, GATHER=gather, SCATTER=scatter, UPCAST=False,
        WS_K=cfg.warp_specialize == "k", WS_TILES=cfg.warp_specialize == "tiles", FLATTEN=cfg.flatten, INTERPRET=False,
    )  # fmt: skip
    const["stride_wk" if k_major else "stride_wn"] = 1  # the launcher's unit stride, specialised by Triton
    if cfg.specialize:  # Qwen3-30B-A3B's gate/up weight as _constants passes it
        n, k = 1536, 2048
        const.update(SPECIALIZE=True, N_C=n, K_C=k, SXM_C=k, SWE_C=n * k, SWK_C=1 if k_major else n,
                     SWN_C=k if k_major else 1, SOM_C=n)  # fmt: skip
    else:  # the launcher leaves these at their defaults
        const.update(SPECIALIZE=False, N_C=0, K_C=0, SXM_C=0, SWE_C=0, SWK_C=0, SWN_C=0, SOM_C=0)
    sig = {a: "*i32" if a in ("OFFS", "IDX", "TILE_END") else "i32" for a in fn.arg_names}
    sig.update(X="*bf16", W="*bf16", OUT=f"*{out}")
    aligned = ("X", "W", "OUT", "OFFS", "IDX", "TILE_END", "N", "K", "stride_xm", "stride_we", "stride_om")
    kernel, spill_bytes, _ = _compile(fn, sig, const, aligned, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    ttgir = kernel.asm["ttgir"]
    return dict(
        ws_effective=bool(cfg.warp_specialize), shared=kernel.metadata.shared, warps=kernel.metadata.num_warps,
        spill_bytes=spill_bytes,
        specialised=ttgir.count("ttg.warp_specialize") > 0, tma_loads=ttgir.count("async_tma_copy_global_to_local"),
        wgmma=kernel.asm["ptx"].count("wgmma.mma_async"),
    )  # fmt: skip


def variants():
    table = list(dict.fromkeys([*CONFIG_TABLE.values(), *tune_candidates("large"), *tune_candidates("small")]))
    wide = GroupedMMConfig(128, 256, 64, 8, 3, 8)
    out = [(c.label(), c, {}) for c in table]
    # the MoE layer runs the table's configurations with gathered rows (gate/up) and scattered output (down)
    out += [(f"{c.label()}-{mode}", c, {mode: True}) for c in dict.fromkeys(CONFIG_TABLE.values())
            for mode in ("gather", "scatter")]  # fmt: skip
    out += [
        ("N-major", wide, dict(k_major=False)),
        ("gather", wide, dict(gather=True)),
        ("scatter", wide, dict(scatter=True)),
        ("pointer-128x128", GroupedMMConfig(128, 128, 64, 8, 4, 8), dict(tma=False)),
        ("tma-store", replace(wide, tma_store=True), {}),
        ("fp32-out", wide, dict(out="fp32")),
        ("specialize", replace(wide, specialize=True), {}),
        ("specialize-N-major", replace(wide, specialize=True), dict(k_major=False)),
        ("specialize-gather", replace(wide, specialize=True), dict(gather=True)),
        ("specialize-scatter", replace(wide, specialize=True), dict(scatter=True)),
        # warp specialisation asked where the launcher drops it: no TMA store (scatter, or not asked for)
        ("ws-scatter", GroupedMMConfig(128, 256, 64, 8, 3, 4, schedule="table", warp_specialize="tiles",
                                       tma_store=True), dict(scatter=True)),
        ("ws-pointer-store", GroupedMMConfig(128, 256, 64, 8, 3, 4, schedule="table", warp_specialize="tiles"), {}),
    ]  # fmt: skip
    return out


if __name__ == "__main__":
    report({
        name: (lambda cfg=cfg, kw=kw: dict(ws_requested=bool(cfg.warp_specialize), **compile_sm90(cfg, **kw)))
        for name, cfg, kw in variants()
    })  # fmt: skip
