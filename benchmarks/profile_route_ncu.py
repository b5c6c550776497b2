"""Where does the routing kernel's time go? One launch per case, captured by Nsight Compute (``ncu``), which this
script does not call itself: ``gpu_session.sh``'s ``route_ncu`` phase runs it under ``ncu --profile-from-start off``,
and only the launch between ``cudaProfilerStart`` and ``cudaProfilerStop`` is profiled (after two warm-up calls, so
compilation and autotuning stay out).

    ncu --clock-control none --profile-from-start off -k regex:_moe_route_fwd --set full --import-source yes \
        -o route_ncu python -m benchmarks.profile_route_ncu [--cases a,b] [--spread]

The launches come in the order printed (``profiled: <case> <input>``), which is the order of the report's kernels.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.bench_moe_route import CASES, _args, _inputs
from benchmarks.probe_route_spread import SPREAD

DEFAULT = "qwen3-moe-64k,deepseek-v3-64k,deepseek-v3-fp32,glm-4.5,deepseek-v2-lite-fp32,olmoe"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=DEFAULT, help="comma-separated suite case names")
    parser.add_argument("--spread", action="store_true", help="also the spread inputs of the fp32-key cases")
    opts = parser.parse_args()
    from fly_lightning import moe_route

    dev = torch.device("cuda")
    by_name = {c.name: c for c in CASES}
    for name in opts.cases.split(","):
        case = by_name[name]
        inputs, bias = _inputs(case, dev)
        runs = [("suite", inputs[0][0])]
        fp32_keys = case.dtype == torch.float32 or case.bias or case.n_groups is not None
        if opts.spread and fp32_keys:
            g = torch.Generator(device=dev).manual_seed(1)
            x = torch.randn(case.tokens, case.experts, device=dev, generator=g)
            runs.append(("spread", SPREAD[case.score](x).to(case.dtype)))
        for label, x in runs:
            args = _args(case, bias)
            for _ in range(2):
                moe_route(x, *args)
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            moe_route(x, *args)
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            print(f"profiled: {name} {label}", flush=True)


if __name__ == "__main__":
    main()
