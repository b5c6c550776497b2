"""RMSNorm forward suite (GPU): fly-lightning against F.rms_norm, torch.compile of the reference and Liger-Kernel.

Shapes: the anchor suite (../shared/anchors), aligned and unaligned hidden sizes, bf16. Each shape is first checked
against an fp64 reference, then timed two ways, side by side in one run:
- ``graph``: CUDA-graph replay (device time only: what the kernel costs);
- ``eager``: one call per event pair through the public API (includes host overhead when it exceeds device time).
Bandwidth is bytes read + written (x, weight, y) over time, against the copy bandwidth measured in the same run.

    python -m benchmarks.bench_rms_norm    # about 2 minutes on an H200 (writes rms_norm.*)
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import fly_lightning
from benchmarks.harness import Results, copy_bandwidth_gbps, geomean, rotation_count, time_graph_ms, time_ms
from fly_lightning.kernels.triton.rms_norm import launch_config, rms_norm_triton
from fly_lightning.ops.rms_norm import rms_norm_reference

SHAPES = [(4096, 4096), (16384, 4096), (16384, 8192), (32768, 2048), (16384, 5120), (16384, 4097), (65536, 1536)]
EPS = 1e-6


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(x.dtype)


def contenders() -> dict[str, object]:
    out = {
        "fly": lambda x, w: fly_lightning.rms_norm(x, w, EPS),
        "fly_kernel": lambda x, w: rms_norm_triton(x, w, EPS, 0.0, False)[0],
        "aten": lambda x, w: F.rms_norm(x, (x.shape[-1],), w, EPS),
        "inductor": torch.compile(_reference),
    }
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        out["liger"] = lambda x, w: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", False)
    except Exception as exc:  # reported, not fatal
        print(f"liger unavailable: {exc}")
    return out


def check(fn, x: torch.Tensor, w: torch.Tensor) -> float:
    ref = rms_norm_reference(x.double(), w.double(), EPS)[0]
    y = fn(x, w)
    return ((y.double() - ref).norm() / ref.norm()).item()


def suite(res: Results, bw: float) -> None:
    fns = contenders()
    for t, h in SHAPES:
        nbytes = 2 * t * h * 2 + h * 2
        sets = [
            (
                torch.randn(t, h, device="cuda", dtype=torch.bfloat16),
                torch.randn(h, device="cuda", dtype=torch.bfloat16),
            )
            for _ in range(rotation_count(nbytes))
        ]
        row: dict[str, object] = {
            "T": t,
            "H": h,
            "MB": round(nbytes / 2**20, 1),
            "config": str(launch_config(h, 2, True)),
        }
        for name, fn in fns.items():
            err = check(fn, *sets[0])
            row[f"{name}_relerr"] = err
            if not err < 1e-2:
                row[f"{name}_status"] = "WRONG"
                continue
            g = time_graph_ms(fn, sets)["median_ms"]
            e = time_ms(fn, sets)["median_ms"]
            row[f"{name}_graph_us"] = g * 1e3
            row[f"{name}_eager_us"] = e * 1e3
            row[f"{name}_graph_pct_bw"] = 100 * nbytes / g / 1e6 / bw
        peers = [p for p in ("aten", "inductor", "liger") if f"{p}_graph_us" in row]
        if "fly_graph_us" in row and peers:
            best = min(row[f"{p}_graph_us"] for p in peers)
            row["speedup_vs_best_peer_graph"] = best / row["fly_graph_us"]
            for p in peers:
                row[f"speedup_vs_{p}_graph"] = row[f"{p}_graph_us"] / row["fly_graph_us"]
                row[f"speedup_vs_{p}_eager"] = row[f"{p}_eager_us"] / row["fly_eager_us"]
        res.add(**row)
        del sets
        torch.cuda.empty_cache()
    rows = res.rows
    res.summary = {
        "copy_GBps": bw,
        "min_fly_pct_bw_graph": min(r.get("fly_graph_pct_bw", 0) for r in rows),
        "goal_pct_bw": 90.0,
        "geomean_speedup_vs_best_peer_graph": geomean([r.get("speedup_vs_best_peer_graph", 0) for r in rows]),
        "geomean_speedup_vs_aten_graph": geomean([r.get("speedup_vs_aten_graph", 0) for r in rows]),
        "geomean_speedup_vs_aten_eager": geomean([r.get("speedup_vs_aten_eager", 0) for r in rows]),
        "shapes_ahead_of_every_peer_graph": sum(r.get("speedup_vs_best_peer_graph", 0) > 1 for r in rows),
        "shapes": len(rows),
    }


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    torch.manual_seed(0)
    bw = copy_bandwidth_gbps()
    res = Results("rms_norm")
    suite(res, bw)
    res.notes += [
        "bf16 x [T, H], bf16 weight, eps 1e-6; inputs rotated through > 3x L2; medians",
        "graph = CUDA-graph replay (device time); eager = events around each public call (host overhead included)",
        "fly = public fly_lightning.rms_norm (dispatch + custom op); fly_kernel = Triton launcher called directly",
    ]
    print(res.markdown())
    print(f"wrote {res.save()}")


if __name__ == "__main__":
    main()
