"""The dense MX GEMM suite, run end to end on tiny shapes on the CPU (Triton interpreter): every column and summary
key the GPU run reports is produced, the kernel serves the cases and agrees with the reference. Timings mean nothing."""

from benchmarks import bench_mx_gemm
from benchmarks.bench_mx_gemm import SHAPES, suite


def test_the_17_shapes():
    assert len(SHAPES) == 17 and len(set(SHAPES)) == 17
    ms = [m for m, _, _ in SHAPES]
    assert min(ms) == 16 and max(ms) == 16384 and sum(m >= 1024 for m in ms) >= 5 and sum(m <= 64 for m in ms) >= 4
    assert all(k % 128 == 0 for _, _, k in SHAPES)


def test_suite_runs(monkeypatch):
    monkeypatch.setattr(bench_mx_gemm, "LARGE_M", 40)  # the interpreter's cost is per program: few rows
    monkeypatch.setattr(bench_mx_gemm, "ALT_M", 40)
    monkeypatch.setattr(bench_mx_gemm, "SMALL_M", 16)
    res = suite(device="cpu", reps=1, rounds=1, shapes=[(16, 32, 128), (40, 16, 128)])
    assert res.suite == "mx_gemm"
    assert [r["kind"] for r in res.rows] == ["mxfp8", "mxfp8", "mxfp4", "mxfp4", "w4"]  # w4 only at M <= 64
    for r in res.rows:
        assert r["backend"] == "triton", r
        assert r["ours_err"] < 1e-2 and r["ours_q_err"] < 1e-2 and r["emulated_err"] < 1e-2, r
        assert all(r[f"{c}_ms"] > 0 for c in ("ours", "ours_q", "bf16", "emulated")), r
        assert r["x_vs_bf16"] > 0 and r["q_x_vs_emulated"] > 0
        assert "ours_graph_ms" not in r  # graph replays on the GPU only
    s = res.summary
    for key in ("mxfp8_geomean_vs_bf16_m1024", "mxfp4_geomean_vs_emulated", "mxfp8_q_geomean_vs_bf16_m1024"):
        assert s[key] > 0, key
    plans = res.details["plans"]  # the alternative plans at "large" M (both MX kinds), each timed or its error named
    assert set(plans) == {"mxfp8 40x16x128", "mxfp4 40x16x128"}
    assert all(isinstance(v, float) and v > 0 for p in plans.values() for key, v in p.items() if key != "plan"), plans
    assert "prepass-cublas" in plans["mxfp8 40x16x128"]  # the prepass beside the in-loop plans
    assert len(plans["mxfp8 40x16x128"]) == 3 + len(bench_mx_gemm.ALT_PLANS)
    assert s["w4_geomean_vs_bf16_m64"] > 0 and s["max_err"] < 1e-2 and s["w4_graph_geomean_vs_bf16_m64"] is None
