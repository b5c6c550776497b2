"""Probe (GPU): the dense MX GEMM with only the activations dequantised in a prepass and the weights converted in
registers as the MMA's register operand (the weight-only kernel, swapped), against the prepass plan and cuBLAS bf16.
Device time from CUDA-graph replays, side by side. Prints; not a suite."""

from __future__ import annotations

from dataclasses import replace

import torch

import fly_lightning
from benchmarks.harness import probe_graph_ms
from fly_lightning.kernels.triton import mx_scaled_mm as kernel
from fly_lightning.kernels.triton._mx_dequant import dequantize
from fly_lightning.ops.mx_scaled_mm import mx_scaled_mm_reference

SHAPES = [(1024, 28672, 8192), (2048, 4096, 14336), (8192, 1024, 8192), (1024, 4096, 4096), (4096, 14336, 4096)]
CONFIGS = [  # (tokens tile, weights tile, block_k, warps, stages)
    (128, 128, 64, 8, 4),
    (256, 128, 64, 8, 3),
    (128, 256, 64, 8, 3),
    (128, 128, 128, 8, 3),
    (256, 128, 128, 8, 2),
    (64, 128, 128, 4, 4),
]
CALLS = 10


def main() -> None:
    for fmt in ("mxfp8_e4m3", "mxfp4_e2m1"):
        for m, n, k in SHAPES:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            a, a_s = fly_lightning.mx_cast(x, fmt, "floor")
            b, b_s = fly_lightning.mx_cast(w, fmt, "floor")
            ref = mx_scaled_mm_reference(a, a_s, fmt, b, b_s, fmt, torch.float32)
            base = kernel.plan(m, n, k, None, fmt, a.device)
            fns = {
                "prepass": lambda a, a_s, b, b_s, x, w, f=fmt: kernel.launch(a, a_s, f, b, b_s, f, torch.bfloat16),
                "bf16": lambda a, a_s, b, b_s, x, w: torch.mm(x, w.t()),
            }
            for bm, bn, bk, warps, stages in CONFIGS:
                cfg = replace(base, block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages,
                              swap=True, split_k=1, prepass=False)  # fmt: skip

                def half(a, a_s, b, b_s, x, w, cfg=cfg, f=fmt):
                    return kernel.launch(dequantize(a, a_s, f), None, None, b, b_s, f, torch.bfloat16, cfg)

                fns[cfg.label()] = half
            inputs = [(a, a_s, b, b_s, x, w)]
            ms, errs = probe_graph_ms(fns, inputs, ref, f"{fmt} {m}x{n}x{k}", CALLS)
            line = "  ".join(f"{nm}={t * 1e3:.1f}us" + ("!" if errs[nm] > 1e-2 else "") for nm, t in ms.items())
            print(f"{fmt} {m}x{n}x{k}: {line}", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
