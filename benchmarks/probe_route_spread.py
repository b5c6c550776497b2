"""Does the routing kernel's speed depend on the data? The fp32-key paths (fp32 logits, or biased / grouped scores) rank
relative keys (``_select.py``): each value's distance below its row's best, exact up to a limit. Up to 2c62ad9 the
distance was clamped there, and a tile whose chosen keys reached past it was ranked again with exact keys; now it is
compressed past the limit, and only a tile where two of the chosen keys (or the last chosen and the next) share a
compressed step takes that exact pass. The suite's inputs (``2 * randn`` logits) need neither; router logits whose
chosen scores span several binades, or cross zero, reach past the limit.

For each suite case on those paths, two inputs side by side in one run:

- ``suite``: the suite's inputs (``bench_moe_route._inputs``);
- ``spread``: the same shapes with spread scores: sigmoid routers get ``2 * randn - 4`` logits (small scores several
  binades apart), softmax routers ``randn - 1`` (the chosen logits cross zero).

Per input: the share of tiles that take the exact pass under each rule, computed on the host from the values
(``tiles_past_clamp``: the clamp's rule; ``tiles_shared_step``: the compressed keys' rule, the kernel's now), the
check against the reference (as the suite checks), and CUDA-graph times of ours and of the ATen sequence.

    python -m benchmarks.probe_route_spread             # about 2 minutes on an H200
    python -m benchmarks.probe_route_spread --no-check  # timings only (variant A/B runs)
    python -m benchmarks.probe_route_spread --topk-host # CPU only: the same shares for the top-k suite's fp32 cases
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.bench_moe_route import CASES, TOPK_CASES, _args, _bind, _inputs, aten_route, check
from benchmarks.harness import Results, geomean, rotation_count, time_graph_ms
from fly_lightning.kernels.triton._select import float_key_host, relative_distance

SPREAD = {"sigmoid": lambda x: 2 * x - 4, "softmax": lambda x: x - 1}


def exact_pass_tiles(sel: torch.Tensor, k: int, rows_per_tile: int, cb: int) -> tuple[float, float]:
    """Shares of tiles whose ranked values ``sel`` [T, E] take the exact pass: (under the clamp, under the
    compressed keys' shared steps)."""
    key = float_key_host(sel)
    # the clamp's rule: the k-th chosen more than LIMIT ulps below the row's best
    clamp = (key.max(1, keepdim=True).values - key).topk(k, 1, largest=False).values[:, -1] > 2**31 // cb - 1
    # the k + 1 smallest distances (the chosen and the next), as the kernel compresses them
    d = relative_distance(sel, cb).topk(k + 1, 1, largest=False).values
    shared = ((d[:, 1:] == d[:, :-1]) & (d[:, 1:] >= 2**30 // cb)).any(1)
    n = sel.shape[0] // rows_per_tile * rows_per_tile
    return tuple(f[:n].view(-1, rows_per_tile).any(1).float().mean().item() for f in (clamp, shared))


def ranked_values(case, x: torch.Tensor, bias) -> torch.Tensor:
    """The fp32 values the kernel ranks: the logits, or the scores plus bias with node-limited groups applied."""
    s = torch.softmax(x.float(), -1) if case.score == "softmax" else torch.sigmoid(x.float())
    sel = x.float() if bias is None and case.n_groups is None else (s if bias is None else s + bias)
    if case.n_groups is not None:  # the other groups' experts are out of the ranking
        t, e = sel.shape
        best = sel.view(t, case.n_groups, -1).topk(2, dim=-1).values.sum(-1).topk(case.topk_groups, dim=-1).indices
        keep = torch.zeros(t, case.n_groups, dtype=torch.bool, device=x.device).scatter_(1, best, True)
        sel = sel.masked_fill(~keep.repeat_interleave(e // case.n_groups, dim=1), float("-inf"))
    return sel


def topk_host_shares() -> None:
    """Shares of the top-k suite's fp32 tiles (``bench_moe_route.TOPK_CASES``, ``randn`` inputs as timed there) that
    take the exact pass under each rule, on the CPU."""
    from fly_lightning.kernels.triton import topk as kernel

    res = Results("topk_exact_pass_host")
    g = torch.Generator().manual_seed(0)
    for t, n, k, dtype in TOPK_CASES:
        if dtype != torch.float32:
            continue  # 16-bit values are ranked directly: exact packed keys
        _, const = kernel._plan(n, k, dtype, n, t, None)
        tiles = exact_pass_tiles(torch.randn(t, n, generator=g), k, const["ROWS"], const["CB"])
        res.add(T=t, N=n, k=k, rows_per_tile=const["ROWS"], tiles_past_clamp=round(tiles[0], 3),
                tiles_shared_step=round(tiles[1], 3))  # fmt: skip
    res.save()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-check", action="store_true", help="skip the check against the reference")
    parser.add_argument("--topk-host", action="store_true", help="only the top-k suite's exact-pass shares (CPU)")
    opts = parser.parse_args()
    if opts.topk_host:
        return topk_host_shares()
    run_checks = not opts.no_check
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
            sel = ranked_values(case, inputs[0][0], bias)
            clamp, shared = exact_pass_tiles(sel, case.k, plan.rows, plan.constexprs["CB"])
            err, info = check(case, inputs[0][0], bias) if run_checks else ("not checked", {})
            args = _args(case, bias)
            ours = time_graph_ms(_bind(moe_route, *args), inputs, calls_per_graph=20, replays=20)["median_ms"]
            aten = time_graph_ms(_bind(aten_route, *args), inputs, calls_per_graph=20, replays=20)
            times[name] = ours
            res.add(case=case.name, input=name, T=case.tokens, E=case.experts, k=case.k, dtype=str(case.dtype)[6:],
                    tiles_past_clamp=round(clamp, 3), tiles_shared_step=round(shared, 3), check=err or "ok",
                    rows_differ=info.get("rows_differ"), ours_us=ours * 1e3, aten_us=aten["median_ms"] * 1e3,
                    speedup_vs_aten=aten["median_ms"] / ours)  # fmt: skip
        ratios.append(times["spread"] / times["suite"])
        res.rows[-1]["spread_over_suite"] = ratios[-1]
    res.summary["geomean_spread_over_suite"] = geomean(ratios)
    res.notes.append("graph replay, 20 calls per graph, deterministic algorithms off; tiles of the launcher's ROWS")
    res.save()


if __name__ == "__main__":
    main()
