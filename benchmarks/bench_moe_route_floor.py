"""How fast can one routing launch be? Measured floors for the routing suite (and ``goal_bounds``), timed the way
``bench_moe_route`` times (CUDA-graph replay, 20 calls per graph), beside the ATen sequence and our kernel, on the
suite's ten cases:

- ``empty``: a kernel that does nothing, on the grid our launcher uses (launch and graph-node cost);
- ``copy``: reads the logits and writes outputs of the routing's size ([T, k] fp32 weights and int32 ids), one
  row max per token so every byte is used: the memory floor of any single-launch router;
- ``copy_counts``: ``copy`` plus the ticket counting tail (per-program relaxed integer atomics, a barrier, one
  acq_rel ticket; the last program writes counts and offsets and re-zeroes the workspace; the launcher's tail above
  128 experts): the floor of a single launch that also counts this way;
- ``copy_packed``: ``copy`` plus the kernel's packed tail (``_packed_tail``, the launcher's tail up to 128 experts:
  one relaxed int64 atomic per expert and program adds a contributor, the tally and its prefix; the program that
  completes an expert's word stores its count and offset and re-zeroes it; no ticket);
- ``score_tail``: ``copy`` plus the per-element score work any exact router must do before it can select, and the
  launcher's tail (packed up to 128 experts, ticket above): for biased routers the sigmoid of every logit (the
  kernel's fast form, ``ex2.approx`` + ``div.approx``) plus the bias, then the row max of that; for softmax without
  renormalisation the row max, ``exp`` of every logit and the row sum; otherwise nothing (the logits rank the
  scores). No selection at all: the floor of any single launch that computes this case's scores and counts.

A floor is only a floor if its own launch shape is good, so each is timed over a grid of launch shapes (``ROWS`` x
``PROGRAMS_PER_SM``, tiles of at most 16384 logits) and the fastest is reported with its shape.

``ceiling_vs_aten_<floor>`` = ATen sequence / floor: the speedup no single-launch kernel with this output could beat
in this measurement. ``ours_over_<floor>``: how far our kernel (the launcher's choice) is from a floor;
``ours_ticket``: our kernel with the ticket tail, side by side.

    python -m benchmarks.bench_moe_route_floor    # about 6 minutes on an H200 (writes moe_route_floor.*)
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from benchmarks.harness import Results, copy_bandwidth_gbps, geomean, time_graph_ms
from benchmarks.moe_route_cases import CASES, aten_route, route_args, route_bytes, route_inputs
from fly_lightning.kernels.triton._moe_route_config import _sm_count, default_tail, launch_config
from fly_lightning.kernels.triton._moe_route_kernel import _MINUS_LOG2E, _packed_tail
from fly_lightning.kernels.triton.moe_route import _plan, moe_route_triton


@triton.jit
def _empty(X):
    pass


@triton.jit
def _copy_floor(X, stride_x, B, W, ID, WS, COUNTS, OFFSETS, T, n_tiles, E: tl.constexpr, K: tl.constexpr,
                KP: tl.constexpr, BE: tl.constexpr, ROWS: tl.constexpr, TAIL: tl.constexpr,
                SCORE: tl.constexpr = 0):  # fmt: skip
    pid = tl.program_id(0)
    e = tl.arange(0, BE)
    kk = tl.arange(0, KP)
    if SCORE == 2:
        bias = tl.load(B + e, mask=e < E, other=0.0)
    for tile in range(pid, n_tiles, tl.num_programs(0)):
        rows = tile * ROWS + tl.arange(0, ROWS)
        ok = rows < T
        valid = ok[:, None] & (e < E)[None, :]
        x = tl.load(X + rows[:, None].to(tl.int64) * stride_x + e[None, :], mask=valid, other=0.0).to(tl.float32)
        if SCORE == 1:  # softmax's normaliser over all experts
            m = tl.max(tl.where(valid, x, float("-inf")), axis=1)
            m = m + tl.sum(tl.where(valid, tl.exp(x - m[:, None]), 0.0), axis=1)
        elif SCORE == 2:  # biased sigmoid scores, as the kernel computes them
            v = libdevice.fast_dividef(1.0, 1.0 + tl.math.exp2(x * _MINUS_LOG2E)) + bias[None, :]
            m = tl.max(tl.where(valid, v, float("-inf")), axis=1)
        else:
            m = tl.max(x, axis=1)
        out = rows[:, None].to(tl.int64) * K + kk[None, :]
        out_ok = ok[:, None] & (kk < K)[None, :]
        tl.store(W + out, m[:, None] + kk[None, :], mask=out_ok)
        tl.store(ID + out, m[:, None].to(tl.int32) + kk[None, :], mask=out_ok)
    tally = (e + pid) & 1  # a stand-in for the program's per-expert counts
    if TAIL == 1:  # the ticket tail (relaxed form): tallies by atomics, a ticket, the last program publishes and
        # re-zeroes
        tl.atomic_add(WS + 1 + e, tally, mask=(e < E) & (tally != 0), sem="relaxed")
        tl.debug_barrier()
        ticket = tl.atomic_add(WS, 1, sem="acq_rel")
        if ticket == tl.num_programs(0) - 1:
            tl.debug_barrier()
            counts = tl.atomic_xchg(WS + 1 + e, 0, mask=e < E, sem="relaxed")
            tl.store(COUNTS + e, counts, mask=e < E)
            tl.store(OFFSETS + e, tl.cumsum(tl.where(e < E, counts, 0), axis=0), mask=e < E)
            tl.atomic_xchg(WS, 0, sem="relaxed")
    elif TAIL == 2:  # the kernel's own packed tail (WS as int64 words; the permutation-only arguments unused)
        _packed_tail(WS, WS, COUNTS, OFFSETS, tally, tally, e, e, pid, E, BE, False)


ROWS = (16, 32, 64, 128, 256, 512)  # tokens per tile, kept to tiles of at most 16384 logits
PROGRAMS_PER_SM = (1, 2, 4, 8)


TAILS = {"copy": 0, "copy_counts": 1, "copy_packed": 2, "score_tail": None}  # score_tail: the launcher's tail


def _score_kind(case) -> int:
    """What ``score_tail`` computes per element: 2 biased sigmoid, 1 softmax normaliser, 0 nothing (the launcher
    ranks the logits themselves when there is no bias and no groups; then only an unrenormalised softmax needs
    every element's exp)."""
    if case.bias or case.n_groups is not None:
        return 2 if case.score == "sigmoid" else 1
    return 1 if case.score == "softmax" and not case.renormalize else 0


def _floor_fn(case, tail: str, ws: torch.Tensor, rows: int, programs_per_sm: int, bias: torch.Tensor | None = None):
    be = triton.next_power_of_2(case.experts)
    n_tiles = triton.cdiv(case.tokens, rows)
    progs = min(n_tiles, _sm_count(0) * programs_per_sm)
    kp = triton.next_power_of_2(case.k)
    score = _score_kind(case) if tail == "score_tail" else 0
    if score == 2 and bias is None:  # a grouped sigmoid router without a selection bias adds zeros
        bias = torch.zeros(case.experts, dtype=torch.float32, device="cuda")
    if tail == "score_tail":  # the launcher's tail for this width
        tail = "copy_packed" if default_tail(case.experts) == "packed" else "copy_counts"

    def fn(x):
        w = torch.empty((case.tokens, case.k), dtype=torch.float32, device=x.device)
        ids = torch.empty((case.tokens, case.k), dtype=torch.int32, device=x.device)
        counts = torch.empty(case.experts, dtype=torch.int32, device=x.device)
        offsets = torch.empty(case.experts, dtype=torch.int32, device=x.device)
        ws_t = ws[: 2 * case.experts].view(torch.int64) if tail == "copy_packed" else ws
        b = bias if bias is not None else w  # read only when SCORE == 2, which always has a bias (above)
        _copy_floor[(progs,)](x, x.stride(0), b, w, ids, ws_t, counts, offsets, case.tokens, n_tiles,
                              E=case.experts, K=case.k, KP=kp, BE=be, ROWS=rows, TAIL=TAILS[tail], SCORE=score,
                              num_warps=4)  # fmt: skip
        return w, ids, counts, offsets

    return fn


def _time_us(fn, inputs) -> float:
    return 1e3 * time_graph_ms(fn, inputs, calls_per_graph=20, replays=20)["median_ms"]


def _best_floor(case, tail: str, ws: torch.Tensor, inputs, bias: torch.Tensor | None) -> tuple[float, str]:
    """(fastest time in us, its launch shape) over ``ROWS`` x ``PROGRAMS_PER_SM``."""
    be = triton.next_power_of_2(case.experts)
    times = {}
    for rows in [r for r in ROWS if r * be <= 16384] or ROWS[:1]:
        for pps in PROGRAMS_PER_SM:
            times[f"{rows}r_{pps}pps"] = _time_us(_floor_fn(case, tail, ws, rows, pps, bias), inputs)
    shape = min(times, key=times.get)
    return times[shape], shape


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--floors", default=",".join(TAILS), help=f"comma-separated, of {', '.join(TAILS)}")
    floors = p.parse_args().floors.split(",")
    if unknown := sorted(set(floors) - set(TAILS)):
        raise SystemExit(f"unknown floors {unknown}; known: {', '.join(TAILS)}")
    dev = torch.device("cuda")
    copy_gbps = copy_bandwidth_gbps(dev)
    res = Results("moe_route_floor")
    ws = torch.zeros(2 * 1024, dtype=torch.int32, device=dev)  # the tails' workspace, left zero by each launch
    ceil = {name: [] for name in floors}
    ours_vs_aten, ours_ticket_vs_aten = [], []
    for case in CASES:
        inputs, bias = route_inputs(case, dev)
        args = route_args(case, bias)
        plan = _plan(case.tokens, case.experts, case.k, case.dtype, case.experts, case.score, case.renormalize,
                     bias is not None, case.n_groups, case.topk_groups, False, dev, None, False)  # fmt: skip
        ticket = replace(launch_config(case.experts, case.k, case.dtype.itemsize, case.n_groups is not None,
                                       bias is not None), tail="ticket")  # fmt: skip
        fns = {
            "empty": lambda x, p=plan.programs: _empty[(p,)](x),
            "ours": lambda x, a=args: moe_route_triton(x, *a, False),
            "ours_ticket": lambda x, a=args, c=ticket: moe_route_triton(x, *a, False, config=c),
            "aten": lambda x, a=args: aten_route(x, *a),
        }
        row = dict(case=case.name, T=case.tokens, E=case.experts, k=case.k, dtype=str(case.dtype).split(".")[-1],
                   programs=plan.programs)  # fmt: skip
        for name, fn in fns.items():
            row[f"{name}_us"] = round(_time_us(fn, inputs), 2)
        for name in floors:
            us, shape = _best_floor(case, name, ws, inputs, bias)
            row[f"{name}_us"], row[f"{name}_shape"] = round(us, 2), shape
        for name in ("copy", "score_tail"):
            if name in floors:
                row[f"{name}_pct_copy_bw"] = round(100 * route_bytes(case) / (row[f"{name}_us"] * 1e3) / copy_gbps, 1)
        for name in ceil:
            row[f"ceiling_vs_aten_{name}"] = round(row["aten_us"] / row[f"{name}_us"], 1)
            ceil[name].append(row["aten_us"] / row[f"{name}_us"])
        row["ours_vs_aten"] = round(row["aten_us"] / row["ours_us"], 1)
        for name in ("copy_counts", "copy_packed", "score_tail"):
            if name in floors:
                row[f"ours_over_{name}"] = round(row["ours_us"] / row[f"{name}_us"], 2)
        row["ours_ticket_vs_aten"] = round(row["aten_us"] / row["ours_ticket_us"], 1)
        ours_vs_aten.append(row["aten_us"] / row["ours_us"])
        ours_ticket_vs_aten.append(row["aten_us"] / row["ours_ticket_us"])
        res.add(**row)
    res.summary = {f"geomean_ceiling_vs_aten_{k}": round(geomean(v), 1) for k, v in ceil.items()}
    res.summary["geomean_ours_vs_aten"] = round(geomean(ours_vs_aten), 1)
    res.summary["geomean_ours_ticket_vs_aten"] = round(geomean(ours_ticket_vs_aten), 1)
    res.notes.append(f"copy bandwidth {copy_gbps:.0f} GB/s; graph replay, 20 calls per graph; deterministic off")
    res.notes.append(
        f"floors: fastest of rows per tile {ROWS} (tiles <= 16384 logits) x programs per SM "
        f"{PROGRAMS_PER_SM}, 4 warps; *_shape names the winner"
    )
    print(res.save())


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    main()
