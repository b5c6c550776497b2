"""The goal-bound arithmetic of ``benchmarks/goal_bounds.py``, on hand-made rows (CPU)."""

import json
import shutil

import pytest

from benchmarks.goal_bounds import (
    grouped_bounds,
    main,
    moe_roof_ms,
    roofline_ms,
    route_bounds,
    run_copy_gbps,
    step_bounds,
    suite_bytes,
    w4_bounds,
)
from benchmarks.harness import RESULTS_DIR
from benchmarks.train_step_cases import MODELS, ModelCase


def test_roofline_takes_the_slower_of_compute_and_memory():
    # 1000 TFLOP/s and 1000 GB/s: 2*1024^3 FLOPs take 2.147 us; 2 bytes x 3 x 1024^2 take 6.29 us
    assert roofline_ms(1024, 1024, 1024, 1, 1000.0, 1000.0) == pytest.approx(6 * 1024**2 / 1e9)
    # every expert's weight is read: 64 experts move 64x the weight bytes
    assert roofline_ms(1024, 1024, 1024, 64, 1000.0, 1e9) == pytest.approx(2 * 1024**3 / 1e12)
    memory_bound = roofline_ms(1024, 1024, 1024, 64, 1e9, 1000.0)
    assert memory_bound == pytest.approx(2 * (2 * 1024**2 + 64 * 1024**2) / 1e9)


def test_grouped_bounds_place_peer_ours_and_dense_against_the_roof():
    row = dict(case="c", M=4096, K=4096, N=4096, E=1)
    roof = 2 * 4096**3 / 500e9  # compute-bound at 500 TFLOP/s (memory at 1e9 GB/s is instant)
    rows, summary = grouped_bounds([dict(row, peer_ms=2 * roof, fly_ms=1.25 * roof, dense_ms=roof)], 500.0, 1e9)
    assert rows[0]["bound"] == "compute"
    assert rows[0]["peer_over_roof"] == 2.0 and rows[0]["fly_of_roof"] == 0.8 and rows[0]["dense_of_roof"] == 1.0
    assert summary["ceiling_x_vs_peer"] == 2.0 and summary["goal_needs_of_roof"] == 0.6
    assert summary["cases_under_goal_even_at_roof"] == []
    # memory-bound with 64 experts: dense (one expert's weight) is placed against a roof that reads one weight
    many = dict(case="m", M=64, K=4096, N=4096, E=64)
    (r,), _ = grouped_bounds([dict(many, peer_ms=1.0, fly_ms=1.0, dense_ms=roofline_ms(64, 4096, 4096, 1, 1e9, 1e3))],
                             1e9, 1e3)  # fmt: skip
    assert r["bound"] == "memory" and r["dense_of_roof"] == 1.0
    _, tight = grouped_bounds([dict(row, peer_ms=1.1 * roof, fly_ms=roof, dense_ms=roof)], 500.0, 1e9)
    assert tight["cases_under_goal_even_at_roof"] == ["c"] and tight["goal_needs_of_roof"] > 1


def test_route_bounds_take_the_fastest_launch_measured_and_the_suite_bytes():
    floor = dict(case="r", aten_us=400.0, ours_us=10.0, copy_counts_us=8.0, copy_packed_us=9.0, score_tail_us=8.5)
    # 20 MB at 5000 GB/s take 4 us
    rows, summary = route_bounds([floor], 5000.0, {"r": (20_000_000, 16.0)})
    r = rows[0]
    assert r["ours_x"] == 40.0 and r["fastest"] == "copy_counts" and r["ceiling_x"] == 50.0
    assert r["ceiling_x_with_scores"] == pytest.approx(400 / 8.5, abs=0.05)
    assert r["fastest_pct_copy_bw"] == 50.0 and r["with_scores_pct_copy_bw"] == pytest.approx(47.1, abs=0.05)
    assert summary["bw_cases_under_goal_with_scores"] == ["r"] and summary["bw_cases_under_goal_at_fastest"] == []
    small, _ = route_bounds([dict(case="r", aten_us=400.0, ours_us=7.0)], 5000.0, {"r": (1, 1.0)})
    assert small[0]["fastest"] == "ours" and small[0]["ceiling_x_with_scores"] == small[0]["ours_x"]
    assert "fastest_pct_copy_bw" not in small[0]


def test_route_inputs_come_from_the_suite_and_the_run():
    sizes = suite_bytes()
    assert len(sizes) == 10 and sizes["qwen3-moe-64k"][1] == 16.0  # 65536 x 128 bf16 logits
    assert sizes["qwen3-moe-64k"][0] == 16 * 2**20 + 65536 * 8 * 8 + 128 * 8  # + fp32 weights, int32 ids, counts
    assert run_copy_gbps({"notes": ["copy bandwidth 4248 GB/s; graph replay"]}) == 4248.0
    with pytest.raises(ValueError, match="copy bandwidth"):
        run_copy_gbps({"notes": []})


def test_main_reads_the_result_files_and_writes_its_own_beside_them(tmp_path):
    env = {"environment": {"git_rev": "abc"}}
    g = dict(case="g", M=256, K=256, N=256, E=2, peer_ms=0.01, fly_ms=0.009, dense_ms=0.008)
    floor_row = dict(case="mixtral", aten_us=50.0, ours_us=2.0, score_tail_us=2.5)
    files = {
        "gemm_roof": dict(env, summary=dict(best_tflops=700.0, copy_GBps=4000.0), rows=[]),
        "grouped_mm": dict(env, rows=[g]),
        "moe_route_floor": dict(env, notes=["copy bandwidth 4000 GB/s"], rows=[floor_row]),
        "train_step": dict(env, rows=[]),
        "mx_gemm": dict(env, rows=[]),
    }
    for name, payload in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(payload))
    res = main(tmp_path)
    assert (tmp_path / "goal_bounds.md").exists()
    saved = json.loads((tmp_path / "goal_bounds.json").read_text())
    assert saved["summary"]["route_ceiling_x"] == 25.0
    assert saved["summary"]["sources"]["moe_route_floor"] == "abc"
    assert [r["goal"] for r in res.rows] == ["grouped 1.2x peer", "route 40x aten"]
    assert "w4_bound" not in res.summary  # the same device: placed (no weight-only rows here)


def test_the_weight_only_bound_needs_a_copy_bandwidth_from_its_device(tmp_path):
    """mx_gemm from another GPU than the roofs, without a bandwidth of its own: the weight-only bound is not placed,
    and the summary says why; with one, it is placed against that."""
    env = lambda dev: {"environment": {"git_rev": "abc", "device": dev}}  # noqa: E731
    w4 = dict(case="w4 16x4096x4096", kind="w4", m=16, n=4096, k=4096, bf16_graph_ms=0.0134, ours_graph_ms=0.0116)
    files = {
        "gemm_roof": dict(env("H200"), summary=dict(best_tflops=700.0, copy_GBps=4000.0), rows=[]),
        "grouped_mm": dict(env("H200"), rows=[]),
        "moe_route_floor": dict(env("H200"), notes=["copy bandwidth 4000 GB/s"], rows=[]),
        "train_step": dict(env("H200"), rows=[]),
        "mx_gemm": dict(env("H100"), rows=[w4]),
    }
    for name, payload in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(payload))
    res = main(tmp_path)
    assert res.summary["w4_bound"] == "not placed: mx_gemm ran on H100, the roofs on H200"
    assert not any(r["goal"].startswith("mx_gemm") for r in res.rows) and "w4_ceiling_x" not in res.summary
    # with the copy bandwidth mx_gemm measured in its own run: placed against that, on mx_gemm's device
    files["mx_gemm"]["summary"] = dict(copy_GBps=3000.0)
    (tmp_path / "mx_gemm.json").write_text(json.dumps(files["mx_gemm"]))
    res = main(tmp_path)
    assert "w4_bound" not in res.summary and res.summary["w4_device"] == "H100"
    (row,) = [r for r in res.rows if r["goal"].startswith("mx_gemm")]
    assert row["roof_ms"] == round((4096 * 4096 * (0.5 + 1 / 32) + 2 * 2 * 16 * 4096) / 3e9, 4)  # w, scales; x, out


def test_committed_goal_bounds_follow_from_the_committed_results(tmp_path):
    """The README quotes ``goal_bounds.md``: recomputing it from the committed inputs gives the committed summary."""
    for name in ("gemm_roof", "grouped_mm", "moe_route_floor", "train_step", "mx_gemm"):
        shutil.copy(RESULTS_DIR / f"{name}.json", tmp_path)
    committed = json.loads((RESULTS_DIR / "goal_bounds.json").read_text())
    assert main(tmp_path).summary == committed["summary"]


def test_w4_bounds_place_weight_only_against_its_memory_roof():
    rows = [
        dict(case="w", kind="w4", m=16, n=4096, k=4096, bf16_graph_ms=0.02, ours_graph_ms=0.01),
        dict(case="wide", kind="w4", m=128, n=4096, k=4096, bf16_graph_ms=0.05, ours_graph_ms=0.05),  # > 64 rows
        dict(case="mx", kind="mxfp4", m=16, n=4096, k=4096, bf16_graph_ms=0.02, ours_graph_ms=0.02),  # not w4
    ]
    out, s = w4_bounds(rows, 4000.0)
    roof = (4096 * 4096 * (0.5 + 1 / 32) + 2 * (16 * 4096 * 2)) / 4000e6  # fp4 pairs, scales; bf16 x and out
    assert [r["case"] for r in out] == ["w"] and out[0]["roof_ms"] == round(roof, 4)
    assert out[0]["ceiling_x"] == round(0.02 / roof, 3) and out[0]["ours_of_roof"] == round(roof / 0.01, 3)
    assert s["goal_needs_of_roof"] == round(2.5 / (0.02 / roof), 3)
    assert w4_bounds(rows[1:], 4000.0) == ([], {})  # nothing to bound: no geomean of nothing
    assert "event_ceiling_x" not in out[0] and "event_ceiling_x" not in s  # no launch floor measured: not placed


def test_w4_event_ceiling_takes_the_larger_of_the_launch_floor_and_the_roof():
    """Event-timed, a call costs at least the host's launch floor: the goal is past it when even a kernel at the
    roof with only that host cost stays under 2.5x."""
    rows = [
        dict(case="host-bound", kind="w4", m=16, n=4096, k=4096, bf16_ms=0.04, bf16_graph_ms=0.016,
             ours_graph_ms=0.01, launch_floor_ms=0.02),
        dict(case="device-bound", kind="w4", m=16, n=28672, k=4096, bf16_ms=0.08, bf16_graph_ms=0.079,
             ours_graph_ms=0.045, launch_floor_ms=0.02),
    ]  # fmt: skip
    out, s = w4_bounds(rows, 3000.0)
    roof_big = (28672 * 4096 * (0.5 + 1 / 32) + 2 * (16 * 4096 + 16 * 28672)) / 3000e6
    assert roof_big > 0.02 and out[0]["roof_ms"] < 0.02  # one case under the floor, one over it
    assert out[0]["event_ceiling_x"] == round(0.04 / 0.02, 3)
    assert out[1]["event_ceiling_x"] == round(0.08 / roof_big, 3)
    assert s["event_ceiling_x"] == round(((0.04 / 0.02) * (0.08 / roof_big)) ** 0.5, 2)
    assert s["event_goal_past_floor"] is (s["event_ceiling_x"] < 2.5)
    rows[1] = {k: v for k, v in rows[1].items() if k != "launch_floor_ms"}
    assert "event_ceiling_x" not in w4_bounds(rows, 3000.0)[1]  # a case without the floor: no geomean over part


def test_moe_roof_counts_three_passes_of_the_expert_gemms_per_layer():
    case = ModelCase("x", dict(hidden_size=1024, moe_intermediate_size=512, intermediate_size=9, num_experts=4,
                               num_experts_per_tok=2, num_hidden_layers=3), 2, 512)  # fmt: skip
    t = 1024
    flops = 3 * (2 * t * 2 * 1024 * 3 * 512 + 2 * t * 1024 * 4)
    assert moe_roof_ms(case, 1000.0, 1e12) == pytest.approx(3 * flops / 1e12)
    weights = 3 * 2 * 4 * 3 * 1024 * 512  # memory-bound at 1 GB/s: experts moved three times per layer
    assert moe_roof_ms(case, 1e12, 1.0) == pytest.approx(3 * weights / 1e6)
    # Mixtral's config names the expert size intermediate_size and the experts num_local_experts
    assert moe_roof_ms(MODELS["mixtral"], 1000.0, 1e12) > moe_roof_ms(MODELS["qwen3_moe"], 1000.0, 1e12)


def test_step_bound_adds_the_roof_to_the_fastest_rest_and_compares_with_the_fastest_baseline():
    roof = moe_roof_ms(MODELS["olmoe"], 800.0, 4000.0)
    rows = [
        dict(model="olmoe", precision="bf16-true", variant=v, step_ms=ms)
        for v, ms in (("stock", 50.0), ("compile", 30.0), ("fly_compile", 29.0), ("compile_rest", 20.0),
                      ("liger_rest", 22.0), ("fly", None))
    ]  # fmt: skip
    (b,) = step_bounds(rows, 800.0, 4000.0)
    assert b["best_baseline"] == "compile" and b["rest"] == "compile_rest" and b["best_with_fly"] == "fly_compile"
    assert b["bound_ms"] == pytest.approx(20.0 + roof, abs=1e-3)
    assert b["ceiling_x"] == pytest.approx(30.0 / (20.0 + roof), abs=1e-3)
    assert b["goal_past_roof"] == (30.0 / (20.0 + roof) < 1.15)
    assert step_bounds([r for r in rows if "rest" not in r["variant"]], 800.0, 4000.0) == []
