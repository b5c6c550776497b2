"""The fp8 grouped kernel compiles for sm_90 (Hopper) on the CPU: e4m3 warpgroup MMAs fed by TMA loads, no register
spills; the plan's tiles leave room for the two programs per SM they are launched with (registers and shared
memory). Says nothing about speed."""

from fly_lightning.kernels.triton._mx_grouped_mm_kernel import FP8


def test_compiles_to_fp8_wgmma_fed_by_tma(compiled_variants):
    results = compiled_variants("mx_fp8_grouped_sm90_compile.py")
    assert len(results) == 2
    for name, r in results.items():
        assert r["ok"] and r["spill_bytes"] == 0 and r["shared"] <= 232448, (name, r)
        assert r["fp8_wgmma"] > 0 and r["tma_loads"] > 0, (name, r)
    r = results["default"]  # Hopper: 64K registers and 228 KB of shared memory per SM
    assert FP8.programs_per_sm * r["registers"] * r["threads"] <= 65536, r
    assert FP8.programs_per_sm * (r["shared"] + 1024) <= 233472, r
