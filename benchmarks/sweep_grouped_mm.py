"""Launch-configuration sweep of the Triton grouped GEMM (GPU), run by ``bench_grouped_mm --sweep``.

Times every configuration of ``candidate_configs()`` (tile shapes x stages x warps; persistent with 1 or 2 programs
per SM or one program per tile; TMA loads or plain pointers; TMA store; band width; warp specialisation) on nine
cases covering the shape classes of ``CONFIG_TABLE`` (rows per expert x N x K), checks each result against
``torch._grouped_mm``, and reports per case and per shape class the fastest configuration next to the table's,
with a ``CONFIG_TABLE`` entry to paste for each class. All cases use the K-major weight layout of model checkpoints
(one compilation per configuration). About 3 minutes on an H200, mostly compilation.
"""

from __future__ import annotations

from dataclasses import asdict, replace

import torch

from benchmarks.bench_grouped_mm import elapsed_ms
from benchmarks.grouped_mm_cases import Case, cases, make_inputs
from benchmarks.harness import Results, geomean
from fly_lightning.kernels.triton import _grouped_mm_kernel as gk
from fly_lightning.kernels.triton._grouped_mm_config import (
    CONFIG_TABLE,
    GroupedMMConfig,
    candidate_configs,
    shape_class,
)

SWEEP_CASES = (
    "mixtral-8x7b-gate_up",
    "mixtral-8x7b-down-hot75%",
    "qwen3-30b-a3b-gate_up",
    "qwen3-30b-a3b-down",
    "olmoe-1b-7b-down-one-takes-all",
    "deepseek-v3-ep8-gate_up-zipf1.2+25%empty",
    "uniform-E64-m256-K2048-N2048",
    "uniform-E128-m128-K2048-N1536",
    "uniform-E128-m64-K4096-N1024",
)


def run_sweep(device: str = "cuda", case_list: list[Case] | None = None,
              configs: list[GroupedMMConfig] | None = None, reps: int = 10) -> Results:  # fmt: skip
    res = Results("grouped_mm_sweep")
    chosen = [replace(c, k_major=True) for c in (case_list or cases()) if case_list or c.name in SWEEP_CASES]
    inputs = {c.name: make_inputs(c, device) for c in chosen}
    expected = {name: torch._grouped_mm(x, w, offs=o) for name, (x, w, o) in inputs.items()}
    outs = {name: torch.empty_like(y) for name, y in expected.items()}
    configs = configs or candidate_configs()
    table = {c.name: CONFIG_TABLE[shape_class(c.m, c.n, c.k, c.e)] for c in chosen}
    for cfg in dict.fromkeys([*table.values(), *configs]):  # the table's own first
        for case in chosen:
            x, w, offs = inputs[case.name]
            row = dict(case=case.name, cls="/".join(shape_class(case.m, case.n, case.k, case.e)), config=cfg.label())
            try:
                run = lambda: gk.launch(x, w, offs, outs[case.name], config=cfg)  # noqa: B023, E731
                run()
                err = ((outs[case.name].float() - expected[case.name].float()).norm() /
                       expected[case.name].float().norm()).item()  # fmt: skip
                row["err"] = err
                if err > 2e-2:
                    row["error"] = "wrong result"
                else:
                    run()
                    ms = elapsed_ms(run, reps)
                    row["ms"], row["tflops"] = round(ms, 4), round(case.flops / ms / 1e9, 1)
            except Exception as exc:  # a configuration that does not compile or fit is reported and skipped
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            res.add(**row)
    _summarise(res, chosen, table, configs)
    return res


def _summarise(res: Results, chosen, table, configs) -> None:
    ok = [r for r in res.rows if "ms" in r]
    by_case = {}
    for case in chosen:
        rows = [r for r in ok if r["case"] == case.name]
        if not rows:
            continue
        best = min(rows, key=lambda r: r["ms"])
        mine = next((r for r in rows if r["config"] == table[case.name].label()), None)
        by_case[case.name] = dict(best=best["config"], best_ms=best["ms"], best_tflops=best["tflops"],
                                  table=table[case.name].label(), table_ms=mine and mine["ms"],
                                  table_over_best=mine and round(mine["ms"] / best["ms"], 3))  # fmt: skip
    res.summary["per_case"] = by_case
    labels = {c.label(): c for c in [*table.values(), *configs]}
    per_class = {}
    for cls in sorted({r["cls"] for r in ok}):
        names = sorted({r["case"] for r in ok if r["cls"] == cls})
        scores = {}
        for label in labels:
            times = {r["case"]: r["ms"] for r in ok if r["cls"] == cls and r["config"] == label}
            if len(times) == len(names):  # ran on every case of the class
                fastest = {n: min(r["ms"] for r in ok if r["case"] == n) for n in names}
                scores[label] = geomean([fastest[n] / times[n] for n in names])  # 1.0 = fastest on every case
        if scores:
            best = max(scores, key=scores.get)
            key = tuple(cls.split("/"))
            per_class[cls] = dict(best=best, score=round(scores[best], 3), cases=names,
                                  table=CONFIG_TABLE[key].label(), table_score=round(scores.get(
                                      CONFIG_TABLE[key].label(), float("nan")), 3),
                                  paste=f"{key}: C(**{asdict(labels[best])}),")  # fmt: skip
    res.summary["per_class"] = per_class
    res.summary["failed_configs"] = sorted({r["config"] for r in res.rows if "error" in r})
    res.notes.append("score = geomean over the class's cases of (fastest time / this configuration's time).")
