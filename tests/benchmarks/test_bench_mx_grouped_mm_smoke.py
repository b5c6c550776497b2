"""The MX grouped-GEMM suite end to end on one tiny case on the CPU (Triton interpreter): it must not fail on the GPU
run for a Python error, and every column and goal must reach the summary. Timings here mean nothing."""

from benchmarks.bench_mx_grouped_mm import FORMATS, SMOKE_CASES, suite


def test_suite_runs_every_column():
    res = suite(SMOKE_CASES[1:], device="cpu", reps=1)  # the uneven case: an empty group
    assert res.suite == "mx_grouped_mm" and len(res.rows) == 1
    row = res.rows[0]
    assert row["empty"] == 1 and row["bf16_ms"] > 0
    for f in FORMATS:
        assert row[f"{f}_backend"] == "triton" and row[f"{f}_err"] < 1e-2 and row[f"{f}_emul_err"] < 1e-2, row
        for col in ("", "_loop", "_swap", "_emul", "_cast_x", "_cast_w", "_incl", "_emul_incl"):
            assert row[f"{f}{col}_ms"] > 0, col
        assert row[f"{f}_swap_err"] < 1e-2, row  # few rows per group: the swapped candidate is checked and timed
        for key in ("x_vs_bf16", "loop_x_vs_bf16", "swap_x_vs_bf16", "x_vs_emul", "incl_x_vs_emul_incl"):
            assert row[f"{f}_{key}"] > 0 and res.summary[f"geomean_{f}_{key}"] > 0
        assert res.summary[f"goal_{f}_x_vs_bf16"] == 0.9 and res.summary[f"goal_{f}_x_vs_emul"] == 1.5
        assert res.summary[f"{f}_failed_checks"] == [] and res.summary[f"{f}_not_on_triton"] == []
