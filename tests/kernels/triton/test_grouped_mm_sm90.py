"""The grouped GEMM kernel compiles for the H200 (sm_90) in every variant the table, tuning and MoE layer use: no
register spills, wgmma and TMA where expected, and warp specialisation taking effect exactly where the launcher keeps
it (TMA loads and the TMA store; see ``_effective_config``). Runs Triton's compiler and bundled ptxas on the CPU (no
GPU), in a subprocess without the interpreter."""


def test_kernel_compiles_for_sm90(compiled_variants):
    results = compiled_variants("sm90_compile.py")
    for name, r in results.items():
        assert r["spill_bytes"] == 0, (name, r)
        assert r["wgmma"] > 0, (name, r)
        assert r["specialised"] == r["ws_effective"], (name, r)
        assert r["ws_effective"] <= r["ws_requested"], (name, r)
        assert r["shared"] <= 232448, (name, r)  # H100/H200: 227 KB of shared memory per block
    assert results["gather"]["tma_loads"] > 0  # the weights still come through TMA when rows are gathered
    assert results["pointer-128x128"]["tma_loads"] == 0
    for name in ("ws-scatter", "ws-pointer-store"):  # asked for, dropped: no TMA store
        assert results[name]["ws_requested"] and not results[name]["specialised"], results[name]
    assert any(r["specialised"] for r in results.values())  # the tune candidates with the TMA store
