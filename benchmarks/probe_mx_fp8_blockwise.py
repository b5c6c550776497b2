"""Probe (GPU): MX operands re-expressed as fp8 e4m3 with one fp32 scale per 128 values along K, multiplied by
cuBLAS's blockwise-scaled fp8 GEMM (``torch._scaled_mm``, 1x128 x 1x128 scales, sm90, CUDA >= 12.9), against the
prepass plan (bf16 copies, cuBLAS bf16) and cuBLAS bf16 on the dequantised operands.

Re-expression: each 128-wide group takes the largest of its four E8M0 scales; the elements of the other blocks are
shifted down by the difference (a power of two). Exact for e2m1 elements when the difference is at most 8, for e4m3
elements unless a shifted value falls below e4m3's subnormal step (2^-9 of the group's scale). The re-expression here
is plain torch (not timed); the GEMM alone is timed, then the GEMM plus an estimate of a bandwidth-bound
re-expression pass is left to the reader from the printed bytes.

Device time from CUDA-graph replays, side by side; relative errors against the fp32 product of the dequantised
operands. Prints; not a suite.

    python -m benchmarks.probe_mx_fp8_blockwise
"""

from __future__ import annotations

import torch

import fly_lightning
from benchmarks.harness import probe_graph_ms
from fly_lightning.ops.mx_scaled_mm import mx_scaled_mm_reference
from fly_lightning.quant.formats import from_mx

SHAPES = [
    (1024, 4096, 4096), (1024, 28672, 8192), (2048, 6144, 4096), (2048, 4096, 14336), (4096, 4096, 4096),
    (4096, 14336, 4096), (8192, 8192, 8192), (8192, 1024, 8192), (16384, 4096, 4096), (256, 4096, 4096),
]  # fmt: skip
FORMATS = ("mxfp8_e4m3", "mxfp4_e2m1")


def requant(data: torch.Tensor, scale: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(e4m3 [R, K], fp32 group scales [R, K/128] outer-dim-major, largest in-group scale difference)."""
    v = from_mx(data, scale, fmt, torch.float32)
    r, k = v.shape
    e = scale.view(torch.uint8).to(torch.int32).view(r, k // 128, 4)
    top = e.amax(-1)
    spread = int((top - e.amin(-1)).max())
    g = torch.exp2((top - 127).float())
    q = (v.view(r, k // 128, 128) / g[..., None]).to(torch.float8_e4m3fn).view(r, k)
    return q, g.t().contiguous().t(), spread


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__, torch.version.cuda, flush=True)
    torch.manual_seed(0)
    for fmt in FORMATS:
        for m, n, k in SHAPES:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            a, a_s = fly_lightning.mx_cast(x, fmt, "floor")
            b, b_s = fly_lightning.mx_cast(w, fmt, "floor")
            qa, ga, sa = requant(a, a_s, fmt)
            qb, gb, sb = requant(b, b_s, fmt)
            xa, xb = from_mx(a, a_s, fmt, torch.bfloat16), from_mx(b, b_s, fmt, torch.bfloat16)
            ref = mx_scaled_mm_reference(a, a_s, fmt, b, b_s, fmt, torch.float32)
            inputs = [(a, a_s, b, b_s, qa, ga, qb, gb, xa, xb)]

            def ours(a, a_s, b, b_s, *_, fmt=fmt):
                return fly_lightning.mx_scaled_mm(a, b, b_s, fmt, a_scale=a_s, a_fmt=fmt)

            def bf16(*t):
                return torch.mm(t[8], t[9].t())

            def fp8(a, a_s, b, b_s, qa, ga, qb, gb, *_, fast=False):
                return torch._scaled_mm(qa, qb.t(), ga, gb.t(), out_dtype=torch.bfloat16, use_fast_accum=fast)

            fns = {"ours": ours, "bf16": bf16, "fp8_blockwise": fp8}
            fns["fp8_blockwise_fast"] = lambda *t: fp8(*t, fast=True)
            label = f"{fmt} {m}x{n}x{k}"
            try:
                ms, errs = probe_graph_ms(fns, inputs, ref, label)
            except Exception as exc:  # noqa: BLE001 (report and go on)
                print(f"{label}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            y32 = torch._scaled_mm(qa, qb.t(), ga, gb.t(), out_dtype=torch.float32)
            err32 = ((y32 - ref).norm() / ref.norm()).item()
            cols = "  ".join(f"{name} {t * 1e3:7.1f}us err {errs[name]:.2e}" for name, t in ms.items())
            gain = ms["bf16"] / ms.get("fp8_blockwise", float("nan"))
            print(f"{label:28s} spread {sa}/{sb}  {cols}  bf16/fp8 {gain:.2f}  fp32-out err {err32:.2e}", flush=True)


if __name__ == "__main__":
    main()
