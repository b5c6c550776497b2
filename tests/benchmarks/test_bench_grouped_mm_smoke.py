"""The grouped-GEMM and MoE-layer suites, run end to end on tiny shapes on the CPU (Triton interpreter): they must not
fail on the GPU run for a Python error. Timings here mean nothing."""

import torch

from benchmarks.bench_grouped_mm import suite
from benchmarks.bench_moe_layer import run_moe
from benchmarks.grouped_mm_cases import Case, cases, hot_counts, uniform_counts, zipf_counts

TINY = [
    Case("uniform-tiny", "uniform", 4, 32, 48, uniform_counts(40, 4), k_major=False),
    Case("proj-tiny", "projection", 6, 48, 32, uniform_counts(50, 6)),
    Case("uneven-tiny", "uneven", 6, 48, 32, zipf_counts(50, 6, 1.5, 0.3, seed=1), load="zipf"),
    Case("hot-tiny", "uneven", 5, 32, 32, hot_counts(30, 5, 1.0), load="hot"),
]


def test_the_24_cases():
    cs = cases()
    assert len(cs) == 24 and len({c.name for c in cs}) == 24
    assert {c.family for c in cs} == {"uniform", "projection", "uneven"}
    assert all(len(c.counts) == c.e and c.m > 0 for c in cs)
    assert any(0 in c.counts for c in cs) and any(max(c.counts) == c.m for c in cs)


def test_suite_runs(monkeypatch):
    res = suite("none", case_list=TINY, device="cpu", reps=1)
    assert res.suite == "grouped_mm" and len(res.rows) == len(TINY)
    for row in res.rows:
        assert row["fly_backend"] == "triton" and row["fly_err"] < 2e-2 and row["aten_err"] < 2e-2, row
        assert row["x_vs_aten"] > 0 and row["x_vs_loop"] > 0 and row["tuned_x_vs_aten"] > 0
        assert row["dense_ms"] > 0 and row["dense_x_vs_aten"] > 0  # the ceiling reference ran too
        assert row["fly_cold_s"] > 0 and row["fly_tune_s"] > 0  # cold start, reported apart
    assert res.summary["failed_checks"] == [] and res.summary["n_x_vs_aten"] == len(TINY)
    assert res.summary["fly_cold_s_total"] >= res.summary["fly_cold_s_max"] > 0
    assert res.summary["n_tuned_x_vs_aten"] == len(TINY)


def test_moe_benchmark_runs():
    models = {"tiny": ("qwen3_moe", 32, 32, 6, 2, 24, True)}
    res = run_moe(device="cpu", models=models, dtype=torch.float32, reps=(1, 1))
    assert res.suite == "moe_layer"
    assert {r["variant"] for r in res.rows} == {"hf_grouped_mm", "fused", "plain", "plain_aten"}
    assert all(r["baseline"] == "hf_grouped_mm" and r["rel_err_vs_baseline"] < 1e-5 for r in res.rows), res.rows
    assert "tiny_fused_over_hf_grouped_mm_fwd" in res.summary and "tiny_fused_over_plain_fwd_bwd" in res.summary
