"""Cold start: the first training step of a first run, a second run and a pre-tuned run, against stock (GPU).

One transformers model at real layer dimensions (``bench_train_step``'s cases), each run a process of its own
(``bench_train_step --worker``), in this order:

- ``stock`` first and second run (one Triton / Inductor cache directory for both);
- ``fly`` (default policy, ``select="first"``): first run on empty caches, second run on the caches it left;
- ``fly_measure`` (``FLY_LIGHTNING_SELECT=measure``: backends and grouped GEMM configurations measured per shape):
  first run on an empty Triton cache and an empty tuning database, second run reusing both;
- ``fly_pretuned``: ``fly-lightning tune --hf-config`` (the model's config, the run's batch and sequence length) on
  empty caches, then a measured-selection run on what it left: it must measure nothing (``tuning_spent_s`` 0).

Reported per run: first-step time (compilation, autotuning, measuring), model build + swap time, steady-state median
step, seconds spent measuring; the goal ratio is a run's first step over stock's first run. The tuning database the
measured runs wrote is summarised (per op, which backend won how many shapes, and the shapes where ATen won).

    python -m benchmarks.bench_cold_start --model qwen3_moe
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.harness import Results
from benchmarks.train_step_cases import MODELS, run_worker

GOAL = 1.5  # a second (or pre-tuned) run's first step at most this times stock's first run's
SMALL_TOKENS = 64


def _env(root: Path, name: str, **extra: str) -> dict[str, str]:
    """An environment with its own Triton / Inductor caches and tuning database under ``root/name``."""
    d = root / name
    return dict(
        os.environ,
        TRITON_CACHE_DIR=str(d / "triton"),
        TORCHINDUCTOR_CACHE_DIR=str(d / "inductor"),
        FLY_LIGHTNING_TUNING_DB=str(d / "tuning.json"),
        **extra,
    )


def _pretune(
    model: str, env: dict[str, str], timeout_s: int, batch: int | None = None, seq: int | None = None
) -> tuple[float, str]:
    """``fly-lightning tune --hf-config`` for the model's config at its batch and sequence length (or the given
    ones); (seconds, its summary line or the error)."""
    import time

    from transformers import AutoConfig

    case = MODELS[model]
    cfg_dir = Path(env["FLY_LIGHTNING_TUNING_DB"]).parent / "config"
    AutoConfig.for_model(case.arch, vocab_size=32000, max_position_embeddings=case.seq, **case.config).save_pretrained(
        cfg_dir
    )
    cmd = [sys.executable, "-m", "fly_lightning.cli", "tune", "--hf-config", str(cfg_dir), "--batch-size",
           str(batch or case.batch), "--seq-len", str(seq or case.seq), "--steps", "2"]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    said = [ln for ln in proc.stdout.splitlines() if "tuned into" in ln]
    tail = said or proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
    return time.perf_counter() - start, tail[-1][:300]


def winners(db_path: Path) -> dict[str, Any]:
    """Per op: shapes won by each backend, and the shapes where ATen won (with the timings)."""
    from fly_lightning.tuning import TuningDB

    out: dict[str, Any] = {}
    for _, op, key, entry in TuningDB(db_path).entries():
        o = out.setdefault(op, {"won": {}, "aten_won": []})
        o["won"][entry["backend"]] = o["won"].get(entry["backend"], 0) + 1
        if entry["backend"] == "aten":
            o["aten_won"].append({"key": key, "timings_ms": entry.get("timings_ms", {})})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3_moe", choices=sorted(MODELS))
    p.add_argument("--precision", default="bf16-true")
    p.add_argument("--timeout", type=int, default=300, help="seconds per process")
    args = p.parse_args()
    res = Results("cold_start")
    measure = {"FLY_LIGHTNING_SELECT": "measure"}
    with tempfile.TemporaryDirectory(prefix="fly-cold-") as tmp:
        root = Path(tmp)
        plan = [
            ("stock", "first", "stock", _env(root, "stock")),
            ("stock", "second", "stock", _env(root, "stock")),
            ("fly", "first", "fly", _env(root, "fly")),
            ("fly", "second", "fly", _env(root, "fly")),
            ("fly_measure", "first", "fly", _env(root, "measure", **measure)),
            ("fly_measure", "second", "fly", _env(root, "measure", **measure)),
        ]
        runs: list[tuple[str, str, dict[str, Any]]] = []
        for name, which, variant, env in plan:
            r = run_worker(args.model, variant, args.precision, args.timeout, env=env)
            runs.append((name, which, r))
            print(json.dumps({"run": f"{name}/{which}", **{k: r.get(k) for k in ("first_step_s", "error")}}))
        pre_env = _env(root, "pretuned", **measure)
        pretune_s, pretune_out = _pretune(args.model, pre_env, args.timeout)
        runs.append(("fly_pretuned", "after tune", run_worker(args.model, "fly", args.precision, args.timeout,
                                                             env=pre_env)))  # fmt: skip
        res.summary["pretune"] = {"seconds": round(pretune_s, 2), "output": pretune_out}
        # the same model at a few tokens per step (a short-sequence or decode-like shape): where ATen may win
        small_env = _env(root, "small", **measure)
        small_s, small_out = _pretune(args.model, small_env, args.timeout, batch=1, seq=SMALL_TOKENS)
        res.summary["pretune_small"] = {"tokens": SMALL_TOKENS, "seconds": round(small_s, 2), "output": small_out}
        res.summary["winners"] = winners(root / "measure" / "tuning.json")
        res.summary["winners_small"] = winners(root / "small" / "tuning.json")
    stock = [r for n, w, r in runs if (n, w) == ("stock", "first") and "error" not in r]
    stock_first = stock[0]["first_step_s"] if stock else None
    stock_to_first = stock[0]["build_s"] + stock[0]["first_step_s"] if stock else None
    for name, which, r in runs:
        res.add(
            model=args.model,
            precision=args.precision,
            run=name,
            which=which,
            first_step_s=r.get("first_step_s"),
            vs_stock_first=(r["first_step_s"] / stock_first) if stock_first and "first_step_s" in r else None,
            build_s=r.get("build_s"),
            to_first_step_s=r["build_s"] + r["first_step_s"] if "build_s" in r else None,
            vs_stock_to_first=(r["build_s"] + r["first_step_s"]) / stock_to_first if stock and "build_s" in r else None,
            step_ms=r.get("step_ms"),
            tuning_spent_s=r.get("tuning_spent_s"),
            error=r.get("error", ""),
        )
        res.details[f"{name}/{which}"] = {k: r[k] for k in ("dispatch", "times_ms") if k in r}
    goal = {f"{n}/{w}": row["vs_stock_first"] for (n, w, _), row in zip(runs, res.rows, strict=True)
            if w != "first" and n != "stock" and row["vs_stock_first"] is not None}  # fmt: skip
    res.summary["goal"] = f"second or pre-tuned run's first step <= {GOAL}x stock's first run's"
    res.summary["ratios"] = {k: round(v, 3) for k, v in goal.items()}
    res.summary["met"] = bool(goal) and all(v <= GOAL for v in goal.values())
    pre = next((r for n, _, r in runs if n == "fly_pretuned"), {})
    res.summary["pretuned_run_measured_s"] = pre.get("tuning_spent_s")
    res.notes.append(
        "each run is a process of its own; 'second' reuses the Triton/Inductor cache directory and tuning database "
        "its 'first' run left; first_step_s = step 0 (JIT compilation, autotuning, measuring); build_s = model "
        "construction and swap (fly: with the package's import); to_first_step_s = both; step_ms = median of "
        "steps 4..15; winners = the tuning database's choices per op after the measured first run, winners_small "
        f"= after a pre-tune at {SMALL_TOKENS} tokens per step"
    )
    res.save()


if __name__ == "__main__":
    main()
