"""Host cost of fly-lightning's dispatch per call (goal: <= 5 us above a bare custom op), and, on a GPU machine, the
host time of each public op's eager call with its kernel launch.

CPU cases: both sides call a ``torch.library`` custom op with the same body (ATen's fused RMSNorm on a tiny tensor);
ours adds the dispatcher (signature, cached decision lookup, call count). Also: the public ``rms_norm`` entry point
against ``F.rms_norm``, and the dispatcher alone (the op's call on a cached decision) without the custom op.

CUDA cases (GPU machine): the public ops on small inputs, so that the host is the bottleneck: N calls, then one
device sync, per call. These include the launch of the Triton kernels and their per-call planning. The MX GEMM
cases: MXFP8 x MXFP8 at 128 rows (the dequantising prepass, then cuBLAS) and weight-only MXFP4 at 16 rows (K split
across programs).

``--against DIR`` times the same cases for another copy of the package (``DIR/fly_lightning``, e.g. the previous
revision laid out as an install does) in alternating processes, rounds in turn, and reports both side by side.

    python -m benchmarks.bench_dispatch_overhead                        # writes dispatch_overhead.*
    python -m benchmarks.bench_dispatch_overhead --against /tmp/old     # adds the other tree's column
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import timeit
from collections.abc import Callable

import torch

import fly_lightning
from benchmarks.harness import Results, host_us
from fly_lightning.ops.rms_norm import rms_norm_op

RMS_NORM = fly_lightning.get_op("rms_norm")
ATEN_BODY = RMS_NORM.impls["aten"].fn  # what the aten backend runs: ATen's fused RMSNorm
ROUNDS = 2


@torch.library.custom_op("fly_bench::bare_rms_norm", mutates_args=())
def bare_op(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, cast: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return ATEN_BODY(x, weight, eps, offset, cast)


def per_call_us(fn: Callable[[], object], number: int = 5000, repeat: int = 5) -> float:
    fn()
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def cpu_cases() -> dict[str, float]:
    x, w = torch.randn(2, 64), torch.randn(64)
    with fly_lightning.dispatch_config(backends=("aten",)):  # same kernel on both sides: only dispatch differs
        out = {
            "bare custom op (ATen body)": per_call_us(lambda: bare_op(x, w, 1e-6, 0.0, False)),
            "fly custom op (dispatch + ATen body)": per_call_us(lambda: rms_norm_op(x, w, 1e-6, 0.0, False)),
            "ATen body called directly": per_call_us(lambda: ATEN_BODY(x, w, 1e-6, 0.0, False)),
            "dispatcher + ATen body, no custom op": per_call_us(lambda: RMS_NORM(x, w, 1e-6, 0.0, False)),
            "fly_lightning.rms_norm (public entry)": per_call_us(lambda: fly_lightning.rms_norm(x, w, 1e-6)),
        }
    out["F.rms_norm"] = per_call_us(lambda: torch.nn.functional.rms_norm(x, (64,), w, 1e-6))
    return out


def cuda_cases() -> dict[str, float]:
    """Public eager calls on small CUDA inputs (Triton kernels where supported), host time per call."""
    dev, bf16 = "cuda", torch.bfloat16
    x = torch.randn(16, 4096, device=dev, dtype=bf16)
    w = torch.randn(4096, device=dev, dtype=bf16)
    xg = x.clone().requires_grad_()
    e, h, n, t, k = 8, 512, 512, 128, 2
    a = torch.randn(t * k, h, device=dev, dtype=bf16)
    wg = torch.randn(e, h, n, device=dev, dtype=bf16)
    offs = torch.arange(1, e + 1, device=dev, dtype=torch.int32) * (t * k // e)
    tokens = torch.randn(t, h, device=dev, dtype=bf16)
    logits = torch.randn(t, 64, device=dev)
    perm = torch.randperm(t * k, device=dev).to(torch.int32)
    route_k = 8
    fp8, fp4 = "mxfp8_e4m3", "mxfp4_e2m1"
    xm, wm = torch.randn(128, 256, device=dev, dtype=bf16), torch.randn(256, 256, device=dev, dtype=bf16)
    a8, a8_s = fly_lightning.mx_cast(xm, fp8, "floor")
    b8, b8_s = fly_lightning.mx_cast(wm, fp8, "floor")
    w4, w4_s = fly_lightning.mx_cast(torch.randn(4096, 4096, device=dev, dtype=bf16), fp4, "floor")
    return {
        "cuda rms_norm [16, 4096] bf16": host_us(lambda: fly_lightning.rms_norm(x, w, 1e-6)),
        "cuda rms_norm, x requires grad": host_us(lambda: fly_lightning.rms_norm(xg, w, 1e-6)),
        "cuda F.rms_norm [16, 4096] bf16": host_us(lambda: torch.nn.functional.rms_norm(x, (4096,), w, 1e-6)),
        "cuda grouped_mm [256, 512] x [8, 512, 512]": host_us(lambda: fly_lightning.grouped_mm(a, wg, offs)),
        "cuda moe_grouped_mm, gathered rows": host_us(
            lambda: fly_lightning.moe_grouped_mm(tokens, wg, offs, perm, topk=k, gather=True)
        ),
        "cuda torch._grouped_mm (same shapes)": host_us(lambda: torch._grouped_mm(a, wg, offs=offs)),
        "cuda moe_route [128, 64] top-8 + permutation": host_us(
            lambda: fly_lightning.moe_route(logits, route_k, return_permutation=True)
        ),
        "cuda mx_cast MXFP8 [16, 4096]": host_us(lambda: fly_lightning.mx_cast(x, fp8, "floor")),
        "cuda mx_scaled_mm MXFP8 [128, 256] x [256, 256]": host_us(
            lambda: fly_lightning.mx_scaled_mm(a8, b8, b8_s, fp8, a_scale=a8_s, a_fmt=fp8)
        ),
        "cuda mx_scaled_mm bf16 x MXFP4 [16, 4096] x [4096, 4096]": host_us(
            lambda: fly_lightning.mx_scaled_mm(x, w4, w4_s, fp4)
        ),
        "cuda torch.mm bf16 [128, 256] x [256, 256]": host_us(lambda: torch.mm(xm, wm.t())),
    }


def measure() -> dict[str, float]:
    out = cpu_cases()
    if torch.cuda.is_available():
        out.update(cuda_cases())
    return out


def _measure_in(site: str | None) -> dict[str, float]:
    """``measure()`` in a fresh process, with ``site`` first on the path (another copy of the package) if given."""
    env = os.environ.copy()
    if site:
        env["PYTHONPATH"] = os.pathsep.join([site, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "benchmarks.bench_dispatch_overhead", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="measure in this process and print the cases as JSON")
    p.add_argument("--against", metavar="DIR", help="another copy of the package to time in alternating processes")
    args = p.parse_args()
    if args.json:
        print(json.dumps(measure()))
        return
    res = Results("dispatch_overhead")
    if args.against:
        runs: dict[str, list[dict[str, float]]] = {"this": [], "other": []}
        for r in range(ROUNDS):
            for side in ("this", "other") if r % 2 == 0 else ("other", "this"):
                runs[side].append(_measure_in(args.against if side == "other" else None))
        med = {s: {c: statistics.median(m[c] for m in ms) for c in ms[0]} for s, ms in runs.items()}
        cases = med["this"]
        for case, us in cases.items():
            other = med["other"].get(case)
            res.add(case=case, us_per_call=us, other_us_per_call=other, this_over_other=us / other if other else None)
        res.notes.append(
            f"this tree against {args.against} ({os.environ.get('FLY_AGAINST_REV', 'unnamed revision')}): "
            f"{ROUNDS} processes each, alternating, median per case"
        )
    else:
        cases = measure()
        for case, us in cases.items():
            res.add(case=case, us_per_call=us)
    overhead = cases["fly custom op (dispatch + ATen body)"] - cases["bare custom op (ATen body)"]
    res.summary = {
        "dispatch_overhead_us": overhead,
        "dispatcher_alone_us": cases["dispatcher + ATen body, no custom op"] - cases["ATen body called directly"],
        "goal_us": 5.0,
        "meets_goal": overhead <= 5.0,
    }
    res.notes.append(
        "CPU cases: min over 5 repeats of the mean of 5000 calls on a 2x64 fp32 tensor (fixed costs dominate); CUDA "
        "cases: best of 5 repeats of 1000 calls and one device sync"
    )
    path = res.save()
    print(res.markdown())
    print(f"written {path}")


if __name__ == "__main__":
    main()
