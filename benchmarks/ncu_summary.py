"""Summarise an Nsight Compute capture of the routing kernel (``ncu_route.sh``'s CSV exports) as markdown.

Per profiled launch (in ``profile_route_ncu.py``'s order): time, issue rate, occupancy and the top stall reasons from
the details page; and, from the SASS page, the kernel split into runs of instructions executed equally often (the
tile loop, the exact-pass branch, the tail), each with its share of executed instructions and of stall samples.

    python -m benchmarks.ncu_summary route_ncu.details.csv route_ncu.sass.csv --labels a,b,... > route_ncu.md
"""

from __future__ import annotations

import argparse
import csv
import io
from collections import Counter

DETAILS = [
    ("Duration", "us"),
    ("Executed Instructions", "warp instructions"),
    ("Executed Ipc Active", "per cycle, active SMs"),
    ("Executed Ipc Elapsed", "per cycle, all SMs"),
    ("Issue Slots Busy", "%"),
    ("No Eligible", "% of cycles"),
    ("Registers Per Thread", ""),
    ("Achieved Occupancy", "%"),
    ("DRAM Throughput", "% of peak"),
]


def details(path: str) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for row in csv.DictReader(open(path)):
        out.setdefault(row["ID"], {})[row["Metric Name"]] = row["Metric Value"]
    return out


def sass_kernels(path: str) -> list[list[dict]]:
    parts = open(path).read().split('"Kernel Name",')[1:]
    return [list(csv.DictReader(io.StringIO(p.split("\n", 1)[1]))) for p in parts]


def runs(rows: list[dict], min_share: float = 0.01) -> list[dict]:
    """Consecutive instructions with the same execution count, where they hold at least ``min_share`` of the
    executed instructions or of the samples."""
    stalls = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    out: list[dict] = []
    for i, r in enumerate(rows):
        ex = int(r["Instructions Executed"])
        if not out or out[-1]["executed"] != ex:
            out.append(dict(first=i, n=0, executed=ex, samples=0, stalls=Counter()))
        cur = out[-1]
        cur["n"] += 1
        cur["samples"] += int(r["Warp Stall Sampling (All Samples)"])
        for s in stalls:
            cur["stalls"][s[6:]] += int(r[s])
    work = sum(c["n"] * c["executed"] for c in out) or 1
    samples = sum(c["samples"] for c in out) or 1
    for c in out:
        c["work"], c["sample_share"] = c["n"] * c["executed"] / work, c["samples"] / samples
    return [c for c in out if c["work"] >= min_share or c["sample_share"] >= min_share]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("details")
    parser.add_argument("sass")
    parser.add_argument("--labels", required=True, help="comma-separated, one per profiled launch")
    opts = parser.parse_args()
    labels = opts.labels.split(",")
    det = details(opts.details)
    ids = sorted(det, key=int)
    print("## Per launch\n")
    print("| metric | " + " | ".join(labels) + " |")
    print("|---|" + "---|" * len(labels))
    for name, unit in DETAILS:
        vals = [det[i].get(name, "") for i in ids]
        print(f"| {name}{f' ({unit})' if unit else ''} | " + " | ".join(vals) + " |")
    print("\n## Instruction runs (SASS order; runs under 1% of both instructions and samples left out)\n")
    for label, rows in zip(labels, sass_kernels(opts.sass), strict=True):
        stalls = Counter()
        for c in runs(rows, 0.0):
            stalls.update(c["stalls"])
        top = ", ".join(f"{k} {v}" for k, v in stalls.most_common(6))
        print(f"### {label}\n\nstall samples: {top}\n")
        print("| first SASS line | instructions | executed (warps) | executed share | samples share | top stalls |")
        print("|---|---|---|---|---|---|")
        for c in runs(rows):
            st = ", ".join(f"{k} {v}" for k, v in c["stalls"].most_common(3))
            print(f"| {c['first']} | {c['n']} | {c['executed']} | {c['work']:.1%} | {c['sample_share']:.1%} | {st} |")
        print()


if __name__ == "__main__":
    main()
