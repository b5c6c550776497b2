"""The cold-start benchmark's plan and arithmetic: which runs share caches, the goal ratio against stock's first
run, the pre-tuned run's measuring time, the tuning database's winners (fake workers; the GPU run is the result)."""

import json
import sys

from benchmarks import bench_cold_start
from fly_lightning.tuning import TuningDB


def test_runs_share_caches_as_planned_and_the_goal_is_judged_against_stock(monkeypatch, tmp_path):
    seen = []
    first = {"stock": 2.0, "fly": 8.0}

    def fake_worker(model, variant, precision, timeout_s, env=None):
        measuring = env.get("FLY_LIGHTNING_SELECT") == "measure"
        db = env["FLY_LIGHTNING_TUNING_DB"]
        warm = any(e["TRITON_CACHE_DIR"] == env["TRITON_CACHE_DIR"] for _, e in seen)
        seen.append((variant, dict(env)))
        if measuring and not warm:
            TuningDB(db).put("env", "rms_norm", "k1", "aten", {"aten": 1.0, "triton": 2.0})
        step = 2.5 if warm else first[variant] + (5.0 if measuring else 0.0)
        spent = 4.0 if measuring and not warm and "pretuned" not in db else 0.0
        return dict(first_step_s=step, build_s=1.0, step_ms=30.0, tuning_spent_s=spent, times_ms=[1.0])

    def fake_pretune(model, env, timeout_s, batch=None, seq=None):
        seen.append(("tune" if batch is None else "tune_small", dict(env)))  # leaves its caches warm
        if batch is not None:
            TuningDB(env["FLY_LIGHTNING_TUNING_DB"]).put("env", "moe_route", "64", "aten", {"aten": 0.01})
        return 12.0, "3 shape(s) tuned"

    monkeypatch.setattr(bench_cold_start, "run_worker", fake_worker)
    monkeypatch.setattr(bench_cold_start, "_pretune", fake_pretune)
    monkeypatch.setenv("FLY_RESULTS_DIR", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["bench_cold_start", "--model", "tiny_qwen3_moe"])
    bench_cold_start.main()
    out = json.loads((tmp_path / "cold_start.json").read_text())
    runs = {f"{r['run']}/{r['which']}": r for r in out["rows"]}
    assert runs["stock/first"]["vs_stock_first"] == 1.0
    assert runs["fly/first"]["vs_stock_first"] == 4.0 and runs["fly/second"]["vs_stock_first"] == 1.25
    assert runs["fly_measure/first"]["tuning_spent_s"] == 4.0
    assert out["summary"]["ratios"] == {"fly/second": 1.25, "fly_measure/second": 1.25, "fly_pretuned/after tune": 1.25}
    assert out["summary"]["met"] is True and out["summary"]["pretuned_run_measured_s"] == 0.0
    assert out["summary"]["winners_small"] == {"moe_route": {"won": {"aten": 1}, "aten_won": [
        {"key": "64", "timings_ms": {"aten": 0.01}}]}}  # fmt: skip
    assert runs["fly/second"]["vs_stock_to_first"] == (1.0 + 2.5) / (1.0 + 2.0)
    assert out["summary"]["winners"]["rms_norm"] == {
        "won": {"aten": 1}, "aten_won": [{"key": "k1", "timings_ms": {"aten": 1.0, "triton": 2.0}}]
    }  # fmt: skip
    # the pre-tuned run uses the caches and database the tune left, and nobody else's
    tune_env = next(e for v, e in seen if v == "tune")
    pretuned_run = next(e for v, e in seen if v == "fly" and "pretuned" in e["TRITON_CACHE_DIR"])
    assert pretuned_run["TRITON_CACHE_DIR"] == tune_env["TRITON_CACHE_DIR"]
    assert len({e["TRITON_CACHE_DIR"] for _, e in seen}) == 5
