"""How far the open speed goals sit from what this H200 allows, from committed results (CPU only, no timing).

- Grouped GEMM (1.2x geomean over the Triton peer, ``grouped_mm.json``): each case's roofline time is
  ``max(2MKN / best rate, bytes / copy bandwidth)`` with the roofs of ``gemm_roof.json`` (the fastest bf16 GEMM rate
  measured here and the copy bandwidth; bytes = x + every expert's weight + out, bf16). ``peer / roof`` is the most any
  kernel could gain over the peer on the case; the goal needs, on geomean, ``1.2 / geomean(peer / roof)`` of the
  roofline. Ours and the dense cuBLAS reference are placed on the same scale.
- Routing (40x geomean over the ATen sequence; 50% of copy bandwidth on the 16 MiB+ cases): the floor run
  (``moe_route_floor.json``) times, in one process, our kernel and single-launch kernels that do less than a router:
  a copy with the counting tail, and the scores with the tail and no selection at all. They are simple kernels, not
  proofs (ours beat the score floor on two small cases), so the bound per case is the fastest launch measured, ours
  or a floor; the goal needs the geomean of ATen / that time at 40x or more. Bytes (logits read, outputs written)
  are the suite's (``moe_route_cases.route_bytes``), the copy bandwidth the floor run's own.

- Whole step (1.15x over the fastest of stock, ``torch.compile`` and Liger, ``train_step.json``): the suite's
  ``*_rest`` runs time each baseline with every MoE block taken out (zero output, zero gradients to the optimizer),
  i.e. the step outside what our operators replace. The step can be no faster than the fastest of them plus the
  blocks at their roofline: ``3 x`` the forward GEMM FLOPs (gate/up, down, router) at the best rate, or the expert
  weights moved three times (read forward, read for dgrad, written by wgrad) at copy bandwidth, whichever is slower.
  ``ceiling_x`` = the fastest baseline over that bound.
- Weight-only MXFP4 GEMM (2.5x bf16 cuBLAS at M <= 64, ``mx_gemm.json``): the roof is memory, the MX weights with
  their scales, the bf16 activations and output moved once at copy bandwidth (the one ``mx_gemm`` measured in its
  own run; else ``gemm_roof.json``'s, when both ran on the same device); ``ceiling_x`` = bf16's device time (graph
  replays) over that roof, launch latency left out. The dense and grouped MX goals (0.9x bf16) get no bound here:
  the dense one is met on the H100 (fp8 tensor cores after re-expression); for the grouped one, a kernel converting
  MX to bf16 in registers, hidden behind the MMAs, is bounded by the bf16 GEMM itself (1.0x), and the
  dequantise-then-GEMM design has no strict bound of its own (its bf16 copies are partly reread from L2: at b71629c
  the suite's device times beat a bf16 GEMM plus a dequantisation at full copy bandwidth on 35 of the 44 grouped
  cases that take it).

Geomeans are of unrounded ratios. The roofs are a separate run of the same machine and image.

    python -m benchmarks.goal_bounds    # writes results/goal_bounds.{json,md}
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from benchmarks.harness import RESULTS_DIR, Results, geomean
from benchmarks.moe_route_cases import BIG_LOGITS_BYTES, CASES, MIB, route_bytes
from benchmarks.train_step_cases import BASELINES, MODELS, REST_VARIANTS, ModelCase

GROUPED_GOAL = 1.2
STEP_GOAL = 1.15
ROUTE_BW_GOAL = 50.0  # percent of copy bandwidth
W4_GOAL, W4_MAX_M = 2.5, 64
ROUTE_FLOORS = ("copy_counts_us", "copy_packed_us", "score_tail_us")  # single launches doing less than a router


def roofline_ms(m: int, k: int, n: int, e: int, best_tflops: float, copy_gbps: float, itemsize: int = 2) -> float:
    """The shortest time the roofs allow for a grouped GEMM: compute at the best rate or memory at copy bandwidth."""
    compute = 2.0 * m * k * n / (best_tflops * 1e9)
    memory = itemsize * (m * k + e * k * n + m * n) / (copy_gbps * 1e6)
    return max(compute, memory)


def grouped_bounds(rows: list[dict[str, Any]], best_tflops: float, copy_gbps: float) -> tuple[list[dict], dict]:
    out, exact = [], []
    for r in rows:
        roof = roofline_ms(r["M"], r["K"], r["N"], r["E"], best_tflops, copy_gbps)
        # the dense reference multiplies by one expert's weight: its own roof reads one [K, N], not E of them
        dense_roof = roofline_ms(r["M"], r["K"], r["N"], 1, best_tflops, copy_gbps)
        ratios = dict(
            peer_over_roof=r["peer_ms"] / roof, fly_of_roof=roof / r["fly_ms"], dense_of_roof=dense_roof / r["dense_ms"]
        )
        exact.append(ratios)
        out.append(
            dict(
                case=r["case"],
                roof_ms=round(roof, 4),
                bound="memory" if roof > 2.0 * r["M"] * r["K"] * r["N"] / (best_tflops * 1e9) else "compute",
                peer_ms=r["peer_ms"],
                fly_ms=r["fly_ms"],
                dense_ms=r["dense_ms"],
                **{k: round(v, 3) for k, v in ratios.items()},
            )
        )
    ceiling = geomean([e["peer_over_roof"] for e in exact])
    summary = dict(
        best_tflops=best_tflops,
        copy_GBps=copy_gbps,
        ceiling_x_vs_peer=round(ceiling, 4),
        goal_needs_of_roof=round(GROUPED_GOAL / ceiling, 4),
        fly_of_roof=round(geomean([e["fly_of_roof"] for e in exact]), 3),
        dense_of_roof=round(geomean([e["dense_of_roof"] for e in exact]), 3),
        cases_under_goal_even_at_roof=[
            r["case"] for r, e in zip(out, exact, strict=True) if e["peer_over_roof"] < GROUPED_GOAL
        ],
    )
    return out, summary


def route_bounds(
    floor_rows: list[dict[str, Any]], copy_gbps: float, suite_bytes: dict[str, tuple[int, float]]
) -> tuple[list[dict], dict]:
    """``floor_rows``: ``moe_route_floor`` rows (µs); ``copy_gbps``: that run's copy bandwidth; ``suite_bytes``: per
    case, the bytes the suite counts and the MiB of logits."""
    out, exact = [], []
    for r in floor_rows:
        nbytes, logits_mib = suite_bytes[r["case"]]
        floors = {f: r[f] for f in ROUTE_FLOORS if r.get(f)}
        best_name, best_us = min([("ours_us", r["ours_us"]), *floors.items()], key=lambda kv: kv[1])
        with_scores = min(r["ours_us"], r.get("score_tail_us") or r["ours_us"])
        x = dict(ours=r["aten_us"] / r["ours_us"], best=r["aten_us"] / best_us, scores=r["aten_us"] / with_scores)
        exact.append(x)
        row = dict(
            case=r["case"],
            logits_MiB=logits_mib,
            aten_us=r["aten_us"],
            ours_us=r["ours_us"],
            ours_x=round(x["ours"], 1),
            fastest=best_name.removesuffix("_us"),
            fastest_us=best_us,
            ceiling_x=round(x["best"], 1),
            ceiling_x_with_scores=round(x["scores"], 1),
        )
        if logits_mib >= BIG_LOGITS_BYTES / MIB:
            row["fastest_pct_copy_bw"] = round(100 * nbytes / (best_us * 1e3) / copy_gbps, 1)
            row["with_scores_pct_copy_bw"] = round(100 * nbytes / (with_scores * 1e3) / copy_gbps, 1)
        out.append(row)
    big = [r for r in out if "fastest_pct_copy_bw" in r]
    summary = dict(
        copy_GBps=copy_gbps,
        ours_x=round(geomean([x["ours"] for x in exact]), 2),
        ceiling_x=round(geomean([x["best"] for x in exact]), 2),
        ceiling_x_with_scores=round(geomean([x["scores"] for x in exact]), 2),
        bw_cases_under_goal_at_fastest=[r["case"] for r in big if r["fastest_pct_copy_bw"] < ROUTE_BW_GOAL],
        bw_cases_under_goal_with_scores=[r["case"] for r in big if r["with_scores_pct_copy_bw"] < ROUTE_BW_GOAL],
    )
    return out, summary


def moe_roof_ms(case: ModelCase, best_tflops: float, copy_gbps: float) -> float:
    """The shortest time the roofs allow for all of ``case``'s MoE blocks, forward and backward."""
    c = case.config
    h, k = c["hidden_size"], c["num_experts_per_tok"]
    i = c.get("moe_intermediate_size", c["intermediate_size"])
    e = c.get("num_experts", c.get("num_local_experts"))
    t = case.batch * case.seq
    flops = 3 * (2.0 * t * k * h * 3 * i + 2.0 * t * h * e)  # gate/up + down per routed row, router; x3 fwd+bwd
    weight_bytes = 3 * 2 * e * 3 * h * i  # bf16 experts read twice, their gradient written once
    per_layer = max(flops / (best_tflops * 1e9), weight_bytes / (copy_gbps * 1e6))
    return per_layer * c["num_hidden_layers"]


def step_bounds(
    rows: list[dict[str, Any]], best_tflops: float, copy_gbps: float, models: dict[str, ModelCase] = MODELS
) -> list[dict]:
    """Per (model, precision) with a ``*_rest`` run: the step bound against the fastest baseline. A rest row that
    names the fastest baseline of its own invocation (``same_run_baseline_ms``) is compared with that one."""
    out = []
    for key in dict.fromkeys((r["model"], r["precision"]) for r in rows):
        mine = [r for r in rows if (r["model"], r["precision"]) == key and r.get("step_ms")]
        rest = [r for r in mine if r["variant"] in REST_VARIANTS]
        base = {r["variant"]: r["step_ms"] for r in mine if r["variant"] in BASELINES}
        ours = {r["variant"]: r["step_ms"] for r in mine if "fly" in r["variant"]}
        if not (rest and base and ours):
            continue
        best_rest = min(rest, key=lambda r: r["step_ms"])
        best_base = best_rest.get("same_run_baseline") or min(base, key=base.get)
        base_ms = best_rest.get("same_run_baseline_ms") or base[best_base]
        best_ours = min(ours, key=ours.get)
        roof = moe_roof_ms(models[key[0]], best_tflops, copy_gbps)
        bound = best_rest["step_ms"] + roof
        room = base_ms / STEP_GOAL - best_rest["step_ms"]  # what the blocks may take for the goal
        out.append(
            dict(
                case=f"{key[0]}/{key[1]}",
                best_baseline=best_base,
                baseline_ms=round(base_ms, 3),
                rest=best_rest["variant"],
                rest_ms=round(best_rest["step_ms"], 3),
                moe_roof_ms=round(roof, 3),
                bound_ms=round(bound, 3),
                best_with_fly=best_ours,
                fly_x=round(base[min(base, key=base.get)] / ours[best_ours], 3),
                ceiling_x=round(base_ms / bound, 3),
                goal_needs_of_roof=round(roof / room, 3) if room > 0 else None,
                goal_past_roof=base_ms / bound < STEP_GOAL,
            )
        )
    return out


def w4_bounds(rows: list[dict[str, Any]], copy_gbps: float) -> tuple[list[dict], dict]:
    """``mx_gemm``'s weight-only rows up to ``W4_MAX_M`` rows: each against its memory roof (device time)."""
    out, exact = [], []
    for r in rows:
        if r["kind"] != "w4" or r["m"] > W4_MAX_M or not r.get("ours_graph_ms"):
            continue
        m, n, k = r["m"], r["n"], r["k"]
        roof = (n * k * (0.5 + 1 / 32) + 2 * (m * k + m * n)) / (copy_gbps * 1e6)  # fp4 pairs + E8M0; bf16 x, out
        x = dict(ceiling_x=r["bf16_graph_ms"] / roof, ours_of_roof=roof / r["ours_graph_ms"])
        if r.get("launch_floor_ms"):  # event-timed, as the goal is read: no call beats the host floor nor the roof
            x["event_ceiling_x"] = r["bf16_ms"] / max(r["launch_floor_ms"], roof)
        exact.append(x)
        out.append(dict(case=r["case"], bf16_ms=r["bf16_graph_ms"], ours_ms=r["ours_graph_ms"], roof_ms=round(roof, 4),
                        bound="memory", **{k: round(v, 3) for k, v in x.items()}))  # fmt: skip
    if not exact:
        return out, {}
    ceiling = geomean([e["ceiling_x"] for e in exact])
    summary = dict(
        ceiling_x=round(ceiling, 2),
        ours_of_roof=round(geomean([e["ours_of_roof"] for e in exact]), 3),
        goal_needs_of_roof=round(W4_GOAL / ceiling, 3),
    )
    if all("event_ceiling_x" in e for e in exact):
        event = geomean([e["event_ceiling_x"] for e in exact])
        summary.update(event_ceiling_x=round(event, 2), event_goal_past_floor=event < W4_GOAL)
    return out, summary


def suite_bytes() -> dict[str, tuple[int, float]]:
    """Per routing case: the bytes the routing suite counts (logits + outputs) and the MiB of logits."""
    return {c.name: (route_bytes(c), c.logits_bytes / MIB) for c in CASES}


def run_copy_gbps(payload: dict[str, Any]) -> float:
    """The copy bandwidth a routing result file records in its notes (``copy bandwidth N GB/s``)."""
    for note in payload.get("notes", []):
        if m := re.search(r"copy bandwidth ([0-9.]+) GB/s", note):
            return float(m.group(1))
    raise ValueError("no copy bandwidth in the result file's notes")


def _load(name: str, results: Path) -> dict[str, Any]:
    return json.loads((results / f"{name}.json").read_text())


def main(results: Path = RESULTS_DIR) -> Results:
    roof = _load("gemm_roof", results)
    grouped = _load("grouped_mm", results)
    floor = _load("moe_route_floor", results)
    step = _load("train_step", results)
    mx_gemm = _load("mx_gemm", results)
    res = Results("goal_bounds")
    g_rows, g_sum = grouped_bounds(grouped["rows"], roof["summary"]["best_tflops"], roof["summary"]["copy_GBps"])
    r_rows, r_sum = route_bounds(floor["rows"], run_copy_gbps(floor), suite_bytes())
    for r in g_rows:
        res.add(goal="grouped 1.2x peer", **r)
    for r in r_rows:
        res.add(goal="route 40x aten", **r)
    s_rows = step_bounds(step["rows"], roof["summary"]["best_tflops"], roof["summary"]["copy_GBps"])
    for r in s_rows:
        res.add(goal="step 1.15x best", **r)
    # a roof is the machine's own: the copy bandwidth mx_gemm measured in its own run, else the roofs' where both
    # ran on the same device
    devices = (mx_gemm["environment"].get("device"), roof["environment"].get("device"))
    same = devices[0] == devices[1]
    w4_gbps = mx_gemm.get("summary", {}).get("copy_GBps") or (roof["summary"]["copy_GBps"] if same else None)
    w_rows, w_sum = w4_bounds(mx_gemm["rows"], w4_gbps) if w4_gbps else ([], {})
    if w4_gbps:
        res.summary["w4_device"] = devices[0]
    else:
        res.summary["w4_bound"] = f"not placed: mx_gemm ran on {devices[0]}, the roofs on {devices[1]}"
    for r in w_rows:
        res.add(goal="mx_gemm w4 2.5x bf16", **r)
    res.summary.update({f"grouped_{k}": v for k, v in g_sum.items()})
    res.summary.update({f"w4_{k}": v for k, v in w_sum.items()})
    res.summary.update({f"route_{k}": v for k, v in r_sum.items()})
    res.summary["step_ceiling_x"] = {r["case"]: r["ceiling_x"] for r in s_rows}
    res.summary["step_goal_needs_of_roof"] = {r["case"]: r["goal_needs_of_roof"] for r in s_rows}
    res.summary["sources"] = {
        n: d["environment"].get("git_rev") for n, d in
        (("gemm_roof", roof), ("grouped_mm", grouped), ("moe_route_floor", floor), ("train_step", step),
         ("mx_gemm", mx_gemm))
    }  # fmt: skip
    res.notes += [
        "grouped: roof_ms = max(2MKN / best_tflops, 2 bytes x (MK + EKN + MN) / copy_GBps); peer_over_roof = the most "
        "any kernel could gain over the peer on the case; fly_of_roof / dense_of_roof = roof / their time (1 = at "
        "the roofline; dense's roof reads one expert's weight, E = 1, as the dense GEMM does); goal_needs_of_roof = "
        "the fraction of the roofline a kernel must reach on geomean for 1.2x.",
        "route (graph replay, deterministic off, all from the floor run): ceiling_x = ATen / the fastest launch "
        "measured for the case, ours or a single-launch floor that does less than a router (copy + counting tail; "
        "scores + tail, no selection); ceiling_x_with_scores = ATen / the faster of ours and the score floor (a "
        "launch that computes the scores and counts and selects nothing). Floors are simple kernels, not proofs. "
        "Copy-bandwidth shares: the suite's bytes (logits + outputs) over the floor run's copy bandwidth.",
        "step: bound_ms = rest_ms (the fastest baseline run with its MoE blocks taken out) + moe_roof_ms (the blocks "
        "forward+backward at the roofline); ceiling_x = baseline_ms / bound_ms; fly_x = what the fastest variant with "
        "fly in it reached (against the table's fastest baseline); goal_needs_of_roof = the fraction of the roofline "
        "the blocks (forward+backward, routing and glue included) must reach for 1.15x (None: impossible); "
        "goal_past_roof: even blocks at the roofline leave the step under 1.15x.",
        "w4 (device time, mx_gemm's graph replays, on w4_device): roof_ms = MX weights (fp4 pairs and E8M0 scales) + "
        "bf16 activations and output at mx_gemm's own copy bandwidth, launch latency left out; ceiling_x = bf16 / "
        "roof_ms; ours_of_roof = roof / ours; goal_needs_of_roof = 2.5 / ceiling (geomean). The goal is read "
        "event-timed (host included): event_ceiling_x = bf16's event time / the larger of the roof and the launch "
        "floor (an eager call allocating the output and launching one ATen kernel, event-timed in the same run); "
        "event_goal_past_floor: below 2.5x on geomean even for a kernel at the roof with that floor's host cost.",
    ]
    res.save(out_dir=results)
    return res


if __name__ == "__main__":
    main()
