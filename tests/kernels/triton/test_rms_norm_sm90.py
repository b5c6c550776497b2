"""The RMSNorm kernels compile for the H200 (sm_90) in the variants the launcher uses, without register spills and with
16-byte vector loads and stores (the point of the aligned-rows and aligned-interior designs). Runs Triton's compiler
and bundled ptxas on the CPU (no GPU), in a subprocess without the interpreter."""


def test_kernels_compile_for_sm90_with_vector_memory_access(compiled_variants):
    results = compiled_variants("rms_norm_sm90_compile.py")
    for name, r in results.items():
        assert r["spill_bytes"] == 0, (name, r)
        assert r["vector_loads"] > 0 and r["vector_stores"] > 0, (name, r)
        if name.startswith("rows"):
            assert r["scalar_loads"] == 0, (name, r)  # aligned rows: every x and weight load is a vector
