"""Probe (GPU): why some event-timed ``mx_scaled_mm`` cases of the mx_gemm suite exceed device time plus host time.

At b71629c (H200) MXFP8 2048x6144x4096 timed 0.248 ms per call with events against 0.162 ms of device time (graph
replays) and about 80 us of host time, while MXFP4 at that shape timed 0.147 against 0.167. For each case below,
with the suite's operands (rotated sets) and its per-round pattern (two warm-up calls, a sync, then timed calls):

- ``event_ms``: every timed call's event time, per round, as ``harness.time_ms`` records them;
- ``host_us``: the host's time for each of those calls (``perf_counter`` around the call);
- ``single_set``: the same with one operand set (no rotation);
- ``interleaved``: ``harness.interleaved_ms`` of ours beside bf16, as the suite times them;
- ``trace``: one profiled round: the CUDA runtime calls the host made (counted by name) and each GPU kernel's start
  relative to the round's first kernel, with its duration and the idle gap before it.

At 0fbac22 (H100) it also ran the suite's own ``run_case`` on each case first: suite event times equal to device time
where the device is the bottleneck (MXFP8 2048x6144x4096: 0.162 ms, 0.173 in graph replays), host-bound at
1024x4096x4096 (0.122 ms, 110-120 us of host time per call); the b71629c H200 excess was not reproduced.

    python -m benchmarks.probe_mx_event            # prints; writes probe_mx_event.json under FLY_RESULTS_DIR
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import fly_lightning
from benchmarks.harness import environment, interleaved_ms, rotation_count

FORMATS = {"mxfp8": "mxfp8_e4m3", "mxfp4": "mxfp4_e2m1"}  # the mx_gemm suite's
CASES = [("mxfp8", 2048, 6144, 4096), ("mxfp4", 2048, 6144, 4096), ("mxfp8", 1024, 4096, 4096)]
ROUNDS, REPS = 5, 8


def _inputs(kind: str, m: int, n: int, k: int) -> list[tuple]:
    fmt = FORMATS[kind]
    per_elem = {"mxfp4_e2m1": 0.5}.get(fmt, 1.0) + 1 / 32
    sets = rotation_count(int((m + n) * k * per_elem), max_sets=48)
    out = []
    for _ in range(sets):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        a, a_s = fly_lightning.mx_cast(x, fmt, "floor")
        b, bs = fly_lightning.mx_cast(w, fmt, "floor")
        out.append((x, w, a, a_s, b, bs))
    return out


def _round(fn, inputs: list[tuple], start: int) -> tuple[list[float], list[float]]:
    """harness.time_ms's pattern (two warm-up calls, a sync, timed calls), keeping every call."""
    for i in range(2):
        fn(*inputs[(start + i) % len(inputs)])
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(REPS)]
    host = []
    for i, (s, e) in enumerate(events):
        args = inputs[(start + 2 + i) % len(inputs)]
        t0 = time.perf_counter()
        s.record()
        fn(*args)
        e.record()
        host.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return [round(s.elapsed_time(e), 4) for s, e in events], [round(h, 1) for h in host]


def _trace(fn, inputs: list[tuple]) -> dict:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _round(fn, inputs, 0)
    runtime, kernels = Counter(), []
    for ev in prof.events():
        name = ev.name
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels.append((ev.time_range.start, ev.time_range.end, name[:60]))
        elif name.startswith(("cuda", "cu")) and not name.startswith("cudaGetDevice"):
            runtime[name] += 1
    kernels.sort()
    rows, prev_end = [], kernels[0][0] if kernels else 0
    t0 = prev_end
    for s, e, name in kernels:
        gap = round(s - prev_end, 1)
        rows.append({"kernel": name, "start_us": round(s - t0, 1), "dur_us": round(e - s, 1), "gap_us": gap})
        prev_end = max(prev_end, e)
    return {"runtime_calls": dict(runtime.most_common(20)), "kernels": rows}


def main() -> None:
    report = {"environment": environment(), "cases": {}}
    for kind, m, n, k in CASES:
        fmt = FORMATS[kind]
        inputs = _inputs(kind, m, n, k)

        def ours(x, w, a, a_s, b, bs, fmt=fmt):
            return fly_lightning.mx_scaled_mm(a, b, bs, fmt, a_scale=a_s, a_fmt=fmt)

        def bf16(x, w, a, a_s, b, bs):
            return torch.mm(x, w.t())

        case = f"{kind} {m}x{n}x{k}"
        rot = [_round(ours, inputs, r * (REPS + 2)) for r in range(ROUNDS)]
        one = [_round(ours, inputs[:1], 0) for _ in range(ROUNDS)]
        inter = interleaved_ms({"ours": ours, "bf16": bf16}, inputs, reps=40)
        row = {
            "sets": len(inputs),
            "event_ms": [r[0] for r in rot],
            "host_us": [r[1] for r in rot],
            "event_median_ms": statistics.median(t for r in rot for t in r[0]),
            "host_median_us": statistics.median(t for r in rot for t in r[1]),
            "single_set": {"event_ms": [r[0] for r in one], "host_us": [r[1] for r in one]},
            "single_set_median_ms": statistics.median(t for r in one for t in r[0]),
            "interleaved": inter,
            "trace": _trace(ours, inputs),
        }
        report["cases"][case] = row
        print(
            f"== {case}: sets {len(inputs)}, event median {row['event_median_ms']:.4f} ms, single set "
            f"{row['single_set_median_ms']:.4f}, interleaved {inter}",
            flush=True,
        )
        for r in rot[:2]:
            print("  event", r[0], "host", r[1], flush=True)
        print("  runtime", row["trace"]["runtime_calls"], flush=True)
        for kr in row["trace"]["kernels"][:12]:
            print("  ", kr, flush=True)
    out = Path(os.environ.get("FLY_RESULTS_DIR", ".")) / "probe_mx_event.json"
    out.write_text(json.dumps(report, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
