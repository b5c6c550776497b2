"""Side-by-side timings of routing-kernel launch variants on the suite's cases, to decide ``launch_config``'s choices.

Variants (each a ``LaunchConfig`` change from the launcher's own choice, timed only where it changes the kernel):

- ``default``: ``launch_config`` as it stands (checked against the reference, as the suite checks);
- ``exact_sigmoid``: ``fast_sigmoid=False`` (sigmoid routers that rank scores, not logits);
- ``no_prefetch``: ``prefetch=False`` where the launcher prefetches.

(At 23207fe it also timed a deferred epilogue, each tile finished one loop step later, with and without the
prefetch: slower on every case, ``moe_route_variants_23207fe.md``; the option is gone.)

Every variant's outputs must equal the default's (``same_as_default``). Rounds alternate the variants; the table
gives each variant's median over rounds of CUDA-graph times.

    python -m benchmarks.probe_route_variants [--rounds 3] [--cases a,b]
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace

import torch

from benchmarks.bench_moe_route import CASES, _args, _bind, _inputs, check
from benchmarks.harness import Results, geomean, time_graph_ms


def variants(case, cfg) -> dict:
    out = {"default": cfg}
    if case.score == "sigmoid" and (case.bias or case.n_groups is not None):
        out["exact_sigmoid"] = replace(cfg, fast_sigmoid=False)
    if cfg.prefetch:
        out["no_prefetch"] = replace(cfg, prefetch=False)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", default=None, help="comma-separated suite case names (default: all)")
    opts = parser.parse_args()
    from fly_lightning.kernels.triton.moe_route import launch_config, moe_route_triton

    dev = torch.device("cuda")
    res = Results("moe_route_variants")
    chosen = [c for c in CASES if opts.cases is None or c.name in opts.cases.split(",")]
    gains: dict[str, list[float]] = {}
    for case in chosen:
        inputs, bias = _inputs(case, dev)
        args = _args(case, bias)
        err, _ = check(case, inputs[0][0], bias)
        cfg = launch_config(case.experts, case.k, torch.finfo(case.dtype).bits // 8, case.n_groups is not None,
                            case.bias)  # fmt: skip
        configs = variants(case, cfg)
        want = moe_route_triton(inputs[0][0], *args, False, config=cfg)
        same = {}
        for name, c in configs.items():
            got = moe_route_triton(inputs[0][0], *args, False, config=c)
            same[name] = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        times: dict[str, list[float]] = {name: [] for name in configs}
        for _ in range(opts.rounds):
            for name, c in configs.items():
                fn = _bind(moe_route_triton, *args, False, config=c)
                times[name].append(time_graph_ms(fn, inputs, calls_per_graph=20, replays=20)["median_ms"] * 1e3)
        base = statistics.median(times["default"])
        for name in configs:
            us = statistics.median(times[name])
            if name != "default":
                gains.setdefault(name, []).append(base / us)
            res.add(case=case.name, variant=name, check=(err or "ok") if name == "default" else "",
                    same_as_default=same[name], us=round(us, 2), rounds_us=[round(t, 2) for t in times[name]],
                    default_over_variant=round(base / us, 3))  # fmt: skip
    for name, g in gains.items():
        res.summary[f"geomean_default_over_{name}"] = round(geomean(g), 3)
    res.notes.append(f"{opts.rounds} rounds alternating the variants; graph replay, 20 calls per graph")
    res.save()


if __name__ == "__main__":
    main()
