"""Dense MX GEMM suite (H200): fly-lightning's Triton ``mx_scaled_mm`` on 17 LLM projection shapes (M from 16 to
16384) for MXFP8 (e4m3 x e4m3) and MXFP4 (e2m1 x e2m1), and weight-only MXFP4 (bf16 activations) at M <= 64.

Columns per case (side by side in rotated rounds, ``harness.interleaved_ms``; inputs rotated through more than 3x the
L2; every implementation checked against the fp32 reference first):

- ``ours``: the Triton kernel through the dispatcher (operands already in MX: the GEMM only);
- ``ours_q``: ours including the activation's quantisation (``mx_cast`` of bf16 activations, then the GEMM; the
  weights are cast once, as a frozen or cached weight would be); weight-only has no activation cast;
- ``bf16``: cuBLAS ``torch.mm`` of bf16 operands of the same shape;
- ``ours_graph``, ``bf16_graph`` (GPU): the same two as device time from CUDA-graph replays, without the host launch
  cost that the event-timed columns carry (it dominates at small sizes);
- ``emulated``: torchao's emulated path (``MXTensor`` dequantise to bf16, then ``torch.mm``), which is our ATen
  backend; torchao's own ``MXTensor`` dequantise is used when torchao is installed;
- ``emulated_compiled`` (GPU): the same arithmetic under ``torch.compile``, which fuses each dequantisation into one
  kernel as our prepass does: the stronger form of that baseline, reported beside the goal's.

Goals (issue 27): geomean >= 0.9x bf16 cuBLAS on the cases with M >= 1024, >= 1.5x the emulated path over all 17
(per format); weight-only MXFP4 at M <= 64 >= 2.5x bf16.

    python -m benchmarks.bench_mx_gemm            # writes mx_gemm.{json,md}
    python -m benchmarks.bench_mx_gemm --smoke    # tiny shapes, CPU (interpreter) or GPU: checks it runs
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable

import torch

import fly_lightning
from benchmarks.harness import (
    Results,
    backend_of,
    capture_graph,
    copy_bandwidth_gbps,
    geomean,
    interleaved_graph_ms,
    interleaved_ms,
    rotation_count,
    time_graph_ms,
    time_ms,
)
from fly_lightning.ops.mx_scaled_mm import mx_scaled_mm_reference

# (M, N, K): Llama-3-8B / 70B, Mistral, Qwen projections (qkv, o, gate/up, down) at prefill and decode token counts
SHAPES = [
    (16, 4096, 4096),
    (16, 28672, 4096),
    (32, 4096, 14336),
    (64, 6144, 4096),
    (64, 8192, 8192),
    (128, 14336, 4096),
    (256, 4096, 4096),
    (512, 8192, 2048),
    (1024, 4096, 4096),
    (1024, 28672, 8192),
    (2048, 6144, 4096),
    (2048, 4096, 14336),
    (4096, 4096, 4096),
    (4096, 14336, 4096),
    (8192, 8192, 8192),
    (8192, 1024, 8192),
    (16384, 4096, 4096),
]
SMOKE_SHAPES = [(16, 64, 128), (40, 96, 256), (130, 64, 128)]
FORMATS = {"mxfp8": "mxfp8_e4m3", "mxfp4": "mxfp4_e2m1"}
GOALS = {"vs_bf16_m1024": 0.9, "vs_emulated": 1.5, "w4_vs_bf16_m64": 2.5}
ALT_PLANS = [  # (block_m, block_n, block_k, warps, stages, swap): in-loop plans timed beside the plan (JSON details)
    (128, 256, 128, 8, 3, False),
    (128, 128, 128, 8, 4, True),
    (128, 128, 64, 8, 4, False),
    (64, 256, 128, 4, 3, True),
]
SMALL_PLANS = [  # (block_n, warps, stages, split_k factor): graph-timed beside the plan at M <= SMALL_M (w4, details)
    (64, 4, 4, 0.5),
    (64, 4, 4, 2),
    (64, 4, 6, 1),
    (64, 2, 4, 1),
    (128, 4, 4, 1),
    (128, 8, 4, 1),
    (128, 4, 4, 2),
    (32, 4, 4, 2),
]
LARGE_M = 1024  # the vs-bf16 goal's rows; ALT_PLANS are timed from here
ALT_M = 128  # from here on, the prepass plan and an in-loop plan are timed side by side (details.plans)
MID_PLAN = (64, 128, 128, 4, 4, False)  # the in-loop plan below LARGE_M
SMALL_M = 64  # weight-only cases
GRAPH_CALLS = 20  # calls per captured graph (small M)


def _emulated_dequant() -> tuple[str, Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor]]:
    """torchao's ``MXTensor`` dequantisation to bf16 when torchao is there; else ours (the same arithmetic)."""
    from fly_lightning.quant import formats

    try:
        logging.getLogger("torchao").setLevel(logging.ERROR)
        from torchao.prototype.mx_formats.mx_tensor import MXTensor

        def torchao_dequant(data: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
            elem = formats.FORMATS[fmt].torch_dtype
            t = MXTensor(data, scale, elem, 32, torch.bfloat16, None, None, False)
            return t.dequantize(torch.bfloat16)

        return "torchao MXTensor.dequantize", torchao_dequant
    except Exception:  # noqa: BLE001 (torchao missing or its constructor changed: the same math in plain torch)
        return "formats.from_mx (torchao missing)", lambda data, scale, fmt: formats.from_mx(
            data, scale, fmt, torch.bfloat16
        )


def _compiled_emulated() -> Callable[..., torch.Tensor]:
    """The emulated path's arithmetic (dequantise each MX operand to bf16, then ``torch.mm``) under ``torch.compile``
    with dynamic shapes: one graph per format pair. Inductor fuses each dequantisation into one kernel, as our
    prepass does: the strongest form of that baseline."""
    from fly_lightning.quant import formats

    def emulated(a, a_s, a_fmt, b, bs, b_fmt):
        da = a if a_fmt is None else formats.from_mx(a, a_s, a_fmt, torch.bfloat16)
        return torch.mm(da, formats.from_mx(b, bs, b_fmt, torch.bfloat16).t())

    return torch.compile(emulated, dynamic=True)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def run_case(
    res: Results, m: int, n: int, k: int, kind: str, device: str, reps: int, dequant, rounds: int = 4, compiled=None
) -> None:
    b_fmt = FORMATS["mxfp4" if kind == "w4" else kind]
    a_fmt = None if kind == "w4" else b_fmt
    cast = lambda x, fmt: fly_lightning.mx_cast(x, fmt, "floor")  # noqa: E731
    # sized by the smallest operands any column reads (ours: MX bytes, fp4 packed, scales): every column's pass over
    # the sets then exceeds 3x the L2 (each set also holds the bf16 copies the other columns read)
    per_elem = {"mxfp4_e2m1": 0.5}.get(b_fmt, 1.0) + 1 / 32
    a_bytes = m * k * (2 if a_fmt is None else per_elem)
    sets = rotation_count(int(a_bytes + n * k * per_elem), max_sets=48) if device == "cuda" else 1
    inputs = []
    for _ in range(sets):
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        b, bs = cast(w, b_fmt)
        a, a_s = (x, None) if a_fmt is None else cast(x, a_fmt)
        inputs.append((x, w, a, a_s, b, bs))
    x, w, a, a_s, b, bs = inputs[0]
    ref = mx_scaled_mm_reference(a, a_s, a_fmt, b, bs, b_fmt, torch.float32)

    def ours(x, w, a, a_s, b, bs):
        return fly_lightning.mx_scaled_mm(a, b, bs, b_fmt, a_scale=a_s, a_fmt=a_fmt)

    def ours_q(x, w, a, a_s, b, bs):
        if a_fmt is None:
            return fly_lightning.mx_scaled_mm(x, b, bs, b_fmt)
        qa, qs = cast(x, a_fmt)
        return fly_lightning.mx_scaled_mm(qa, b, bs, b_fmt, a_scale=qs, a_fmt=a_fmt)

    def bf16(x, w, a, a_s, b, bs):
        return torch.mm(x, w.t())

    def emulated(x, w, a, a_s, b, bs):
        da = x if a_fmt is None else dequant(a, a_s, a_fmt)
        return torch.mm(da, dequant(b, bs, b_fmt).t())

    fns = {"ours": ours, "ours_q": ours_q, "bf16": bf16, "emulated": emulated}
    if compiled is not None:
        fns["emulated_compiled"] = lambda x, w, a, a_s, b, bs: compiled(a, a_s, a_fmt, b, bs, b_fmt)
    if kind == "w4" and device == "cuda":
        # the least any eager implementation does: allocate the [m, n] output and launch one kernel on it through
        # ATen's C++ dispatch (no Python launcher): the host floor under the event-timed columns (goal_bounds)
        fns["launch_floor"] = lambda x, w, a, a_s, b, bs: x.new_empty((m, n)).zero_()
    row = dict(case=f"{kind} {m}x{n}x{k}", kind=kind, m=m, n=n, k=k)
    for name in [n for n in fns if n not in ("bf16", "launch_floor")]:
        try:
            row[f"{name}_err"] = float(f"{rel_err(fns[name](*inputs[0]), ref):.3g}")
        except Exception as exc:  # noqa: BLE001 (a baseline that fails to compile is reported; ours must not fail)
            if name != "emulated_compiled":
                raise
            row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:100]}"
            del fns[name]
    row["backend"] = backend_of("mx_scaled_mm", a, a_s, a_fmt, b, bs, b_fmt, torch.bfloat16)
    ms = interleaved_ms(fns, inputs, reps=reps, rounds=rounds)
    row.update({f"{name}_ms": float(f"{t:.4g}") for name, t in ms.items()})
    row["tflops"] = round(2 * m * n * k / ms["ours"] / 1e9, 1)
    for name in [n for n in ("bf16", "emulated", "emulated_compiled") if n in ms]:
        row[f"x_vs_{name}"] = float(f"{ms[name] / ms['ours']:.4g}")
        row[f"q_x_vs_{name}"] = float(f"{ms[name] / ms['ours_q']:.4g}")
    if device == "cuda":  # events include the host's launch cost: the device time from graph replays too
        graphs = {name: capture_graph(fns[name], inputs, GRAPH_CALLS) for name in ("ours", "bf16")}
        gms = interleaved_graph_ms(graphs, GRAPH_CALLS, rounds=rounds)
        row.update({f"{name}_graph_ms": float(f"{t:.4g}") for name, t in gms.items()})
        row["graph_x_vs_bf16"] = float(f"{gms['bf16'] / gms['ours']:.4g}")
    res.add(**row)
    if kind == "w4" and device == "cuda":
        res.details.setdefault("small_plans", {})[row["case"]] = small_plans(m, n, k, b_fmt, inputs, gms["ours"], ref)
    if m >= ALT_M and kind != "w4":
        plans = alt_plans(m, n, k, a_fmt, b_fmt, inputs, ms["ours"], ref, row.get("ours_graph_ms"))
        res.details.setdefault("plans", {})[row["case"]] = plans


def alt_plans(m, n, k, a_fmt, b_fmt, inputs, ours_ms, ref, ours_graph_ms=None) -> dict:
    """Milliseconds of other launch plans on this case: the bf16 prepass and in-loop plans (all of ALT_PLANS
    from LARGE_M), for tuning ``plan``; a plan that fails or disagrees with the reference is recorded as such. Below
    LARGE_M also graph-timed ("<plan> graph"): the host's cost decides there in event timing, not the device's."""
    from dataclasses import replace

    from fly_lightning.kernels.triton import mx_scaled_mm as kernel

    base = kernel.plan(m, n, k, a_fmt, b_fmt, inputs[0][2].device)
    out = {"plan": base.label(), "plan_ms": ours_ms}
    graphs = m < LARGE_M and inputs[0][2].is_cuda
    if graphs:
        out["plan_graph_ms"] = ours_graph_ms
    loop = replace(base, prepass=False, fp8_blockwise=False, split_k=1)
    cands = [replace(base, prepass=True, fp8_blockwise=False)]  # the bf16 prepass beside the fp8 one
    for bm, bn, bk, warps, stages, swap in ALT_PLANS if m >= LARGE_M else [MID_PLAN]:
        cands.append(replace(loop, block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, swap=swap))
    for cfg in cands:
        if cfg.label() in out or cfg == base:
            continue

        def fn(x, w, a, a_s, b, bs, cfg=cfg):
            return kernel.launch(a, a_s, a_fmt, b, bs, b_fmt, torch.bfloat16, cfg)

        try:
            err = rel_err(fn(*inputs[0]), ref)
            out[cfg.label()] = float(f"{time_ms(fn, inputs, warmup=3, reps=20)['median_ms']:.4g}")
            if graphs:
                gms = time_graph_ms(fn, inputs, calls_per_graph=GRAPH_CALLS)["median_ms"]
                out[f"{cfg.label()} graph"] = float(f"{gms:.4g}")
            if err > 1e-2:
                out[cfg.label()] = f"error {err:.3g}"
        except Exception as exc:  # noqa: BLE001 (a plan that does not compile or fit is recorded, not fatal)
            out[cfg.label()] = f"{type(exc).__name__}: {str(exc)[:100]}"
    return out


def small_plans(m, n, k, b_fmt, inputs, ours_ms, ref) -> dict:
    """Weight-only, few rows: graph-timed milliseconds of plans around the launcher's (tile width, warps, stages,
    split K), for tuning ``plan`` where the host cost hides the kernel's in event timing."""
    from dataclasses import replace

    from fly_lightning.kernels.triton import mx_scaled_mm as kernel

    base = kernel.plan(m, n, k, None, b_fmt, inputs[0][2].device)
    out = {"plan": base.label(), "plan_graph_ms": ours_ms}
    configs = [
        replace(base, block_n=bn, num_warps=warps, num_stages=stages, split_k=max(1, int(base.split_k * factor)))
        for bn, warps, stages, factor in SMALL_PLANS
    ]
    # swapped, K in the wgmma fragment's order (fragment_k), byte tables on and off for MXFP4, at the plan's split and
    # half and twice it
    luts = (False, True) if b_fmt == "mxfp4_e2m1" else (False,)
    configs += [
        replace(base, swap=True, fragment_k=True, fp4_lut=lut, split_k=max(1, int(base.split_k * factor)))
        for lut in luts
        for factor in (1, 0.5, 2)
    ]
    # 128 weight rows over two warpgroups, each with its own chain of wgmmas (sm90 loop: 382 instructions per thread
    # with byte tables, as 64 rows over one)
    configs += [replace(base, swap=True, fragment_k=True, fp4_lut=lut, block_n=128, num_warps=8) for lut in luts]
    for cfg in configs:
        split = cfg.split_k
        label = cfg.label()
        if label in out or k % (cfg.block_k * split):  # a factor that lands on a plan already timed, or K too short
            continue

        def fn(x, w, a, a_s, b, bs, cfg=cfg):
            return kernel.launch(a, a_s, None, b, bs, b_fmt, torch.bfloat16, cfg)

        try:
            err = rel_err(fn(*inputs[0]), ref)
            if err > 1e-2:
                out[label] = f"error {err:.3g}"
                continue
            out[label] = float(f"{time_graph_ms(fn, inputs, calls_per_graph=GRAPH_CALLS)['median_ms']:.4g}")
        except Exception as exc:  # noqa: BLE001 (a plan that does not compile or fit is recorded, not fatal)
            out[label] = f"{type(exc).__name__}: {str(exc)[:100]}"
    return out


def summarise(res: Results) -> None:
    s: dict = {}
    for kind in ("mxfp8", "mxfp4"):
        rows = [r for r in res.rows if r["kind"] == kind]
        big = [r for r in rows if r["m"] >= LARGE_M]
        for pre in ("", "q_"):
            s[f"{kind}_{pre}geomean_vs_bf16_m1024"] = geomean([r[f"{pre}x_vs_bf16"] for r in big]) if big else None
            s[f"{kind}_{pre}geomean_vs_emulated"] = geomean([r[f"{pre}x_vs_emulated"] for r in rows]) if rows else None
        comp = [r["x_vs_emulated_compiled"] for r in rows if "x_vs_emulated_compiled" in r]
        s[f"{kind}_geomean_vs_emulated_compiled"] = geomean(comp) if comp else None
        comp = [r["q_x_vs_emulated_compiled"] for r in rows if "q_x_vs_emulated_compiled" in r]
        s[f"{kind}_q_geomean_vs_emulated_compiled"] = geomean(comp) if comp else None
        s[f"{kind}_meets_vs_bf16"] = bool(big) and s[f"{kind}_geomean_vs_bf16_m1024"] >= GOALS["vs_bf16_m1024"]
        s[f"{kind}_meets_vs_emulated"] = bool(rows) and s[f"{kind}_geomean_vs_emulated"] >= GOALS["vs_emulated"]
        graph = [r["graph_x_vs_bf16"] for r in big if "graph_x_vs_bf16" in r]
        s[f"{kind}_graph_geomean_vs_bf16_m1024"] = geomean(graph) if graph else None
    w4 = [r for r in res.rows if r["kind"] == "w4"]
    s["w4_geomean_vs_bf16_m64"] = geomean([r["x_vs_bf16"] for r in w4]) if w4 else None
    s["w4_meets_vs_bf16"] = bool(w4) and s["w4_geomean_vs_bf16_m64"] >= GOALS["w4_vs_bf16_m64"]
    graph = [r["graph_x_vs_bf16"] for r in w4 if "graph_x_vs_bf16" in r]
    s["w4_graph_geomean_vs_bf16_m64"] = geomean(graph) if graph else None
    s["max_err"] = max(max(r["ours_err"], r["ours_q_err"]) for r in res.rows)
    s["goals"] = GOALS
    res.summary = s


def suite(
    smoke: bool = False,
    device: str | None = None,
    reps: int = 40,
    shapes: list[tuple[int, int, int]] | None = None,
    rounds: int = 4,
) -> Results:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    shapes = shapes or (SMOKE_SHAPES if smoke else SHAPES)
    res = Results("mx_gemm")
    emulated_impl, dequant = _emulated_dequant()
    compiled = _compiled_emulated() if device == "cuda" else None  # compiling on the CPU would dominate a smoke run
    for kind in ("mxfp8", "mxfp4", "w4"):
        for m, n, k in shapes:
            if kind == "w4" and m > SMALL_M:
                continue
            run_case(res, m, n, k, kind, device, reps, dequant, rounds, compiled)
    summarise(res)
    res.summary["emulated_impl"] = emulated_impl
    if device == "cuda":  # this GPU's memory roof, for goal_bounds' weight-only bound (same run, same device)
        res.summary["copy_GBps"] = round(copy_bandwidth_gbps(device))
    res.notes += [
        "ours: the Triton mx_scaled_mm (operands already MX); ours_q: plus mx_cast of the bf16 activation (floor)",
        "bf16: cuBLAS torch.mm; emulated: torchao MXTensor dequantise to bf16 + torch.mm (torchao's Hopper path), "
        "eager; emulated_compiled (GPU): the same arithmetic under torch.compile (dynamic shapes; its compilation "
        "excluded), the stronger form of that baseline",
        "x_vs_*: baseline time / ours (above 1: ours faster); q_x_vs_*: the same for ours_q (ours paying the "
        "activation's cast; the emulated baselines still get MX operands, so this understates ours)",
        "geomeans: vs bf16 over M >= 1024, vs emulated (and emulated_compiled) over all 17; w4 (weight-only MXFP4) "
        "over M <= 64",
        "details.plans (JSON): other launch plans timed from M = 128 (the prepass and in-loop plans), for tuning "
        "the kernel's plan; "
        "details.small_plans: the same for weight-only at M <= 64, graph-timed",
        "*_graph_ms: ours and bf16 as device time from CUDA-graph replays (no host launch cost, as under CUDA graphs "
        "or when the host runs ahead of the GPU); graph_x_vs_bf16 = bf16 / ours there. The goals are read on the "
        "event-timed columns (host included); *_graph_geomean_* on the graph columns",
        "copy_GBps (GPU): device-to-device copy bandwidth measured in this run (bytes read + written)",
        "launch_floor_ms (weight-only, GPU): an eager call that allocates the output and launches one ATen kernel "
        "on it, event-timed beside the others: no eager implementation's call costs less (goal_bounds)",
    ]
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes, few repetitions (CPU interpreter or GPU)")
    args = p.parse_args()
    res = suite(smoke=args.smoke, reps=2 if args.smoke else 40, rounds=1 if args.smoke else 4)
    if args.smoke:
        print(res.markdown())
        return
    print(res.save())
    print(res.markdown())


if __name__ == "__main__":
    main()
