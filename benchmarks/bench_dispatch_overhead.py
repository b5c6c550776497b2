"""Steady-state cost of fly-lightning's dispatch above a bare custom-op call (CPU is fine; goal: <= 5 us per call).

Both sides call a ``torch.library`` custom op with the same body (ATen's fused RMSNorm on a tiny tensor); ours adds
the dispatcher (signature, cached decision lookup, call count). Also reported: the public ``rms_norm`` entry point
against ``F.rms_norm``, and the dispatcher alone (``Op.__call__`` on a cached decision) without the custom op.

    python -m benchmarks.bench_dispatch_overhead
"""

from __future__ import annotations

import timeit

import torch

import fly_lightning
from benchmarks.harness import Results
from fly_lightning.ops.rms_norm import RMS_NORM, _rms_norm_aten, rms_norm_op


@torch.library.custom_op("fly_bench::bare_rms_norm", mutates_args=())
def bare_op(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, cast: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rms_norm_aten(x, weight, eps, offset, cast)


def per_call_us(fn, number: int = 20000, repeat: int = 7) -> float:
    fn()
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def main() -> None:
    x = torch.randn(2, 64)
    w = torch.randn(64)
    res = Results("dispatch_overhead")
    with fly_lightning.dispatch_config(backends=("aten",)):  # same kernel on both sides: only dispatch differs
        bare = per_call_us(lambda: bare_op(x, w, 1e-6, 0.0, False))
        ours = per_call_us(lambda: rms_norm_op(x, w, 1e-6, 0.0, False))
        direct = per_call_us(lambda: _rms_norm_aten(x, w, 1e-6, 0.0, False))
        op_only = per_call_us(lambda: RMS_NORM(x, w, 1e-6, 0.0, False))
        public = per_call_us(lambda: fly_lightning.rms_norm(x, w, 1e-6))
    f_rms = per_call_us(lambda: torch.nn.functional.rms_norm(x, (64,), w, 1e-6))
    res.add(case="bare custom op (ATen body)", us_per_call=bare)
    res.add(case="fly custom op (dispatch + ATen body)", us_per_call=ours)
    res.add(case="ATen body called directly", us_per_call=direct)
    res.add(case="dispatcher + ATen body, no custom op", us_per_call=op_only)
    res.add(case="fly_lightning.rms_norm (public entry)", us_per_call=public)
    res.add(case="F.rms_norm", us_per_call=f_rms)
    res.summary = {
        "dispatch_overhead_us": ours - bare,
        "dispatcher_alone_us": op_only - direct,
        "goal_us": 5.0,
        "meets_goal": (ours - bare) <= 5.0,
    }
    res.notes.append("min over 7 repeats of the mean of 20000 calls; a 2x64 fp32 tensor, so fixed costs dominate")
    path = res.save()
    print(res.markdown())
    print(f"written {path}")


if __name__ == "__main__":
    main()
