"""The machine's roofs for the grouped-GEMM goal (GPU): the fastest bf16 GEMM rate any kernel reaches here, and the
copy bandwidth.

Why: the grouped-GEMM goal is 1.2x over the Triton peer. ``benchmarks/goal_bounds.py`` turns these two roofs into a
per-case roofline time, ``max(FLOPs / best rate, bytes / copy bandwidth)``, and asks how close to it a kernel must
run to meet the goal. A roof is only as good as the search for it, so the rate is the best of:

- cuBLAS (``torch.mm``) on the distinct problems of the suite's 24 cases as one dense GEMM each (no groups: the same
  FLOPs, one weight), with the weight in both layouts, and on large square and rectangular problems;
- our grouped kernel with a single group on the large problems (``grouped_mm`` with one expert).

Steady state (device events, rotating inputs past the L2, warm-up first), bf16 in and out, fp32 accumulation.

    python -m benchmarks.bench_gemm_roof    # writes gemm_roof.*
"""

from __future__ import annotations

import torch

from benchmarks.grouped_mm_cases import cases
from benchmarks.harness import Results, copy_bandwidth_gbps, rotation_count, time_ms
from fly_lightning import grouped_mm

LARGE = [(4096, 4096, 4096), (8192, 8192, 8192), (16384, 8192, 8192), (8192, 8192, 28672), (16384, 16384, 16384),
         (32768, 4096, 14336), (65536, 2048, 2048)]  # fmt: skip


def _inputs(m: int, k: int, n: int, k_major: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn((n, k) if k_major else (k, n), device="cuda", dtype=torch.bfloat16, generator=gen) * k**-0.5
    return a, (b.t() if k_major else b)


def _rate(fn, m: int, k: int, n: int, k_major: bool) -> tuple[float, float]:
    """(median ms, TFLOP/s) of ``fn(a, b)`` over rotating input sets."""
    sets = [_inputs(m, k, n, k_major, s) for s in range(rotation_count(2 * (m * k + k * n + m * n), 1))]
    ms = time_ms(fn, sets, warmup=5, reps=50)["median_ms"]
    return ms, 2.0 * m * k * n / ms / 1e9


def _fly_dense(m: int):
    """``grouped_mm`` with one expert taking all ``m`` rows (offsets made once, outside the timing)."""
    offs = torch.tensor([m], device="cuda", dtype=torch.int32)
    return lambda a, b: grouped_mm(a, b.unsqueeze(0), offs)


def main() -> None:
    res = Results("gemm_roof")
    problems = {(c.m, c.k, c.n): "suite: " + c.name for c in cases()}
    problems.update({p: "large" for p in LARGE})
    best: dict[str, tuple[float, str]] = {}
    for (m, k, n), origin in problems.items():
        for k_major in (True, False):
            row = dict(M=m, K=k, N=n, w_layout="[N,K]^T" if k_major else "[K,N]", origin=origin)
            row["cublas_ms"], row["cublas_tflops"] = (round(v, 4) for v in _rate(torch.mm, m, k, n, k_major))
            if origin == "large":
                row["fly_ms"], row["fly_tflops"] = (round(v, 4) for v in _rate(_fly_dense(m), m, k, n, k_major))
            res.add(**row)
            for impl in ("cublas", "fly"):
                rate = row.get(f"{impl}_tflops")
                if rate and rate > best.get(impl, (0.0, ""))[0]:
                    best[impl] = (rate, f"{m}x{k}x{n} {row['w_layout']}")
    res.summary["copy_GBps"] = round(copy_bandwidth_gbps(), 1)
    for impl, (rate, where) in best.items():
        res.summary[f"best_{impl}_tflops"] = rate
        res.summary[f"best_{impl}_at"] = where
    res.summary["best_tflops"] = max(rate for rate, _ in best.values())
    res.notes += [
        "TFLOP/s = 2*M*K*N / median time; cublas = torch.mm, fly = grouped_mm with one expert (our Triton kernel).",
        "copy_GBps: device-to-device copy, bytes read + written (harness.copy_bandwidth_gbps).",
        "best_tflops is the compute roof goal_bounds.py uses: the fastest rate measured here, not the datasheet's.",
    ]
    res.save()


if __name__ == "__main__":
    main()
