"""The fp8 grouped GEMM compiles for the H200 (sm_90) in the MX grouped plan's tiles: no register spills, fp8 wgmma,
its loads prefetched by the software pipeline, within Hopper's shared memory. Runs Triton's compiler and bundled
ptxas on the CPU, in a subprocess without the interpreter."""


def test_compiles_for_sm90(compiled_variants):
    results = compiled_variants("fp8_grouped_mm_sm90_compile.py")
    assert len(results) == 1
    for name, r in results.items():
        assert r["spill_bytes"] == 0 and r["fp8_wgmma"] > 0 and r["async_copies"] > 0, (name, r)
        assert r["shared"] <= 232448, (name, r)  # H100/H200: 227 KB of shared memory per block
