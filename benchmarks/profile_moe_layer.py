"""Where an MoE layer's time goes (GPU): CUDA kernel time per kernel name under ``torch.profiler``, forward and
forward+backward, for the variants of ``bench_moe_layer`` (transformers' ``grouped_mm`` block, ``FlyMoE`` plain on
ATen, plain and fused), all on the same weights.

    python -m benchmarks.profile_moe_layer            # writes moe_layer_profile.{json,md}

Kernel names are shortened and grouped (GEMM, routing, copies, elementwise) so the table shows which part of the
layer is not the expert GEMMs.
"""

from __future__ import annotations

import re
from contextlib import nullcontext

import torch

from benchmarks.bench_moe_layer import MOE_MODELS, _layers
from benchmarks.harness import Results
from fly_lightning import dispatch_config

SHAPES = {"qwen3-30b-a3b": MOE_MODELS["qwen3-30b-a3b"]}


def _family(name: str) -> str:
    n = name.lower()
    if "grouped" in n or "gemm" in n or "cutlass" in n or "sm90" in n or "_grouped_mm" in n:
        return "gemm"
    if "route" in n or "topk" in n or "sort" in n or "histc" in n or "cumsum" in n or "softmax" in n:
        return "routing"
    if "index" in n or "gather" in n or "scatter" in n or "copy" in n or "perm" in n:
        return "copies"
    return "other"


def profile(fn, reps: int = 5) -> list[tuple[str, float, int]]:
    """(kernel name, total ms per call, launches per call) sorted by time."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = re.sub(r"<.*", "", ev.name)[:80]
        t = rows.setdefault(name, [0.0, 0])
        t[0] += ev.device_time_total / 1e3 / reps
        t[1] += 1 / reps
    return sorted(((n, t, c) for n, (t, c) in rows.items()), key=lambda r: -r[1])


def op_table(fn, reps: int = 3, top: int = 25) -> list[tuple[str, str, float, float]]:
    """(ATen op, input shapes, self CUDA ms per call, calls per call): which ops launch the kernel time."""
    fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts, record_shapes=True) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    avgs = [a for a in prof.key_averages(group_by_input_shape=True) if a.self_device_time_total > 0]
    avgs.sort(key=lambda a: -a.self_device_time_total)
    return [(a.key, str(a.input_shapes)[:120], round(a.self_device_time_total / 1e3 / reps, 4), a.count / reps)
            for a in avgs[:top]]  # fmt: skip


def main() -> None:
    res = Results("moe_layer_profile")
    dev, dt = "cuda", torch.bfloat16
    for model, (family, h, i, e, k, t, norm) in SHAPES.items():
        x = torch.randn(1, t, h, device=dev, dtype=dt)  # transformers blocks take [B, S, H]
        g = torch.randn_like(x)
        layers = _layers(family, h, i, e, k, norm, dev, dt)
        for name, layer in layers.items():
            xg = x.clone().requires_grad_()

            def fwd(layer=layer, x=x):
                with torch.no_grad():
                    return layer(x)

            def fwd_bwd(layer=layer, xg=xg, g=g):
                layer.zero_grad(set_to_none=True)
                xg.grad = None
                out = layer(xg)
                (out[0] if isinstance(out, tuple) else out).backward(g)

            for mode, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
                with dispatch_config(backends=("aten",)) if name == "plain_aten" else nullcontext():
                    kernels = profile(fn)
                total = sum(r[1] for r in kernels)
                fam: dict[str, float] = {}
                for n, ms, _ in kernels:
                    fam[_family(n)] = fam.get(_family(n), 0.0) + ms
                res.add(model=model, layer=name, mode=mode, kernel_ms=round(total, 4),
                        **{f"{f}_ms": round(v, 4) for f, v in sorted(fam.items())},
                        top=[(n, round(ms, 4), round(c, 1)) for n, ms, c in kernels[:14]])  # fmt: skip
            if name == "fused":  # where the backward's non-GEMM time comes from, op by op
                res.add(model=model, layer=name, mode="fwd_bwd_ops", ops=op_table(fwd_bwd))
    res.notes.append("kernel_ms: summed CUDA kernel time per call (profiler), not wall time; families by name")
    res.save()


if __name__ == "__main__":
    main()
