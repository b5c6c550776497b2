"""Where an eager call's host time goes (GPU machine; diagnostic, not a suite with goals).

Host microseconds per call for each layer of two paths, outer to inner, on inputs small enough that the host is the
bottleneck (N calls, then one device sync): the MX GEMM's prepass plans (public ``mx_scaled_mm``, the dispatcher, the
kernel module's ``launch``; the bf16 prepass's dequantising launch and cuBLAS; on Hopper the fp8 plan's
re-expression and cuBLAS's blockwise fp8 GEMM) and RMSNorm (public call, dispatcher, Triton launch).
Then a Triton launch through ``JITFunction`` (binder and cache lookup on every call) against the same compiled kernel
launched directly, and the top functions of a ``cProfile`` of each public call. Writes ``host_profile.json``.

    python -m benchmarks.profile_host
"""

from __future__ import annotations

import cProfile
import io
import pstats

import torch

import fly_lightning
from benchmarks.harness import Results, host_us, time_ms
from fly_lightning.kernels.triton import _mx_dequant, _mx_requant
from fly_lightning.kernels.triton import mx_scaled_mm as mx_kernel
from fly_lightning.kernels.triton._math import cdiv

M, N, K = 128, 256, 256  # host-bound: the prepass plan from 128 rows


def _profile(fn, calls: int = 2000, top: int = 25) -> str:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


SUITE_SHAPES = (("mxfp8_e4m3", 1024, 4096, 4096), ("mxfp4_e2m1", 1024, 4096, 4096), ("mxfp4_e2m1", 256, 4096, 4096))
SYNC_CASES = ("mxfp4_e2m1 1024x4096x4096 public", "w4 16x4096x4096 public")


def _suite_cases(dev: str, dtype: torch.dtype) -> dict:
    """Public calls on mx_gemm suite shapes (prepass plans of both formats, weight-only split K), host- and
    event-timed: the suite's event times there ran well above its graph times."""
    cases = {}
    for fmt, m, n, k in (*SUITE_SHAPES, ("w4", 16, 4096, 4096)):
        b_fmt = "mxfp4_e2m1" if fmt == "w4" else fmt
        x = torch.randn(m, k, device=dev, dtype=dtype)
        b, b_s = fly_lightning.mx_cast(torch.randn(n, k, device=dev, dtype=dtype), b_fmt, "floor")
        a, a_s = (x, None) if fmt == "w4" else fly_lightning.mx_cast(x, fmt, "floor")
        a_fmt = None if fmt == "w4" else fmt

        def call(a=a, a_s=a_s, a_fmt=a_fmt, b=b, b_s=b_s, b_fmt=b_fmt):
            return fly_lightning.mx_scaled_mm(a, b, b_s, b_fmt, a_scale=a_s, a_fmt=a_fmt)

        name = f"{fmt} {m}x{n}x{k}"
        cases[f"{name} public"] = call
        cases[f"{name} event"] = lambda call=call: _event_us(call)
        cases[f"{name} dequantize"] = (
            (lambda a=a, a_s=a_s, b=b, b_s=b_s, f=fmt: _mx_dequant.dequantize(a, a_s, f, b, b_s, f))
            if fmt != "w4"
            else (lambda b=b, b_s=b_s, f=b_fmt: _mx_dequant.dequantize(b, b_s, f))
        )
    return cases


def _event_us(fn, reps: int = 50) -> float:
    """Median event time per call as ``harness.time_ms`` takes it (events around each call, no sync between), us."""
    return time_ms(fn, [()], warmup=5, reps=reps)["median_ms"] * 1e3


def _syncs(fn) -> str:
    """What ``torch.cuda.set_sync_debug_mode("warn")`` reports on one call: the operations that waited on the GPU."""
    import warnings

    fn()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return "; ".join(str(w.message)[:200] for w in caught) or "none"


def main() -> None:
    dev, bf16, fmt = "cuda", torch.bfloat16, "mxfp8_e4m3"
    x = torch.randn(M, K, device=dev, dtype=bf16)
    w = torch.randn(N, K, device=dev, dtype=bf16)
    a, a_s = fly_lightning.mx_cast(x, fmt, "floor")
    b, b_s = fly_lightning.mx_cast(w, fmt, "floor")
    op = fly_lightning.get_op("mx_scaled_mm")
    args = (a, a_s, fmt, b, b_s, fmt, bf16)
    da, db = _mx_dequant.dequantize(a, a_s, fmt, b, b_s, fmt)
    qa, sa, qb, sb = _mx_requant.requantize(a, a_s, fmt, b, b_s, fmt)  # the fp8 plan's operands (Hopper)
    xr = torch.randn(16, 4096, device=dev, dtype=bf16)
    wr = torch.randn(4096, device=dev, dtype=bf16)
    rms = fly_lightning.get_op("rms_norm")
    rms_args = (xr, wr, 1e-6, 0.0, False)
    rms_triton = rms.impls["triton"].fn

    # the dequantising launch through JITFunction, then the same compiled kernel launched directly
    c = K
    rows, cols = _mx_dequant.DEQUANT_ROWS, _mx_dequant.DEQUANT_COLS
    grid = ((cdiv(M, rows) + cdiv(N, rows)) * cdiv(c, cols),)  # as dequantize launches: both operands' tiles
    kargs = (
        a.view(torch.uint8), a_s.view(torch.uint8), da, M, a.stride(0), a_s.stride(0), da.stride(0),
        b.view(torch.uint8), b_s.view(torch.uint8), db, N, b.stride(0), b_s.stride(0), db.stride(0), c,
        a_s.view(torch.uint8), 1,  # no group offsets (an unread pointer)
    )  # fmt: skip
    hw = _mx_dequant.hw_cvt(a)  # the constants dequantize passes on this device
    consts = dict(
        A_FMT=1, B_FMT=1, BR=rows, BC=cols, FP32=False, HW_CVT=hw, PTX=hw or _mx_dequant.ptx_pairs(a),
        SKIP_EMPTY=False,
    )  # fmt: skip
    compiled = _mx_dequant._dequant_kernel[grid](*kargs, **consts, num_warps=4)
    direct = compiled[(*grid, 1, 1)]
    all_args = (*kargs, *consts.values())

    cases = {
        "mx_scaled_mm public": lambda: fly_lightning.mx_scaled_mm(
            b=b, b_scale=b_s, b_fmt=fmt, a=a, a_scale=a_s, a_fmt=fmt
        ),
        "mx_scaled_mm dispatcher": lambda: op(*args),
        "mx kernel launch()": lambda: mx_kernel.launch(*args),
        "mx _prepass_mm": lambda: mx_kernel._prepass_mm(*args),
        "dequantize (2 operands)": lambda: _mx_dequant.dequantize(a, a_s, fmt, b, b_s, fmt),
        "dequant kernel via JITFunction": lambda: _mx_dequant._dequant_kernel[grid](*kargs, **consts, num_warps=4),
        "dequant kernel, compiled launch": lambda: direct(*all_args),
        "dequant kernel via FastLaunch": lambda: _mx_dequant._DEQUANT(grid, kargs, **consts, num_warps=4),
        "torch.mm bf16": lambda: torch.mm(da, db.t()),
        "mx requantize (2 operands, fp8 plan)": lambda: _mx_requant.requantize(a, a_s, fmt, b, b_s, fmt),
        "torch._scaled_mm 1x128 (fp8 plan)": lambda: torch._scaled_mm(qa, qb.t(), sa, sb, out_dtype=bf16),
        "torch.empty x2": lambda: (torch.empty(M, K, device=dev), torch.empty(N, K, device=dev)),
        "plan() (cached)": lambda: mx_kernel.plan(M, N, K, fmt, fmt, a.device),
        "rms_norm public": lambda: fly_lightning.rms_norm(xr, wr, 1e-6),
        "rms_norm dispatcher": lambda: rms(*rms_args),
        "rms_norm triton impl": lambda: rms_triton(*rms_args),
        "F.rms_norm": lambda: torch.nn.functional.rms_norm(xr, (4096,), wr, 1e-6),
    }
    cases.update(_suite_cases(dev, bf16))
    res = Results("host_profile")
    for name, fn in cases.items():
        try:
            us = round(fn() if name.endswith(" event") else host_us(fn), 2)  # event cases time themselves
        except Exception as exc:  # noqa: BLE001 (a layer whose private API differs is reported, not fatal)
            us = f"{type(exc).__name__}: {str(exc)[:120]}"
        res.add(case=name, host_us=us)
        print(f"{name:40s} {us} us", flush=True)
    for name in SYNC_CASES:  # a call that waits on the device serialises host and device time in eager steps
        res.details[f"syncs {name}"] = _syncs(cases[name])
    for name in ("mx_scaled_mm public", "rms_norm public", *SYNC_CASES):
        text = _profile(cases[name])
        res.details[f"cprofile {name}"] = text
        print(f"--- cProfile: {name}\n{text}", flush=True)
    res.notes.append(f"MXFP8 {M}x{N}x{K} (prepass plan), RMSNorm [16, 4096] bf16; host_us: 1000 calls, one sync")
    res.notes.append(
        "'<fmt> MxNxK public' (mx_gemm suite shapes): host_us as above; 'event' its mx_gemm-style event time per call "
        "(host and device together); details 'syncs <case>': what set_sync_debug_mode reported on one call"
    )
    res.save()


if __name__ == "__main__":
    main()
