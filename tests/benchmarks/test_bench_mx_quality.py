"""The MX quality comparison runs the recipe's model the same way per format and reports the loss differences."""

from benchmarks.bench_mx_quality import run
from fly_lightning.policy import dispatch_config


def test_rows_share_the_start_and_report_against_the_unquantised_run():
    with dispatch_config(backends=("aten",)):  # the interpreter's kernels would take minutes; numerics are the same
        res = run(steps=1, precision="32-true", quants=("none", "mxfp4", "mxfp4:rceil"), val_batches=2)
    none, mx, rceil = res.rows
    assert [(r["quant"], r["mode"]) for r in res.rows] == [("none", "-"), ("mxfp4", "floor"), ("mxfp4", "rceil")]
    assert abs(none["val_loss_before"] - mx["val_loss_before"]) < 0.05  # same seed and data: only the casts differ
    assert none["vs_bf16"] == 0 and mx["vs_bf16"] == mx["val_loss"] - none["val_loss"]
    assert mx["val_loss"] != none["val_loss"]  # the MX casts reached the GEMMs
    assert rceil["val_loss"] != mx["val_loss"]  # the scale mode reached the casts
    assert set(res.summary) == {"none_val_loss", "mxfp4_floor_val_loss", "mxfp4_rceil_val_loss"}
