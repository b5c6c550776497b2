"""The whole-step benchmark's arithmetic: rotation with the stock noise floor, per-variant summary, headline ratio."""

import torch

from benchmarks.bench_train_step import record, rotated, summarise
from benchmarks.harness import Results
from benchmarks.train_step_cases import MODELS, _build, _stand_in_moe_blocks


def _run(variant: str, ms: float, losses=(2.0, 1.5), **extra):
    return dict(variant=variant, step_ms=ms, first_step_s=1.0, peak_gib=3.0, losses=list(losses), **extra)


def test_rotation_runs_stock_twice_per_round_and_moves_the_first():
    orders = rotated(["fly", "compile"], 3)
    assert orders[0] == ["stock", "stock", "fly", "compile"]
    assert [o[0] for o in orders] == ["stock", "stock", "fly"]
    assert all(sorted(o) == ["compile", "fly", "stock", "stock"] for o in orders)


def test_summary_compares_the_fastest_with_fly_against_the_fastest_baseline():
    runs = [
        _run("stock", 50.0),
        _run("stock", 51.0, losses=(2.0, 1.6)),
        _run("liger", 40.0),
        _run("compile", 42.0),
        _run("fly", 45.0),
        _run("liger_fly", 32.0, losses=(2.0, 1.45)),
        _run("fly_compile", 44.0),
        dict(variant="mixtral_only", error="no Liger-Kernel entry"),
    ]
    row = summarise(runs)
    assert row["headline"]["best_baseline"] == "liger" and row["headline"]["best_with_fly"] == "liger_fly"
    assert row["headline"]["speedup"] == 40.0 / 32.0
    assert row["headline"]["liger_fly_over_liger"] == 40.0 / 32.0
    assert row["headline"]["fly_compile_over_compile"] == 42.0 / 44.0
    assert row["noise"]["stock_vs_stock"] == 1.0 / 50.0
    assert abs(row["liger_fly"]["max_loss_diff"] - 0.05) < 1e-12
    assert row["mixtral_only"] == {"error": "no Liger-Kernel entry"}
    assert row["stock"]["runs_ms"] == [50.0, 51.0]
    assert row["headline"]["failed_baselines"] == []


def test_a_failed_baseline_is_named_in_the_headline():
    runs = [_run("stock", 50.0), _run("stock", 50.0), dict(variant="compile", error="timed out"), _run("fly", 45.0)]
    headline = summarise(runs)["headline"]
    assert headline["best_baseline"] == "stock" and headline["failed_baselines"] == ["compile"]


def test_rest_rows_carry_their_invocations_baseline_and_no_ratio():
    runs = [_run("stock", 50.0), _run("stock", 50.0), _run("compile", 40.0), _run("compile_rest", 10.0),
            _run("fly_compile", 38.0)]  # fmt: skip
    res = Results("train_step")
    record(res, "m", "bf16-true", runs)
    rows = {r["variant"]: r for r in res.rows}
    assert rows["compile_rest"]["vs_best_baseline"] is None  # never a result
    assert rows["compile_rest"]["same_run_baseline"] == "compile" and rows["compile_rest"]["same_run_baseline_ms"] == 40
    assert "same_run_baseline" not in rows["fly_compile"] and rows["fly_compile"]["vs_best_baseline"] == 40 / 38


def test_rest_variant_takes_the_moe_blocks_out_and_keeps_their_parameters():
    model, _ = _build(MODELS["tiny_qwen3_moe"], "stock", "bf16-true", torch.device("cpu"))
    params = _stand_in_moe_blocks(model)
    assert params and all(p.requires_grad for p in params)
    ids = torch.randint(0, 100, (1, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is None for p in params)  # the blocks computed nothing
