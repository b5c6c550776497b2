"""Does the routing kernel's speed depend on the data? The fp32-key paths (fp32 logits, or biased / grouped scores) rank
relative keys that are exact only within a fixed distance of each row's best (``_select.py``), and a tile whose chosen
keys reach past it is ranked again with exact keys. The suite's inputs (``2 * randn`` logits) never need that; router
logits whose chosen scores span several binades, or cross zero, do.

For each suite case on those paths, two inputs side by side in one run:

- ``suite``: the suite's inputs (``bench_moe_route._inputs``);
- ``spread``: the same shapes with spread scores: sigmoid routers get ``2 * randn - 4`` logits (small scores several
  binades apart), softmax routers ``randn - 1`` (the chosen logits cross zero).

Per input: the share of rows and tiles whose chosen keys need the exact pass (computed from the reference's choice),
the check against the reference (as the suite checks), and CUDA-graph times of ours and of the ATen sequence.

    python -m benchmarks.probe_route_spread
"""

from __future__ import annotations

import torch

from benchmarks.bench_moe_route import CASES, _args, _bind, _inputs, aten_route, check
from benchmarks.harness import Results, geomean, rotation_count, time_graph_ms

SPREAD = {"sigmoid": lambda x: 2 * x - 4, "softmax": lambda x: x - 1}


def float_key(v: torch.Tensor) -> torch.Tensor:
    """The kernel's ``float_key`` on the host (int64)."""
    s = v.float().view(torch.int32).long()
    mag = s & 0x7FFFFFFF
    return torch.where(s <= -0x800000, -mag, mag)


def exact_pass_share(case, x: torch.Tensor, bias, rows_per_tile: int, cb: int) -> tuple[float, float]:
    """(rows, tiles) whose k-th chosen key lies more than the relative keys' limit below the row's best."""
    w, ids, *_ = aten_route(x, *_args(case, bias))
    s = torch.softmax(x.float(), -1) if case.score == "softmax" else torch.sigmoid(x.float())
    sel = x.float() if bias is None and case.n_groups is None else (s if bias is None else s + bias)
    key = float_key(sel.gather(1, ids.long()))
    far = (key.max(1).values - key.min(1).values) > (2**31 // cb - 1)
    n = far.numel() // rows_per_tile * rows_per_tile
    return far.float().mean().item(), far[:n].view(-1, rows_per_tile).any(1).float().mean().item()


def main() -> None:
    from fly_lightning import moe_route
    from fly_lightning.kernels.triton import moe_route as kernel

    dev = torch.device("cuda")
    res = Results("moe_route_spread")
    ratios = []
    for case in CASES:
        itemsize = torch.finfo(case.dtype).bits // 8
        if case.dtype != torch.float32 and not case.bias and case.n_groups is None:
            continue  # 16-bit logits ranked directly: exact packed keys, no second pass
        shape = (case.tokens, case.experts, case.k, case.dtype, case.experts, case.score, case.renormalize)
        plan = kernel._plan(*shape, case.bias, case.n_groups, case.topk_groups, False, dev, None, False)
        inputs, bias = _inputs(case, dev)
        times = {}
        for name in ("suite", "spread"):
            if name == "spread":
                g = torch.Generator(device=dev).manual_seed(1)
                sets = rotation_count(case.tokens * case.experts * itemsize)
                draw = lambda: torch.randn(case.tokens, case.experts, device=dev, generator=g)  # noqa: B023
                inputs = [(SPREAD[case.score](draw()).to(case.dtype),) for _ in range(sets)]
            rows, tiles = exact_pass_share(case, inputs[0][0], bias, plan.rows, plan.constexprs["CB"])
            err, info = check(case, inputs[0][0], bias)
            args = _args(case, bias)
            ours = time_graph_ms(_bind(moe_route, *args), inputs, calls_per_graph=20, replays=20)["median_ms"]
            aten = time_graph_ms(_bind(aten_route, *args), inputs, calls_per_graph=20, replays=20)
            times[name] = ours
            res.add(case=case.name, input=name, T=case.tokens, E=case.experts, k=case.k, dtype=str(case.dtype)[6:],
                    rows_exact_pass=round(rows, 4), tiles_exact_pass=round(tiles, 3), check=err or "ok",
                    rows_differ=info.get("rows_differ"), ours_us=ours * 1e3, aten_us=aten["median_ms"] * 1e3,
                    speedup_vs_aten=aten["median_ms"] / ours)  # fmt: skip
        ratios.append(times["spread"] / times["suite"])
        res.rows[-1]["spread_over_suite"] = ratios[-1]
    res.summary["geomean_spread_over_suite"] = geomean(ratios)
    res.notes.append("graph replay, 20 calls per graph, deterministic algorithms off; tiles of the launcher's ROWS")
    res.save()


if __name__ == "__main__":
    main()
