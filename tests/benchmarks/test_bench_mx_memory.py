"""The MX memory suite on tiny dims on the CPU: every storage mode builds and steps, and the stored bytes per expert
parameter are what each mode promises (the GPU run adds the peak)."""

from benchmarks.bench_mx_memory import VARIANTS, run


def test_every_mode_runs_and_stores_what_it_promises():
    rows = {r["variant"]: r for r in run("cpu", (64, 64, 4, 2, 32), layers=(1, 2), reps=1).rows}
    assert list(rows) == list(VARIANTS)
    stored = {v: r["stored_B_per_param"] for v, r in rows.items()}
    grads = {v: r["grad_B_per_param"] for v, r in rows.items()}
    assert stored == {"bf16_trained": 2.0, "bf16_frozen": 2.0, "mxfp8_trained": 2.0,
                      "mxfp8_frozen": round(1 + 1 / 32, 4), "mxfp4_frozen": round(0.5 + 1 / 32, 4)}  # fmt: skip
    assert grads["bf16_trained"] == grads["mxfp8_trained"] == 2.0
    assert grads["bf16_frozen"] == grads["mxfp8_frozen"] == grads["mxfp4_frozen"] == 0.0
