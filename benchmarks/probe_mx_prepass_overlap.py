"""Probe (GPU): the MX grouped prepass plan with its weight conversion overlapped with the bf16 grouped GEMM, on
uniform-load cases of 1024 rows per group and more (where the plan converts both operands to bf16 in memory first).

The prepass runs its conversion (bandwidth-bound) and then the GEMM (compute-bound) one after the other. Here the
experts are split into ``C`` chunks: x is converted first, then chunk ``i + 1``'s weights are converted on a side
stream while the GEMM of chunk ``i`` runs on the main one (``overlap<C>``; ``-prio``: the GEMM's stream at high
priority, so the block scheduler hands freed SMs to the GEMM first). Uniform loads only: the chunks' row ranges are
known on the host here (the plan would read them from the offsets on the device). Beside them ``bf16`` (our grouped
GEMM on the dequantised operands: the ratios' base), ``plan`` (the public plan, the prepass at these sizes),
``convert`` (the two conversions alone) and ``chunked<C>`` (the chunks on one stream: the chunking's own cost).
Device time from CUDA-graph replays, side by side per case, after a check against the fp32 product of the
dequantised operands. Prints; not a suite.

What it showed (H200, Triton 3.6, 87cae86; MXFP8 on all six cases, MXFP4 on the first, where a capture failure left
the rest out of memory): the best overlap form runs -1.5% to +3.3% against the plain prepass (e.g. DeepSeek-V3
gate/up 3.47 against 3.52 ms, OLMoE gate/up 1.09 against 1.11), about the spread of the chunking alone
(``chunked<C>``: -3% to +1%), although the conversions alone take 11-36% of the bf16 GEMM's time (0.17-0.87 ms).
Presumably the persistent GEMM holds every SM, so a conversion launched beside it waits for the chunk's tiles to
finish: the two barely run at once. Not taken.

    python -m benchmarks.probe_mx_prepass_overlap
"""

from __future__ import annotations

import torch
import triton

from benchmarks.grouped_mm_cases import cases, mx_probe_operands
from benchmarks.harness import print_probe_rows, probe_each, probe_graph_ms
from fly_lightning.kernels.triton import _grouped_mm_kernel as gk
from fly_lightning.kernels.triton import _mx_grouped_mm_kernel as mk
from fly_lightning.kernels.triton._mx_dequant import dequantize

CASES = (
    "uniform-E8-m4096-K4096-N4096",
    "uniform-E16-m1024-K4096-N4096",
    "mixtral-8x7b-down",
    "olmoe-1b-7b-gate_up",
    "deepseek-v3-ep8-gate_up",
    "deepseek-v3-ep8-down",
)
CHUNKS = (2, 4)


def _pipeline(xd, xs, w2, ws2, fmt, e, n, rows, offs, out, chunks, side, main, overlap):
    """x converted, then per chunk of experts its weights converted (on ``side`` when ``overlap``) and its GEMM run on
    ``main``; returns ``out``. The chunks' bf16 copies live until both streams have joined the caller's, so their
    blocks go back to the allocator only then (no ``record_stream``: under graph capture its deferred events once left
    work unjoined)."""
    per = e // chunks
    caller = torch.cuda.current_stream()
    main.wait_stream(caller)
    side.wait_stream(caller)
    with torch.cuda.stream(main):
        xb = dequantize(xd, xs, fmt)
    conv = side if overlap else main
    wbs, done = [None] * chunks, [torch.cuda.Event() for _ in range(chunks)]

    def convert(i):
        with torch.cuda.stream(conv):
            wbs[i] = dequantize(w2[i * per * n : (i + 1) * per * n], ws2[i * per * n : (i + 1) * per * n], fmt)
            done[i].record(conv)

    convert(0)
    for i in range(chunks):
        if i + 1 < chunks:
            convert(i + 1)
        with torch.cuda.stream(main):
            main.wait_event(done[i])
            r0, r1 = i * per * rows, (i + 1) * per * rows
            gk.launch(xb[r0:r1], wbs[i].view(per, n, -1).transpose(1, 2), offs[i * per : (i + 1) * per] - r0,
                      out[r0:r1])  # fmt: skip
    caller.wait_stream(main)
    caller.wait_stream(side)
    return out


def _case(fmt: str, case) -> None:
    xd, xs, wd, ws, args, bf16, ref, out = mx_probe_operands(case, fmt)
    e, n, rows = case.e, case.n, case.m // case.e
    offs = args[-1]
    w2, ws2 = wd, ws  # [E * N, K / per_byte] rows and their scales
    side = torch.cuda.Stream()
    main = torch.cuda.Stream()
    main_hi = torch.cuda.Stream(priority=-1)
    fns = {
        "bf16": bf16,
        "plan": lambda: mk.launch(*args[:6], offs, out),
        # timing only: hands the reference back for probe_graph_ms's check
        "convert": lambda: (dequantize(xd, xs, fmt, w2, ws2, fmt), ref)[1],
    }
    for c in CHUNKS:
        if e % c:
            continue
        common = (xd, xs, w2, ws2, fmt, e, n, rows, offs, out, c, side)
        fns[f"chunked{c}"] = lambda common=common: _pipeline(*common, main, False)
        fns[f"overlap{c}"] = lambda common=common: _pipeline(*common, main, True)
        fns[f"overlap{c}-prio"] = lambda common=common: _pipeline(*common, main_hi, True)
    ms, errs = probe_graph_ms({k: (lambda *_, f=f: f()) for k, f in fns.items()}, [()], ref, f"{fmt} {case.name}")
    print(f"{fmt} {case.name} (plan {mk.choose_config(case.m, case.e, False, fmt, fmt, True).label()})")
    print_probe_rows(ms, errs, case.flops)


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    by_name = {c.name: c for c in cases()}
    items = [(fmt, by_name[n]) for fmt in ("mxfp8_e4m3", "mxfp4_e2m1") for n in CASES]
    probe_each(lambda it: _case(*it), items, lambda it: f"{it[0]} {it[1].name}")


if __name__ == "__main__":
    main()
