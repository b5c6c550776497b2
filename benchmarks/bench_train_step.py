"""Whole training step against what users already run: stock transformers, ``torch.compile``, Liger-Kernel (GPU).

One training step (forward with labels, backward, fused AdamW step, zero grad) of a transformers MoE model built from
its config at real layer dimensions (few layers, vocab 32000, random tokens), per variant and precision:

- ``stock``: eager transformers; ``compile``: ``torch.compile(model)``; ``liger``: ``apply_liger_kernel_to_<arch>``
  (where Liger has an entry for the architecture);
- ``fly``: ``fly_lightning.transform(model)``; ``fly_compile``: transform, then ``torch.compile``; ``liger_fly``: Liger,
  then the transform (composition); ``fly_compile_opaque``: ``fly_compile`` with every op opaque to Inductor (policy
  ``inductor_ops`` empty): the alternative that ``fly_compile``'s default policy is measured against.

Precisions: ``bf16-true`` (bf16 weights, no autocast) and ``bf16-mixed`` (fp32 weights, bf16 autocast; there stock
transformers runs its expert GEMMs in fp32, see the README). Each variant runs in its own process (Liger patches
classes), the variants in rotated order per round, ``stock`` twice per round as the noise floor. Reported per variant:
median step time over the steady-state steps, first-step (cold: compilation, autotuning) time apart, peak memory,
and the largest loss difference against ``stock`` over the same steps (same seed, data and initial weights).

    python -m benchmarks.bench_train_step --models qwen3_moe --precisions bf16-true --rounds 2
    python -m benchmarks.bench_train_step --worker qwen3_moe fly bf16-true   # one process (used by the driver)
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from benchmarks.harness import Results, results_dir
from benchmarks.train_step_cases import (
    BASELINES,
    MODELS,
    PRECISIONS,
    REST_VARIANTS,
    STEPS,
    VARIANTS,
    WARMUP,
    liger_entry,
    run_worker,
    worker,
)


def rotated(variants: list[str], rounds: int) -> list[list[str]]:
    """Each round's order: ``stock`` twice (its two runs give the noise floor), the rest rotated by one per round."""
    names = ["stock", "stock", *variants]
    return [names[r % len(names) :] + names[: r % len(names)] for r in range(rounds)]


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per variant: median over runs of the steady-state median, first step, peak memory, loss difference to stock."""
    by: dict[str, list[dict]] = {}
    for r in runs:
        by.setdefault(r["variant"], []).append(r)
    ok = {v: [r for r in rs if "error" not in r] for v, rs in by.items()}
    stock = ok.get("stock", [])
    row: dict[str, Any] = {}
    for v, rs in by.items():
        good = ok[v]
        if not good:
            row[v] = {"error": rs[0]["error"]}
            continue
        entry = {
            "step_ms": statistics.median(r["step_ms"] for r in good),
            "runs_ms": [round(r["step_ms"], 2) for r in good],
            "first_step_s": max(r["first_step_s"] for r in good),
            "peak_gib": max((r["peak_gib"] or 0.0) for r in good),
        }
        if stock:
            ref = stock[0]["losses"]
            entry["max_loss_diff"] = max(abs(a - b) for a, b in zip(good[-1]["losses"], ref, strict=True))
        for key in ("swapped", "left", "dispatch", "profile_top"):
            if key in good[-1]:
                entry[key] = good[-1][key]
        row[v] = entry
    if len(stock) >= 2:
        a, b = stock[0]["step_ms"], stock[1]["step_ms"]
        row["noise"] = {"stock_vs_stock": abs(a - b) / min(a, b)}
        row["noise"]["stock_loss_diff"] = max(
            abs(x - y) for x, y in zip(stock[0]["losses"], stock[1]["losses"], strict=True)
        )
    timed = {v: e["step_ms"] for v, e in row.items() if v in VARIANTS and "step_ms" in e}
    base = {v: t for v, t in timed.items() if v in BASELINES}
    ours = {v: t for v, t in timed.items() if "fly" in v}
    if base and ours:
        best_base, best_ours = min(base, key=base.get), min(ours, key=ours.get)
        row["headline"] = {
            "best_baseline": best_base,
            "best_with_fly": best_ours,
            "speedup": base[best_base] / ours[best_ours],
            # a baseline that ran and failed: the speedup is then against a slower one, and says so
            "failed_baselines": [v for v in BASELINES if v in row and v not in base],
        }
        for fly_v, alone in (("fly_compile", "compile"), ("liger_fly", "liger")):
            if fly_v in timed and alone in timed:
                row["headline"][f"{fly_v}_over_{alone}"] = timed[alone] / timed[fly_v]
    return row


def record(res: Results, model_name: str, precision: str, runs: list[dict[str, Any]]) -> None:
    """One row per variant (step time, its ratio against the fastest baseline, cold start, memory, losses); the
    headline and the noise floor in the summary; per-process details (swaps, dispatch, profiles) in the JSON only."""
    row = summarise(runs)
    head = row.get("headline") or {}
    best_base = row.get(head.get("best_baseline"), {}).get("step_ms")
    for v, e in row.items():
        if v not in VARIANTS:
            continue
        res.add(
            model=model_name,
            precision=precision,
            variant=v,
            step_ms=e.get("step_ms"),
            vs_best_baseline=(
                best_base / e["step_ms"] if best_base and "step_ms" in e and v not in REST_VARIANTS else None
            ),
            runs_ms=e.get("runs_ms"),
            first_step_s=e.get("first_step_s"),
            peak_gib=e.get("peak_gib"),
            max_loss_diff=e.get("max_loss_diff"),
            error=e.get("error", ""),
            # a rest run's bound is taken against this invocation's own fastest baseline (goal_bounds.step_bounds)
            **(
                dict(same_run_baseline=head.get("best_baseline"), same_run_baseline_ms=best_base)
                if v in REST_VARIANTS and best_base
                else {}
            ),
        )
        res.details[f"{model_name}/{precision}/{v}"] = {
            k: e[k] for k in ("swapped", "left", "dispatch", "profile_top") if k in e
        }
    res.summary[f"{model_name}/{precision}"] = {**head, **row.get("noise", {})}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", nargs=3, metavar=("MODEL", "VARIANT", "PRECISION"), help="run one variant, print JSON")
    p.add_argument("--models", default="qwen3_moe,olmoe,mixtral")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--precisions", default=",".join(PRECISIONS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timeout", type=int, default=900, help="seconds per worker process")
    p.add_argument("--profile", action="store_true", help="record each process's largest kernels over one step")
    p.add_argument("--from-runs", nargs="+", metavar="JSONL", help="summarise saved processes instead of running")
    p.add_argument("--env-from", nargs="+", metavar="JSON", help="with --from-runs: the invocations' result files")
    p.add_argument("--note", action="append", default=[], help="a note for the result (repeatable)")
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, profile=args.profile)), flush=True)
        return
    res = Results("train_step")
    if args.from_runs:  # processes of several invocations on one machine (each has its own stock runs)
        runs = [json.loads(ln) for path in args.from_runs for ln in open(path) if ln.strip()]
        for key in dict.fromkeys((r["model"], r["precision"]) for r in runs):
            record(res, *key, [r for r in runs if (r["model"], r["precision"]) == key])
        envs = [json.loads(open(path).read())["environment"] for path in args.env_from or []]
        env = None
        if envs:  # every invocation's revision and date, not only the first's
            env = dict(envs[0], command=" ; ".join(e["command"] for e in envs))
            env["git_rev"] = ", ".join(dict.fromkeys(str(e.get("git_rev")) for e in envs))
            env["date_utc"] = ", ".join(dict.fromkeys(str(e.get("date_utc")) for e in envs))
        res.notes.append(
            f"summarised from {len(args.from_runs)} process-record file(s) (each may hold several invocations; "
            "runs are pooled by model and precision)"
        )
    else:
        variants = [v for v in args.variants.split(",") if v != "stock"]
        for model_name in args.models.split(","):
            arch = MODELS[model_name].arch
            arch_variants = [v for v in variants if not v.startswith("liger") or liger_entry(arch)]
            for precision in args.precisions.split(","):
                runs = []
                for order in rotated(arch_variants, args.rounds):
                    for v in order:
                        r = run_worker(model_name, v, precision, args.timeout, args.profile)
                        with open(results_dir() / "train_step_runs.jsonl", "a") as f:  # kept if cut short
                            f.write(json.dumps(r) + "\n")
                        print(json.dumps({k: r.get(k) for k in ("variant", "step_ms", "first_step_s", "error")}))
                        runs.append(r)
                record(res, model_name, precision, runs)
    res.notes.append(
        f"{STEPS} steps per process, median over steps {WARMUP}..{STEPS - 1}; step = forward with labels, backward, "
        "fused AdamW, zero_grad, with a device sync at both ends; first_step_s = step 0 (compilation, autotuning)"
    )
    res.notes.append(
        "vs_best_baseline = the fastest of stock/compile/liger over this variant (> 1: faster); summary speedup = "
        "the same for the fastest variant with fly in it"
    )
    res.notes.extend(args.note)
    print(res.save(env=env if args.from_runs else None))
    print(res.markdown())


if __name__ == "__main__":
    main()
