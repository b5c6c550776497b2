"""The MX GEMM kernel compiles for the H200 (sm_90) for every format pair in the plans the launcher picks: no register
spills, wgmma (bf16 MMAs), the MX bytes prefetched by the software pipeline (async copies) on the large plans, and
within Hopper's shared memory. Runs Triton's compiler and bundled ptxas on the CPU, in a subprocess without the
interpreter."""


def test_compiles_for_sm90(compiled_variants):
    results = compiled_variants("mx_scaled_mm_sm90_compile.py")
    assert len(results) == 16
    for name, r in results.items():
        assert r["spill_bytes"] == 0, (name, r)
        assert r["wgmma"] > 0, (name, r)
        assert r["shared"] <= 232448, (name, r)  # H100/H200: 227 KB of shared memory per block
        if name.endswith(("mid", "large", "fp32out")):
            assert r["async_copies"] > 0, (name, r)
