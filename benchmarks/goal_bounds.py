"""How far the open speed goals sit from what this H200 allows, from committed results (CPU only, no timing).

- Grouped GEMM (issue 3, 1.2x geomean over the Triton peer): each case's roofline time is
  ``max(2MKN / best rate, bytes / copy bandwidth)`` with the roofs of ``gemm_roof.json`` (the fastest bf16 GEMM rate
  measured here and the copy bandwidth; bytes = x + every expert's weight + out, bf16). ``peer / roof`` is the most any
  kernel could gain over the peer on the case; the goal needs, on geomean, ``1.2 / geomean(peer / roof)`` of the
  roofline. Ours and the dense cuBLAS reference are placed on the same scale.
- Routing (issue 5, 40x geomean over the ATen sequence; 50% of copy bandwidth on the 16 MiB+ cases): the floor run
  (``moe_route_floor.json``) times, in one process, our kernel and single-launch kernels that do less than a router:
  a copy with the counting tail, and the scores with the tail and no selection at all. The best known time of a case
  is the fastest of ours and those floors; the goal needs the geomean of ATen / best known at 40x or more.

Ratios are taken inside one run (the roofs are a separate run of the same machine and image).

    python -m benchmarks.goal_bounds    # writes results/goal_bounds.{json,md}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.harness import RESULTS_DIR, Results, geomean

GROUPED_GOAL = 1.2
ROUTE_GOAL = 40.0
ROUTE_BW_GOAL = 50.0  # percent of copy bandwidth
ROUTE_FLOORS = ("copy_counts_us", "copy_packed_us", "score_tail_us")  # single launches doing less than a router
BIG_LOGITS_MIB = 16


def roofline_ms(m: int, k: int, n: int, e: int, best_tflops: float, copy_gbps: float, itemsize: int = 2) -> float:
    """The shortest time the roofs allow for a grouped GEMM: compute at the best rate or memory at copy bandwidth."""
    compute = 2.0 * m * k * n / (best_tflops * 1e9)
    memory = itemsize * (m * k + e * k * n + m * n) / (copy_gbps * 1e6)
    return max(compute, memory)


def grouped_bounds(rows: list[dict[str, Any]], best_tflops: float, copy_gbps: float) -> tuple[list[dict], dict]:
    out = []
    for r in rows:
        roof = roofline_ms(r["M"], r["K"], r["N"], r["E"], best_tflops, copy_gbps)
        out.append(
            dict(
                case=r["case"],
                roof_ms=round(roof, 4),
                bound="memory" if roof > 2.0 * r["M"] * r["K"] * r["N"] / (best_tflops * 1e9) else "compute",
                peer_ms=r["peer_ms"],
                fly_ms=r["fly_ms"],
                dense_ms=r["dense_ms"],
                peer_over_roof=round(r["peer_ms"] / roof, 3),
                fly_of_roof=round(roof / r["fly_ms"], 3),
                dense_of_roof=round(roof / r["dense_ms"], 3),
            )
        )
    ceiling = geomean([r["peer_over_roof"] for r in out])
    summary = dict(
        best_tflops=best_tflops,
        copy_GBps=copy_gbps,
        ceiling_x_vs_peer=round(ceiling, 3),
        goal_needs_of_roof=round(GROUPED_GOAL / ceiling, 3),
        fly_of_roof=round(geomean([r["fly_of_roof"] for r in out]), 3),
        dense_of_roof=round(geomean([r["dense_of_roof"] for r in out]), 3),
        cases_under_goal_even_at_roof=[r["case"] for r in out if r["peer_over_roof"] < GROUPED_GOAL],
    )
    return out, summary


def route_bounds(floor_rows: list[dict[str, Any]], route_rows: list[dict[str, Any]]) -> tuple[list[dict], dict]:
    """``floor_rows``: ``moe_route_floor`` rows (µs); ``route_rows``: the suite's rows, for bytes moved per case."""
    suite = {r["case"]: r for r in route_rows if not r.get("deterministic")}
    out = []
    for r in floor_rows:
        s = suite[r["case"]]
        nbytes = s["GBps"] * s["ours_graph_ms"] * 1e6  # the suite's bytes: logits read + outputs written
        floors = {f: r[f] for f in ROUTE_FLOORS if r.get(f)}
        best_name, best_us = min([("ours_us", r["ours_us"]), *floors.items()], key=lambda kv: kv[1])
        no_sel = min(r["ours_us"], r["score_tail_us"])
        row = dict(
            case=r["case"],
            logits_MiB=s["logits_MiB"],
            aten_us=r["aten_us"],
            ours_us=r["ours_us"],
            ours_x=round(r["aten_us"] / r["ours_us"], 1),
            best_known=best_name.removesuffix("_us"),
            best_known_us=best_us,
            ceiling_x=round(r["aten_us"] / best_us, 1),
            ceiling_x_with_scores=round(r["aten_us"] / no_sel, 1),
        )
        if s["logits_MiB"] >= BIG_LOGITS_MIB:
            copy_gbps = s["GBps"] / (s["pct_copy_bw"] / 100)
            row["best_known_pct_copy_bw"] = round(100 * nbytes / (best_us * 1e3) / copy_gbps, 1)
            row["with_scores_pct_copy_bw"] = round(100 * nbytes / (no_sel * 1e3) / copy_gbps, 1)
        out.append(row)
    big = [r for r in out if "best_known_pct_copy_bw" in r]
    summary = dict(
        ours_x=round(geomean([r["ours_x"] for r in out]), 1),
        ceiling_x=round(geomean([r["ceiling_x"] for r in out]), 1),
        ceiling_x_with_scores=round(geomean([r["ceiling_x_with_scores"] for r in out]), 1),
        bw_cases_under_goal_at_best_known=[r["case"] for r in big if r["best_known_pct_copy_bw"] < ROUTE_BW_GOAL],
        bw_cases_under_goal_with_scores=[r["case"] for r in big if r["with_scores_pct_copy_bw"] < ROUTE_BW_GOAL],
    )
    return out, summary


def _load(name: str, results: Path) -> dict[str, Any]:
    return json.loads((results / f"{name}.json").read_text())


def main(results: Path = RESULTS_DIR) -> Results:
    roof = _load("gemm_roof", results)
    grouped = _load("grouped_mm_suite", results)
    floor, route = _load("moe_route_floor", results), _load("moe_route", results)
    res = Results("goal_bounds")
    g_rows, g_sum = grouped_bounds(grouped["rows"], roof["summary"]["best_tflops"], roof["summary"]["copy_GBps"])
    r_rows, r_sum = route_bounds(floor["rows"], route["rows"])
    for r in g_rows:
        res.add(goal="grouped 1.2x peer", **r)
    for r in r_rows:
        res.add(goal="route 40x aten", **r)
    res.summary.update({f"grouped_{k}": v for k, v in g_sum.items()})
    res.summary.update({f"route_{k}": v for k, v in r_sum.items()})
    res.summary["sources"] = {
        n: d["environment"].get("git_rev") for n, d in
        (("gemm_roof", roof), ("grouped_mm_suite", grouped), ("moe_route_floor", floor), ("moe_route", route))
    }  # fmt: skip
    res.notes += [
        "grouped: roof_ms = max(2MKN / best_tflops, 2 bytes x (MK + EKN + MN) / copy_GBps); peer_over_roof = the most "
        "any kernel could gain over the peer on the case; fly_of_roof / dense_of_roof = roof / their time (1 = at "
        "the roofline); goal_needs_of_roof = the fraction of the roofline a kernel must reach on geomean for 1.2x.",
        "route (graph replay, deterministic off, all from the floor run): ceiling_x = ATen / the fastest of our kernel "
        "and the single-launch floors that do less than a router (copy + counting tail; scores + tail, no "
        "selection); ceiling_x_with_scores = ATen / the faster of ours and the score floor (the least a router that "
        "computes its scores does). Copy-bandwidth shares use the suite's bytes (logits + outputs).",
    ]
    res.save(out_dir=results)
    return res


if __name__ == "__main__":
    main()
