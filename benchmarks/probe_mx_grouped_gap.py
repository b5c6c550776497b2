"""Probe (GPU): where the mx_grouped_mm suite's "ours" loses to its "prepass" column on Mixtral's gate_up (MXFP8:
0.795x against 0.865x bf16 in two H100 runs, although both run the bf16 prepass plan; MXFP4 equal).

Each layer of the public call timed side by side on the suite's operands (``harness.interleaved_ms``, rounds as the
suite's), outer to inner: the public ``mx_grouped_mm``, the dispatcher, the Triton backend function, the kernel
module's ``launch`` with the plan's pick and with ``PREPASS`` named (the suite's prepass column), and the bf16 grouped
GEMM. Per layer also the caching allocator's device allocations and retries over its timed calls (a fresh
``cudaMalloc`` of the 1.9 GB bf16 weights per call would cost about what is missing). Prints; not a suite.

Printed on the H100 (5d3b7b1), ms, public / dispatcher / Triton function / launch (plan) / launch (PREPASS): gate_up
MXFP8 6.66 / 6.51 / 6.15 / 6.00 / 5.96 (bf16 4.93), MXFP4 5.82 / 5.75 / 5.64 / 5.62 / 5.66; gate_up zipf1.2 MXFP8
6.40 / 6.73 / 6.49 / 6.25 / 6.29; down MXFP8 3.16 / 3.18 / 3.15 / 3.18 / 3.18. Every layer runs the same plan (the
bf16 prepass) and adds host microseconds only; over four calls per layer the allocator made one device allocation
(the first layer's first call) and no retries. So the gap is in the timing of these 6 ms calls with their 1.9 GB
temporaries (up to 12% between layers that queue the same device work), not in the public path; its cause is not
found.

    python -m benchmarks.probe_mx_grouped_gap [--only mixtral-8x7b]
"""

from __future__ import annotations

import argparse

import torch

import fly_lightning
from benchmarks.grouped_mm_cases import cases, make_inputs, mx_weights
from benchmarks.harness import interleaved_ms
from fly_lightning.kernels.triton import _mx_grouped_mm_kernel as mk
from fly_lightning.kernels.triton.mx_grouped_mm import mx_grouped_mm_triton

FORMATS = {"fp8": "mxfp8_e4m3", "fp4": "mxfp4_e2m1"}
REPS, ROUNDS = 12, 4  # as the suite times its columns


def _layers(xd, xs, wd, ws, offs, fmt: str) -> dict:
    op = fly_lightning.get_op("mx_grouped_mm")
    args = (xd, xs, fmt, wd, ws, fmt, offs, torch.bfloat16)

    def out():
        return torch.empty(xd.shape[0], wd.shape[1], dtype=torch.bfloat16, device=xd.device)

    return {
        "public": lambda: fly_lightning.mx_grouped_mm(xd, wd, ws, fmt, offs, x_scale=xs, x_fmt=fmt),
        "dispatcher": lambda: op(*args),
        "triton fn": lambda: mx_grouped_mm_triton(*args),
        "launch (plan)": lambda: mk.launch(*args[:-1], out()),
        "launch (PREPASS)": lambda: mk.launch(*args[:-1], out(), config=mk.PREPASS),
    }


def _allocs(fn, calls: int = 4) -> str:
    before = torch.cuda.memory_stats()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    keys = ("num_device_alloc", "num_device_free", "num_alloc_retries")
    return " ".join(f"{k.removeprefix('num_')}={after.get(k, 0) - before.get(k, 0)}" for k in keys)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="mixtral-8x7b", help="cases whose name contains this")
    args = p.parse_args()
    for case in cases():
        if args.only not in case.name:
            continue
        x, w, offs = make_inputs(case, "cuda", seed=0)
        fns = {"bf16": lambda x=x, w=w, offs=offs: fly_lightning.grouped_mm(x, w, offs)}
        for f, fmt in FORMATS.items():
            xd, xs = fly_lightning.mx_cast(x, fmt)
            wd, ws = mx_weights(w, fmt)
            print(f"{case.name} {f}: plan {mk.choose_config(case.m, case.e, False, fmt, fmt, True).label()}")
            for name, fn in _layers(xd, xs, wd, ws, offs, fmt).items():
                fns[f"{f} {name}"] = fn
        allocs = {name: _allocs(fn) for name, fn in fns.items()}
        # offs in the inputs: the harness times on the device the inputs are on (events on CUDA)
        times = interleaved_ms({n: (lambda *_, fn=fn: fn()) for n, fn in fns.items()}, [(offs,)], REPS, rounds=ROUNDS)
        for name, ms in times.items():
            print(f"  {name:22s} {ms:8.4f} ms  x_vs_bf16 {times['bf16'] / ms:.3f}  {allocs[name]}", flush=True)
        del x, w, fns
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
