"""Side-by-side timings of routing-kernel launch variants on the suite's cases, to decide ``launch_config``'s choices.

Variants (each a ``LaunchConfig`` change from the launcher's own choice, timed only where it changes the kernel):

- ``default``: ``launch_config`` as it stands (checked against the reference, as the suite checks);
- ``exact_sigmoid``: ``fast_sigmoid=False`` (sigmoid routers that rank scores, not logits);
- ``no_prefetch``: ``prefetch=False`` where the launcher prefetches.

Options it timed and that are gone, slower where they applied: at 23207fe a deferred epilogue (each tile finished one
loop step later, ``moe_route_variants_23207fe.md``), at 9547a40 the selection or exact-pass steps as loops instead of
unrolled (``moe_route_variants_roll_9547a40.md``), at 0bc91f4 tiles drawn from a counter instead of a fixed range
per program (``moe_route_variants_dynamic_0bc91f4.md``).

Every variant's outputs must equal the default's (``same_as_default``). Rounds alternate the variants; the table
gives each variant's median over rounds of CUDA-graph times.

    python -m benchmarks.probe_route_variants [--rounds 3] [--cases a,b] [--variants a,b] [--spread] [--no-check]
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace

import torch

from benchmarks.bench_moe_route import CASES, _args, _bind, _inputs, check
from benchmarks.harness import Results, geomean, time_graph_ms
from benchmarks.probe_route_spread import SPREAD


def variants(case, cfg, names: list[str] | None) -> dict:
    """The variants that change this case's kernel (``names``: only those, and the default)."""
    out = {"default": cfg}
    if case.score == "sigmoid" and (case.bias or case.n_groups is not None):
        out["exact_sigmoid"] = replace(cfg, fast_sigmoid=False)
    if cfg.prefetch:
        out["no_prefetch"] = replace(cfg, prefetch=False)
    return {k: v for k, v in out.items() if names is None or k == "default" or k in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", default=None, help="comma-separated suite case names (default: all)")
    parser.add_argument("--variants", default=None, help="comma-separated variant names (default: all)")
    parser.add_argument("--spread", action="store_true", help="also time probe_route_spread's spread inputs")
    parser.add_argument("--no-check", action="store_true", help="skip the default's check against the reference")
    opts = parser.parse_args()
    from fly_lightning.kernels.triton._moe_route_config import launch_config
    from fly_lightning.kernels.triton.moe_route import moe_route_triton

    dev = torch.device("cuda")
    res = Results("moe_route_variants")
    chosen = [c for c in CASES if opts.cases is None or c.name in opts.cases.split(",")]
    gains: dict[str, list[float]] = {}
    for case in chosen:
        inputs, bias = _inputs(case, dev)
        args = _args(case, bias)
        err = check(case, inputs[0][0], bias)[0] if not opts.no_check else "not checked"
        cfg = launch_config(case.experts, case.k, torch.finfo(case.dtype).bits // 8, case.n_groups is not None,
                            case.bias)  # fmt: skip
        configs = variants(case, cfg, opts.variants.split(",") if opts.variants else None)
        sets = {"suite": inputs}
        if opts.spread:
            g = torch.Generator(device=dev).manual_seed(1)
            draw = lambda: torch.randn(case.tokens, case.experts, device=dev, generator=g)  # noqa: B023
            sets["spread"] = [(SPREAD[case.score](draw()).to(case.dtype),) for _ in range(len(inputs))]
        for input_name, xs in sets.items():
            want = moe_route_triton(xs[0][0], *args, False, config=cfg)
            same = {}
            for name, c in configs.items():
                got = moe_route_triton(xs[0][0], *args, False, config=c)
                same[name] = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
            times: dict[str, list[float]] = {name: [] for name in configs}
            for _ in range(opts.rounds):
                for name, c in configs.items():
                    fn = _bind(moe_route_triton, *args, False, config=c)
                    times[name].append(time_graph_ms(fn, xs, calls_per_graph=20, replays=20)["median_ms"] * 1e3)
            base = statistics.median(times["default"])
            for name in configs:
                us = statistics.median(times[name])
                if name != "default":
                    gains.setdefault(f"{name}_{input_name}", []).append(base / us)
                res.add(case=case.name, input=input_name, variant=name,
                        check=(err or "ok") if name == "default" and input_name == "suite" else "",
                        same_as_default=same[name], us=round(us, 2), rounds_us=[round(t, 2) for t in times[name]],
                        default_over_variant=round(base / us, 3))  # fmt: skip
    for name, g in gains.items():
        res.summary[f"geomean_default_over_{name}"] = round(geomean(g), 3)
    res.notes.append(f"{opts.rounds} rounds alternating the variants; graph replay, 20 calls per graph")
    res.save()


if __name__ == "__main__":
    main()
