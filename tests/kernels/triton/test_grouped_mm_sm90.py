"""The grouped GEMM kernel compiles for the H200 (sm_90) in every variant the table, tuning and MoE layer use: no
register spills, wgmma and TMA where expected, and warp specialisation taking effect where requested. Runs Triton's
compiler and bundled ptxas on the CPU (no GPU), in a subprocess without the interpreter."""


def test_kernel_compiles_for_sm90(compiled_variants):
    results = compiled_variants("sm90_compile.py")
    for name, r in results.items():
        assert r["spill_bytes"] == 0, (name, r)
        assert r["wgmma"] > 0, (name, r)
        assert r["specialised"] == r["ws_requested"], (name, r)
        assert r["shared"] <= 232448, (name, r)  # H100/H200: 227 KB of shared memory per block
    assert results["gather"]["tma_loads"] > 0  # the weights still come through TMA when rows are gathered
    assert results["pointer-128x128"]["tma_loads"] == 0
