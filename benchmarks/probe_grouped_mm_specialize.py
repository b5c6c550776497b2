"""A/B of the grouped GEMM kernel with N, K and the strides compiled in as constants (``specialize``) against the
same configuration with them as runtime arguments, on the suite's 24 cases (GPU).

Why: on three gate/up shapes (K 2048, N 1536/2048) Inductor's template beat the table configuration by 6-12% with the
same tiles, stages and warps (``grouped_mm_suite_0e24452.md`` and its log); the template compiles static shapes.

Per case: the table's configuration and its ``specialize`` twin, each checked against the table's output, then timed
side by side the suite's way (device events, rotating input sets) in ``ROUNDS`` alternating rounds; the median of
each side's round medians is reported, with ``spec_x`` = plain time / specialised time (> 1: constants faster). Also
the MoE layer's forms on the gate/up (gathered rows) and down (scattered output) cases. Compilation excluded. (The
table now specialises; ``config`` names its tiles, both sides differ only in the flag.)

    python -m benchmarks.probe_grouped_mm_specialize
"""

from __future__ import annotations

import statistics
from dataclasses import replace

import torch

from benchmarks.grouped_mm_cases import cases, make_inputs
from benchmarks.harness import Results, geomean, rotation_count, time_ms
from fly_lightning.kernels.triton import _grouped_mm_kernel as gk
from fly_lightning.kernels.triton._grouped_mm_config import table_config

ROUNDS = 3
TOPK = 8


def _forms(case, device: torch.device) -> list[tuple[str, dict]]:
    """(form name, launch keyword arguments) for this case: plain; gathered/scattered on projections."""
    forms = [("plain", {})]
    if case.family == "projection":
        # MoE layer forms: rows gathered from T = M / TOPK tokens (gate/up) or scattered to slots (down)
        idx = torch.randperm(case.m, device=device, dtype=torch.int64).to(torch.int32)
        mode = "gather" if "gate_up" in case.name else "scatter"
        forms.append((mode, dict(idx=idx, topk=TOPK, **{mode: True})))
    return forms


def main() -> None:
    res = Results("grouped_mm_specialize")
    ratios: dict[str, list[float]] = {}
    for case in cases():
        x, w, offs = make_inputs(case, "cuda")
        nbytes = (x.numel() + w.numel() + case.m * case.n) * x.element_size()
        sets = [(x, w, offs)] + [make_inputs(case, "cuda", seed=s) for s in range(1, rotation_count(nbytes, 1))]
        base = replace(table_config(x, w, case.m), specialize=False)
        spec = replace(base, specialize=True)
        for form, kw in _forms(case, x.device):
            out = torch.empty(case.m, case.n, dtype=x.dtype, device=x.device)
            row = dict(case=case.name, family=case.family, form=form, config=base.label())
            try:
                ref = gk.launch(x, w, offs, torch.zeros_like(out), **kw, config=base).float()
                got = gk.launch(x, w, offs, torch.zeros_like(out), **kw, config=spec).float()
                row["max_abs_diff"] = (got - ref).abs().max().item()
                if row["max_abs_diff"] > 1e-2 * ref.abs().max().item():
                    raise RuntimeError(f"specialised output differs: {row['max_abs_diff']:.3g}")
                fns = {
                    name: (lambda a, b, o, c=cfg, y=out, kw=kw: gk.launch(a, b, o, y, **kw, config=c))
                    for name, cfg in (("plain", base), ("spec", spec))
                }
                medians = {name: [] for name in fns}
                for r in range(ROUNDS):
                    for name in ("plain", "spec") if r % 2 == 0 else ("spec", "plain"):
                        medians[name].append(time_ms(fns[name], sets, warmup=3, reps=20)["median_ms"])
                for name, vals in medians.items():
                    row[f"{name}_ms"] = round(statistics.median(vals), 4)
                    row[f"{name}_tflops"] = round(case.flops / row[f"{name}_ms"] / 1e9, 1)
                row["spec_x"] = round(row["plain_ms"] / row["spec_ms"], 4)
                ratios.setdefault(form, []).append(row["spec_x"])
            except Exception as exc:  # reported, not fatal
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            res.add(**row)
            print(row, flush=True)
        del x, w, offs, sets
        torch.cuda.empty_cache()
    for form, vals in ratios.items():
        res.summary[f"geomean_spec_x_{form}"] = round(geomean(vals), 4)
        res.summary[f"wins_{form}"] = f"{sum(v > 1 for v in vals)}/{len(vals)}"
        res.summary[f"range_{form}"] = (min(vals), max(vals))
    res.notes.append(
        f"spec_x = plain / specialised time; each side timed in {ROUNDS} alternating rounds of 20 calls over rotating "
        "input sets, the median of the round medians; config = the table's, the same for both sides"
    )
    print(res.save())


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    main()
