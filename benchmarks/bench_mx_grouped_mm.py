"""MX grouped GEMM suite (GPU): our Triton ``mx_grouped_mm`` (MXFP8 and MXFP4, activations and weights MX) against our
bf16 ``grouped_mm`` and torchao's emulated MX grouped path, on the 24 cases of ``benchmarks/grouped_mm_cases.py``.

Columns per format ``f`` (``fp8`` = mxfp8_e4m3, ``fp4`` = mxfp4_e2m1, floor scales):

- ``f_ms``: our MX grouped GEMM on operands already in MX (the GEMM alone);
- ``f_emul_ms``: the emulated path on the same MX operands: dequantise to bf16 as torchao does
  (``data.to(bf16) * scale.to(bf16)``; fp4 unpacked first), then ``torch._grouped_mm``;
- quantisation apart: ``f_cast_x_ms`` (activations, ``mx_cast``) and ``f_cast_w_ms`` (weights along K, which a training
  step pays from its master copy; frozen MX weights do not);
- quantisation included (what a training step pays): ``f_incl_ms`` = cast x + cast w + our GEMM, one function;
  ``f_emul_incl_ms``: for MXFP8 torchao's ``_to_mxfp8_then_scaled_grouped_mm`` with ``KernelPreference.EMULATED``
  (it quantises both operands itself; where torchao lacks it, our casts + the emulated GEMM), for MXFP4 our casts +
  the emulated GEMM (torchao has no MXFP4 grouped path).

Goals (issue 27): MX grouped at least 0.9x our bf16 grouped GEMM (``f_x_vs_bf16`` = bf16 time / ours) and at least
1.5x the emulated path (``f_x_vs_emul``); geomeans over the cases in the summary. Every case is checked first (ours
against the fp32 product of the dequantised operands, relative Frobenius error) and then timed side by side in rotated
rounds (``harness.interleaved_ms``), input sets rotated through more than 3x the L2 where memory allows.

    python -m benchmarks.bench_mx_grouped_mm            # writes mx_grouped_mm.{json,md}
    python -m benchmarks.bench_mx_grouped_mm --only qwen3
    python -m benchmarks.bench_mx_grouped_mm --smoke    # tiny cases on the CPU (interpreter): a wiring check
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable

import torch

import fly_lightning
from benchmarks.grouped_mm_cases import Case, cases, make_inputs, mx_weights, uniform_counts, zipf_counts
from benchmarks.harness import Results, backend_of, first_call_s, geomean, interleaved_ms, rotation_count, time_ms
from fly_lightning.kernels.triton import _mx_grouped_mm_kernel as mk
from fly_lightning.ops.mx_grouped_mm import mx_grouped_mm_reference
from fly_lightning.quant import formats

FORMATS = {"fp8": "mxfp8_e4m3", "fp4": "mxfp4_e2m1"}
GOAL_VS_BF16 = 0.9
GOAL_VS_EMULATED = 1.5
ROUNDS = 4
SMOKE_CASES = [
    Case("smoke-uniform", "uniform", 3, 128, 48, uniform_counts(40, 3), k_major=False),
    Case("smoke-uneven", "uneven", 4, 128, 32, zipf_counts(30, 4, 1.5, 0.25, seed=1), load="zipf"),
]


def _dequant_bf16(data: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """torchao's emulated dequantisation: elements and scales to bf16, one multiply per 32-value block."""
    if formats.FORMATS[fmt].bits == 4:
        values = formats.from_mx(data, torch.full_like(scale, 1.0), fmt, torch.bfloat16)  # unpacked e2m1 values
    else:
        values = data.to(torch.bfloat16)
    blocks = values.reshape(*values.shape[:-1], -1, formats.BLOCK) * scale.to(torch.bfloat16).unsqueeze(-1)
    return blocks.reshape(values.shape)


def emulated(xd, xs, wd, ws, offs, fmt: str) -> torch.Tensor:
    """Dequantise to bf16, then ``torch._grouped_mm`` (the weights as the K-contiguous view ``[E, K, N]``)."""
    return torch._grouped_mm(_dequant_bf16(xd, xs, fmt), _dequant_bf16(wd, ws, fmt).transpose(1, 2), offs=offs)


def _torchao_emulated_fp8() -> Callable | None:
    """torchao's dynamic-quantisation MXFP8 grouped GEMM with its emulated kernel preference, or None."""
    try:
        from torchao.prototype.moe_training.mxfp8_grouped_mm import _to_mxfp8_then_scaled_grouped_mm
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference
    except ImportError:
        return None

    def run(x, w, offs):
        return _to_mxfp8_then_scaled_grouped_mm(
            x, w, offs, kernel_preference=KernelPreference.EMULATED,
            scale_calculation_mode=ScaleCalculationMode.FLOOR,
        )  # fmt: skip

    return run


def _rel_err(y: torch.Tensor, ref: torch.Tensor, end: int) -> float:
    return ((y[:end].float() - ref[:end]).norm() / ref[:end].norm().clamp_min(1e-30)).item()


SWAP_TIMED_MAX_ROWS = 256  # rows per group up to which the swapped candidate (<f>_swap) is timed


def swap_config(case: Case, fmt: str, cpu: bool) -> mk.MXGroupedMMConfig:
    """The swapped candidate's tiles: the plan's 64- or 128-row tiles (``SWAPPED``, ``SWAPPED_MID``: a group's rows on
    the MMA's N side, 128 weight columns on its M side); the interpreter's small tiles on the CPU."""
    if cpu:
        return mk.MXGroupedMMConfig(16, 32, 128, 2, 1, 4, swap=True, fragment_k=True, x_prepass=True)
    plan = mk.choose_config(case.m, case.e, False, fmt, fmt, sm90=True)
    return plan if plan in (mk.SWAPPED, mk.SWAPPED_MID) else mk.SWAPPED_MID  # 128-row tiles beside the wide plan


def _bf16_grouped(x, w, offs):
    return fly_lightning.grouped_mm(x, w, offs)


def _case_sets(case: Case, device: str) -> list[tuple]:
    """Input sets ``(x, w, offs)`` (bf16), enough to rotate through more than 3x the L2 on the GPU."""
    nbytes = (case.m * case.k + case.e * case.k * case.n) * 2
    n_sets = min(rotation_count(nbytes, min_sets=1), 4 if nbytes < 2**30 else 1) if device == "cuda" else 1
    return [make_inputs(case, device, seed=s) for s in range(n_sets)]


def run_case(case: Case, device: str, reps: int | None, torchao_fp8: Callable | None) -> dict:
    sets = _case_sets(case, device)
    x, w, offs = sets[0]
    end = int(case.m)
    row = dict(case=case.name, family=case.family, load=case.load, E=case.e, M=case.m, K=case.k, N=case.n,
               w_layout="K-major" if case.k_major else "N-major", empty=sum(c == 0 for c in case.counts))  # fmt: skip
    fns: dict[str, Callable] = {"bf16": lambda x, w, o, *_: _bf16_grouped(x, w, o)}
    timed_sets = []
    for x_, w_, o_ in sets:
        mx = {}
        for f, fmt in FORMATS.items():
            xd, xs = fly_lightning.mx_cast(x_, fmt)
            wd, ws = mx_weights(w_, fmt)
            mx[f] = (xd, xs, wd, ws)
        timed_sets.append((x_, w_, o_, mx))
    for f, fmt in FORMATS.items():
        xd, xs, wd, ws = timed_sets[0][3][f]
        mx_args = (xd, xs, fmt, wd, ws, fmt, offs, torch.bfloat16)
        call = lambda xd, xs, wd, ws, o, fmt=fmt: fly_lightning.mx_grouped_mm(xd, wd, ws, fmt, o, x_scale=xs, x_fmt=fmt)  # noqa: E731
        seconds, y = first_call_s(call, xd, xs, wd, ws, offs)
        row[f"{f}_cold_s"] = round(seconds, 3)
        row[f"{f}_backend"] = backend_of("mx_grouped_mm", *mx_args)
        ref = mx_grouped_mm_reference(*mx_args[:-1], torch.float32)
        row[f"{f}_err"] = _rel_err(y, ref, end)
        row[f"{f}_emul_err"] = _rel_err(emulated(xd, xs, wd, ws, offs, fmt), ref, end)
        swapped = case.m / case.e <= SWAP_TIMED_MAX_ROWS  # few rows per group: a weight tile feeds one or two row tiles
        if swapped:
            y = torch.empty(xd.shape[0], wd.shape[1], dtype=torch.bfloat16, device=xd.device)
            mk.launch(xd, xs, fmt, wd, ws, fmt, offs, y, config=swap_config(case, fmt, xd.device.type == "cpu"))
            row[f"{f}_swap_err"] = _rel_err(y, ref, end)
        del ref, y

        def ours(x, w, o, mx, f=f, fmt=fmt):
            xd, xs, wd, ws = mx[f]
            return fly_lightning.mx_grouped_mm(xd, wd, ws, fmt, o, x_scale=xs, x_fmt=fmt)

        def loop(x, w, o, mx, f=f, fmt=fmt):  # the in-loop kernel: tiles converted in its main loop, no prepass
            xd, xs, wd, ws = mx[f]
            cpu = xd.device.type == "cpu"
            cfg = mk.INTERPRETER_CONFIG if cpu else mk.loop_config(xd.shape[0], wd.shape[0], fmt, fmt)
            out = torch.empty(xd.shape[0], wd.shape[1], dtype=torch.bfloat16, device=xd.device)
            return mk.launch(xd, xs, fmt, wd, ws, fmt, o, out, config=cfg)

        def prepass(x, w, o, mx, f=f, fmt=fmt):  # the bf16 prepass plan (dequantised in memory, bf16 grouped GEMM)
            xd, xs, wd, ws = mx[f]
            out = torch.empty(xd.shape[0], wd.shape[1], dtype=torch.bfloat16, device=xd.device)
            return mk.launch(xd, xs, fmt, wd, ws, fmt, o, out, config=mk.PREPASS)

        def swap(x, w, o, mx, f=f, fmt=fmt):  # x dequantised first, weights as the MMA's register operand
            xd, xs, wd, ws = mx[f]
            out = torch.empty(xd.shape[0], wd.shape[1], dtype=torch.bfloat16, device=xd.device)
            return mk.launch(xd, xs, fmt, wd, ws, fmt, o, out, config=swap_config(case, fmt, xd.device.type == "cpu"))

        if swapped:
            fns[f"{f}_swap"] = swap

        def incl(x, w, o, mx, fmt=fmt):
            xd, xs = fly_lightning.mx_cast(x, fmt)
            wd, ws = mx_weights(w, fmt)
            return fly_lightning.mx_grouped_mm(xd, wd, ws, fmt, o, x_scale=xs, x_fmt=fmt)

        def emul(x, w, o, mx, f=f, fmt=fmt):
            xd, xs, wd, ws = mx[f]
            return emulated(xd, xs, wd, ws, o, fmt)

        def emul_incl(x, w, o, mx, fmt=fmt):
            if fmt == "mxfp8_e4m3" and torchao_fp8 is not None and w.stride(1) == 1:  # its per-group column-major w
                return torchao_fp8(x, w, o)
            xd, xs = fly_lightning.mx_cast(x, fmt)
            return emulated(xd, xs, *mx_weights(w, fmt), o, fmt)

        fns |= {
            f: ours,
            f"{f}_loop": loop,
            f"{f}_prepass": prepass,
            f"{f}_emul": emul,
            f"{f}_cast_x": lambda x, w, o, mx, fmt=fmt: fly_lightning.mx_cast(x, fmt),
            f"{f}_cast_w": lambda x, w, o, mx, fmt=fmt: mx_weights(w, fmt),
            f"{f}_incl": incl,
            f"{f}_emul_incl": emul_incl,
        }
        row[f"{f}_emul_incl_impl"] = (
            "torchao _to_mxfp8_then_scaled_grouped_mm EMULATED"
            if fmt == "mxfp8_e4m3" and torchao_fp8 is not None and w.stride(1) == 1
            else "mx_cast + dequantise + torch._grouped_mm"
        )
    if device == "cuda":
        times = interleaved_ms(fns, timed_sets, reps or 10, rounds=ROUNDS)
    else:  # the smoke run: one call each (the interpreter's timings mean nothing)
        times = {n: time_ms(fn, timed_sets, warmup=0, reps=1)["median_ms"] for n, fn in fns.items()}
    for name, ms in times.items():
        row[f"{name}_ms"] = round(ms, 4)
    row["bf16_tflops"] = round(case.flops / row["bf16_ms"] / 1e9, 1)
    for f in FORMATS:
        row[f"{f}_tflops"] = round(case.flops / row[f"{f}_ms"] / 1e9, 1)
        row[f"{f}_x_vs_bf16"] = float(f"{row['bf16_ms'] / row[f'{f}_ms']:.4g}")
        row[f"{f}_x_vs_emul"] = float(f"{row[f'{f}_emul_ms'] / row[f'{f}_ms']:.4g}")
        row[f"{f}_loop_x_vs_bf16"] = float(f"{row['bf16_ms'] / row[f'{f}_loop_ms']:.4g}")
        row[f"{f}_prepass_x_vs_bf16"] = float(f"{row['bf16_ms'] / row[f'{f}_prepass_ms']:.4g}")
        if f"{f}_swap_ms" in row:
            row[f"{f}_swap_x_vs_bf16"] = float(f"{row['bf16_ms'] / row[f'{f}_swap_ms']:.4g}")
        row[f"{f}_incl_x_vs_emul_incl"] = float(f"{row[f'{f}_emul_incl_ms'] / row[f'{f}_incl_ms']:.4g}")
        row[f"{f}_incl_x_vs_bf16"] = float(f"{row['bf16_ms'] / row[f'{f}_incl_ms']:.4g}")
    return row


def suite(case_list: list[Case] | None = None, only: str | None = None, device: str = "cuda",
          reps: int | None = None) -> Results:  # fmt: skip
    res = Results("mx_grouped_mm")
    torchao_fp8 = _torchao_emulated_fp8() if device == "cuda" else None
    for case in case_list or cases():
        if only and only not in case.name:
            continue
        try:
            res.add(**run_case(case, device, reps, torchao_fp8))
        except torch.OutOfMemoryError as exc:  # reported, not fatal
            res.add(case=case.name, error=f"OutOfMemoryError: {str(exc)[:120]}")
        if device == "cuda":
            torch.cuda.empty_cache()
    _summarise(res)
    return res


def _summarise(res: Results) -> None:
    rows = [r for r in res.rows if "error" not in r]
    for f in FORMATS:
        for key, goal in ((f"{f}_x_vs_bf16", GOAL_VS_BF16), (f"{f}_x_vs_emul", GOAL_VS_EMULATED),
                          (f"{f}_incl_x_vs_emul_incl", GOAL_VS_EMULATED), (f"{f}_incl_x_vs_bf16", None),
                          (f"{f}_loop_x_vs_bf16", None), (f"{f}_prepass_x_vs_bf16", None),
                          (f"{f}_swap_x_vs_bf16", None)):  # fmt: skip
            vals = [r[key] for r in rows if key in r]
            g = round(geomean(vals), 3) if vals else None
            res.summary[f"geomean_{key}"] = g
            if goal is not None:
                res.summary[f"goal_{key}"] = goal
                res.summary[f"meets_{key}"] = g is not None and g >= goal
        res.summary[f"{f}_failed_checks"] = [r["case"] for r in rows if r.get(f"{f}_err", 1.0) > 1e-2]
        res.summary[f"{f}_not_on_triton"] = [r["case"] for r in rows if r.get(f"{f}_backend") != "triton"]
    res.summary["errors"] = [r["case"] for r in res.rows if "error" in r]
    res.add_totals(tuple(f"{f}_cold_s" for f in FORMATS), 2)
    res.notes += [
        "fp8 = mxfp8_e4m3, fp4 = mxfp4_e2m1; activations and weights both MX, floor scales; weights [E, N, K] cast "
        "along K; bf16 = our grouped_mm (the dispatched bf16 grouped GEMM) on the unquantised operands.",
        "<f>_x_vs_bf16 = bf16 time / ours (goal 0.9); <f>_x_vs_emul = emulated time / ours on the same MX operands "
        "(goal 1.5); <f>_incl_x_vs_emul_incl: both quantising activations and weights inside the timed call.",
        "emulated = torchao's formula (elements and scales cast to bf16 and multiplied), then torch._grouped_mm; "
        "<f>_emul_incl_impl names the included path (torchao's function where installed and the layout fits).",
        "<f>_loop: the in-loop kernel alone (tiles dequantised in its main loop), timed beside ours; <f>_prepass: "
        "the bf16 prepass plan (operands dequantised to bf16 in memory, then the bf16 grouped GEMM). From "
        f"{mk.PREPASS_MIN_ROWS} up to {mk.SWAP_WIDE_MAX_ROWS - 1} rows per group ours takes the wide swapped plan on "
        "Hopper (x dequantised to bf16 in the tiles' K order, 256x128 tiles converting the MX weights as the MMA's "
        "register operand), otherwise from that many rows the bf16 prepass.",
        f"<f>_swap (cases of at most {SWAP_TIMED_MAX_ROWS} rows per group): the swapped tiles of 64 or 128 rows (ours "
        f"takes them on Hopper below {mk.PREPASS_MIN_ROWS} rows per group, 64-row tiles up to {mk.SWAP_MAX_ROWS} rows "
        f"({mk.SWAP_FP8_MAX_ROWS} with MXFP8 weights), 256-row tiles from {mk.PREPASS_MIN_ROWS}), timed beside ours: "
        "x dequantised to bf16 first (in the tiles' K order), weights "
        "on the MMA's M side as its register operand, K summed in the register fragment's order (fragment_k); "
        "<f>_swap_err its check; geomean_<f>_swap_x_vs_bf16 over those cases only.",
        "<f>_err: ours against the fp32 per-group product of the dequantised operands (bf16 output: ~2e-3).",
        "timing: device events over rotating input sets; every column takes turns in shuffled rounds "
        f"({ROUNDS} or more) and reports the median of its round medians. <f>_cold_s: first call (compilation).",
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", help="run the cases whose name contains this")
    p.add_argument("--smoke", action="store_true", help="two tiny cases on the CPU (Triton interpreter)")
    args = p.parse_args()
    logging.getLogger("torchao").setLevel(logging.ERROR)
    start = time.perf_counter()
    if args.smoke:
        res = suite(SMOKE_CASES, device="cpu", reps=1)
        print(res.markdown())
        return
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --smoke)")
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference stays fp32
    res = suite(only=args.only)
    res.summary["wall_s"] = round(time.perf_counter() - start, 1)
    print(f"{res.summary}\nwrote {res.save()}", flush=True)


if __name__ == "__main__":
    main()
