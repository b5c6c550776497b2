"""Probe (GPU): the swapped MX grouped plan (weights converted as the MMA's register operand, x dequantised to bf16
first) at many rows per group, against the bf16 prepass, on grouped suite cases.

The prepass converts every weight element into a bf16 copy in memory on each call; the swapped form reads the MX
weights once per row tile and converts them in registers, and only x goes through memory as bf16. Device time from
CUDA-graph replays, side by side per case, after a check against the fp32 product of the dequantised operands:
``bf16`` (our grouped GEMM on the dequantised operands: the ratios' base), ``plan`` (the table's pick), ``prepass``,
``wide`` (``SWAPPED_WIDE``: x dequantised into the tiles' K order, then the swapped kernel), ``wide-gathered``
(the same kernel on bf16 x in natural order, gathered into that K order by its loads: what ``x_prepass`` did before
it stored x in that order). Prints; not a suite.

What it showed (H100, Triton 3.6; a4bb954 with the kernel then taking x in either order): 256x128 swapped tiles
(rows x weights, 3 stages, 8 warps) on bf16 x gathered ran 0.39-0.49x the bf16 grouped GEMM, on x stored in the
fragment's order 0.70-0.89x (1.74-1.88x faster: 4-byte gathers became 16-byte copies); 128x128 and 64x128 tiles, 4
warps with two programs per SM, 2 or 4 stages and 128x256 (568 bytes of spills) were slower. With x's
dequantisation added, the wide plan beat the fp8 form (since removed) at 256-512 rows per group and tied or lost to
the prepass from 1024 (``_mx_grouped_mm_kernel.SWAP_WIDE_MAX_ROWS``).

    python -m benchmarks.probe_mx_swap_tiles [--quick | --band]
"""

from __future__ import annotations

import sys
from dataclasses import replace

import torch
import triton

from benchmarks.grouped_mm_cases import Case, cases, mx_probe_operands, uniform_counts
from benchmarks.harness import print_probe_rows, probe_each, probe_graph_ms
from fly_lightning.kernels.triton import _mx_grouped_mm_kernel as mk
from fly_lightning.kernels.triton._mx_dequant import dequantize

CASES = (
    "uniform-E64-m256-K2048-N2048",
    "uniform-E32-m512-K2048-N4096",
    "uniform-E8-m4096-K4096-N4096",
    "qwen3-30b-a3b-gate_up",
    "qwen3-30b-a3b-down",
    "olmoe-1b-7b-gate_up",
    "deepseek-v3-ep8-down",
)


def _case(fmt: str, case) -> None:
    xd, xs, wd, ws, args, bf16, ref, out = mx_probe_operands(case, fmt)
    offs = args[-1]
    w, w_scale = args[3], args[4]
    xb = dequantize(xd, xs, fmt).to(torch.bfloat16)
    gathered = replace(mk.SWAPPED_WIDE, x_prepass=False)  # bf16 x as it is: read in the fragment's order by gathers
    fns = {
        "bf16": bf16,
        "plan": lambda: mk.launch(*args[:6], offs, out),
        "prepass": lambda: mk.launch(*args[:6], offs, out, config=mk.PREPASS),
        "wide": lambda: mk.launch(*args[:6], offs, out, config=mk.SWAPPED_WIDE),
        "wide-gathered": lambda: mk.launch(xb, None, None, w, w_scale, fmt, offs, out, config=gathered),
    }
    _time_and_print(fmt, case, fns, ref)


def _time_and_print(fmt: str, case: Case, fns: dict, ref: torch.Tensor) -> None:
    ms, errs = probe_graph_ms({k: (lambda *_, f=f: f()) for k, f in fns.items()}, [()], ref, f"{fmt} {case.name}")
    flops = 2 * case.m * case.n * case.k
    print(f"{fmt} {case.name} (plan {mk.choose_config(case.m, case.e, False, fmt, fmt, True).label()})")
    print_probe_rows(ms, errs, flops)


# ``--band``: 64-128 rows per group (Qwen3-30B-A3B gate/up's K and N, 128 experts): the swapped tiles of 64 and of 128
# rows against the in-loop 64-row tiles, which the table took at 65-95 rows before this probe (0285c85)
BAND_ROWS = (64, 72, 80, 88, 96, 128)


def _band(fmt: str, per: int) -> None:
    case = Case(f"band-E128-m{per}-K2048-N1536", "band", 128, 2048, 1536, uniform_counts(128 * per, 128))
    xd, xs, wd, ws, args, bf16, ref, out = mx_probe_operands(case, fmt)
    offs = args[-1]
    fns = {
        "bf16": bf16,
        "plan": lambda: mk.launch(*args[:6], offs, out),
        "in-loop": lambda: mk.launch(*args[:6], offs, out, config=mk.SMALL_GROUPS),
        "swap64": lambda: mk.launch(*args[:6], offs, out, config=mk.SWAPPED),
        "swap128": lambda: mk.launch(*args[:6], offs, out, config=mk.SWAPPED_MID),
    }
    _time_and_print(fmt, case, fns, ref)


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    if "--band" in sys.argv:
        items = [(fmt, per) for fmt in ("mxfp8_e4m3", "mxfp4_e2m1") for per in BAND_ROWS]
        probe_each(lambda it: _band(*it), items, lambda it: f"{it[0]} {it[1]} rows")
        return
    by_name = {c.name: c for c in cases()}
    names = CASES[:2] if "--quick" in sys.argv else CASES
    items = [(fmt, by_name[n]) for fmt in ("mxfp8_e4m3", "mxfp4_e2m1") for n in names]
    probe_each(lambda it: _case(*it), items, lambda it: f"{it[0]} {it[1].name}")


if __name__ == "__main__":
    main()
