"""The fp8 grouped kernel compiles for sm_90 (Hopper) on the CPU: e4m3 warpgroup MMAs fed by TMA loads, no register
spills, within Hopper's shared memory; the scales through TMA replace the per-thread global loads of the pointer form.
Says nothing about speed."""


def test_compiles_to_fp8_wgmma_fed_by_tma(compiled_variants):
    results = compiled_variants("mx_fp8_grouped_sm90_compile.py")
    assert len(results) == 4
    for name, r in results.items():
        assert r["ok"] and r["spill_bytes"] == 0 and r["shared"] <= 232448, (name, r)
        assert r["fp8_wgmma"] > 0 and r["tma_loads"] > 0, (name, r)
    for tiles in ("default", "64x256"):
        tma, ptr = results[tiles], results[f"{tiles}-ptr-scales"]
        assert tma["tma_loads"] > ptr["tma_loads"] and tma["global_loads"] < ptr["global_loads"], (tma, ptr)
